"""Tool calls in the model's output -> OpenAI `tool_calls`, incrementally (for SSE) or whole.

Two output formats are recognised (the ones the common chat templates and our fallback prompt ask for):

* tagged (Hermes, Qwen 2.5/3, SmolLM3, our fallback): one block per call,
  `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`, anywhere in the
  text; text outside the blocks is the message content.
* bare JSON (Llama 3.x): the whole reply is `{"name": ..., "arguments"|"parameters": {...}}` (or a
  list of those). A reply that starts with `{` is held back until it ends, then decided.

Only functions the request offered count; anything else stays text. `ToolCallParser.feed(text)`
returns `Delta`s as soon as they are certain: content text (a tail that may begin `<tool_call>` is
held back), a call's header (id and name) as soon as `"arguments":` is read, then its arguments text
in pieces (the wrapper's closing `}` is held back until the block ends). `finish()` flushes.

Example: feeding `Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>` in any split
gives content "Sure." and one call f with arguments `{"x": 1}`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class Delta:
    """A piece of output: content text, or part of tool call number `index` (id and name come once)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict:
        """The `delta.tool_calls[]` entry of a chat chunk (call deltas only)."""
        entry: dict = {"index": self.index}
        if self.id is not None:
            entry.update(id=self.id, type="function")
        function = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        entry["function"] = function
        return entry


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _name(header: re.Match[str]) -> str | None:
    """The function name a call's header spells, or None when its escapes are not JSON's (`"\\q"`)."""
    try:
        return json.loads(f'"{header.group(1)}"')
    except ValueError:
        return None


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCallParser:
    """Incremental parser for one choice. `names`: the functions the request offered."""

    names: set[str]
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _mode: str = "start"  # start (only whitespace so far) | text | call | bare
    _header: re.Match[str] | None = None  # the current block's parsed header (known function)
    _sent_args: int = 0  # characters of the current call's arguments already sent
    _after_call: bool = False

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            before = (self._mode, len(self._buffer))
            out += self._step()
            if (self._mode, len(self._buffer)) == before:
                return [d for d in out if d.content != ""]

    def finish(self) -> list[Delta]:
        """Flush at the end of the choice (an unterminated block is parsed as if it had been closed)."""
        out = self.feed("")
        buffer, self._buffer = self._buffer, ""
        if self._mode == "call":
            out += self._close_block(buffer, terminated=False)
        elif self._mode == "start":  # nothing but whitespace: that is the content
            out += self._content(buffer)
        elif self._mode == "bare":
            out += self._bare(buffer)
        elif self._mode == "text":
            out += self._content(buffer)
        return [d for d in out if d.content != ""]

    # ---- the state machine ---------------------------------------------------------------------
    def _step(self) -> list[Delta]:
        if self._mode == "start":
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            self._mode = "bare" if stripped.startswith("{") else "text"
            return []
        if self._mode == "text":
            at = self._buffer.find(OPEN)
            if at == -1:
                keep = _held_tail(self._buffer, OPEN)
                text, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
                return self._content(text)
            text, self._buffer = self._buffer[:at], self._buffer[at + len(OPEN) :]
            self._mode, self._header, self._sent_args = "call", None, 0
            return self._content(text)
        if self._mode == "call":
            return self._call_progress()
        return []  # bare: decided at finish

    def _content(self, text: str) -> list[Delta]:
        if self._after_call:  # whitespace between or after calls is not content
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        return [Delta(content=text)] if text else []

    def _call_progress(self) -> list[Delta]:
        out: list[Delta] = []
        end = self._buffer.find(CLOSE)
        if self._header is None:
            match = _HEADER.match(self._buffer)
            name = _name(match) if match else None
            if name is not None and name in self.names:
                self._header = match
                self.calls.append(ToolCall(_new_id(), name, ""))
                call = self.calls[-1]
                out.append(Delta(index=len(self.calls) - 1, id=call.id, name=call.name, arguments=""))
        if end != -1:
            block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
            out += self._close_block(block, terminated=True)
            return out
        if self._header is not None:  # stream the arguments, holding back what may be the wrapper's end
            region = self._buffer[self._header.end() :].lstrip()
            safe = region[: len(region) - _held_tail(region, CLOSE)].rstrip()
            if safe.endswith("}"):
                safe = safe[:-1]
            out += self._send_args(safe)
        return out

    def _send_args(self, upto: str) -> list[Delta]:
        piece = upto[self._sent_args :]
        if not piece:
            return []
        self._sent_args = len(upto)
        self.calls[-1].arguments += piece
        return [Delta(index=len(self.calls) - 1, arguments=piece)]

    def _close_block(self, block: str, terminated: bool) -> list[Delta]:
        """The block's text without its tags: finish the streamed call, or parse it whole. An
        unterminated block (the reply ran out of tokens) loses what it wrote of the closing tag."""
        self._mode = "text"
        if not terminated:
            block = block[: len(block) - _held_tail(block, CLOSE)]
        if self._header is not None:
            region = block[self._header.end() :].strip()
            if region.endswith("}"):
                region = region[:-1].rstrip()
            out = self._send_args(region)
            self._header, self._after_call = None, True
            return out
        calls = self._parse_calls(block)
        if calls is None:  # not a call of an offered function: it stays text
            return self._content(OPEN + block + (CLOSE if terminated else ""))
        self._after_call = True
        return self._emit(calls)

    def _bare(self, text: str) -> list[Delta]:
        calls = self._parse_calls(text)
        if calls is None:
            self._mode = "text"
            return self._content(text)
        self._after_call = True
        return self._emit(calls)

    def _parse_calls(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call in `text` (an object or a list of them), or None."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or past the parser's limits (digits, nesting)
            return None
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            calls.append((item["name"], args if isinstance(args, str) else json.dumps(args)))
        return calls or None

    def _emit(self, calls: list[tuple[str, str]]) -> list[Delta]:
        out = []
        for name, arguments in calls:
            self.calls.append(ToolCall(_new_id(), name, arguments))
            out.append(Delta(index=len(self.calls) - 1, id=self.calls[-1].id, name=name, arguments=arguments))
        return out


def merged(deltas: list[Delta]) -> list[Delta]:
    """Consecutive call deltas of the same call as one (OpenAI sends one `tool_calls` entry per call per
    chunk, and some clients read only the first: a header and an arguments piece become one entry)."""
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if d.index is not None and last is not None and last.index == d.index and d.id is None:
            out[-1] = Delta(index=d.index, id=last.id, name=last.name,
                            arguments=(last.arguments or "") + (d.arguments or ""))
        else:
            out.append(d)
    return out


def parse_whole(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Non-streamed: (content, calls). Content is None when the reply holds only calls."""
    parser = ToolCallParser(names)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    if parser.calls:
        return (content.strip() or None), parser.calls
    return content, []
