"""Tool calls in the model's output -> OpenAI `tool_calls`, incrementally (for SSE) or whole.

Two output formats are recognised (the ones the common chat templates and our fallback prompt ask for):

* tagged (Hermes, Qwen 2.5/3, SmolLM3, our fallback): one block per call,
  `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`, anywhere in the
  text; text outside the blocks is the message content.
* bare JSON (Llama 3.x): the whole reply is `{"name": ..., "arguments"|"parameters": {...}}` (or a
  list of those). A reply that starts with `{` is held back until it ends, then decided.

Only functions the request offered count; anything else stays text. `ToolCallParser.feed(text)`
returns `Delta`s as soon as they are certain: content text (a tail that may begin `<tool_call>` is
held back), and each call whole (id, name and arguments) once its block ends, so a client never gets
a call that turns out cut short or repeated. `finish(finish_reason)` flushes.

Two rules make forced calls (`tool_choice` required) end where clients expect:

* a call identical to an earlier one of the same reply (same name, same arguments as JSON) is not a
  parallel call but a model looping: the reply ends before it (`repeated`; the server then stops
  generating the choice, server/api/serving.py);
* a call that `max_tokens` cut short is dropped, neither a call nor content (`cut`). When whole calls came
  before it, the reply is those calls: they closed the answer as a call array's `]` would (`cut_after_calls`;
  the choice finishes with `tool_calls`, as a reply that stopped after its calls does); a reply whose only call
  was cut keeps `finish_reason: "length"`.

Example: feeding `Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>` in any split
gives content "Sure." and one call f with arguments `{"x": 1}`; repeating the block adds nothing.
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
    """Incremental parser for one choice. `names`: the functions the request offered.

    After `feed`/`finish`: `calls` so far; `repeated`: the reply wrote a call it had already made (same name,
    same arguments), so it ended there (`end`: the characters of the reply that count, the repeat
    included; later text is ignored); `cut`: a call cut short (max_tokens) was dropped."""

    names: set[str]
    calls: list[ToolCall] = field(default_factory=list)
    repeated: bool = False
    cut: bool = False
    end: int | None = None
    _buffer: str = ""
    _fed: int = 0  # characters fed so far
    _mode: str = "start"  # start (only whitespace so far) | text | call | bare | done (ended at a repeat)
    _after_call: bool = False
    _seen: set[tuple[str, str]] = field(default_factory=set)  # (name, arguments as canonical JSON) of each call

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "done":
            return []
        self._buffer += text
        self._fed += len(text)
        out: list[Delta] = []
        while True:
            before = (self._mode, len(self._buffer))
            out += self._step()
            if (self._mode, len(self._buffer)) == before:
                return [d for d in out if d.content != ""]

    @property
    def cut_after_calls(self) -> bool:
        """max_tokens cut a call short after whole ones: the reply is those calls (it finishes `tool_calls`)."""
        return self.cut and bool(self.calls)

    def finish(self, finish_reason: str | None = None) -> list[Delta]:
        """Flush at the end of the choice. An unterminated block (or bare reply) that parses as complete calls
        counts as if it had been closed; one that does not is a call cut short when `finish_reason` is
        "length" (dropped: neither a call nor content), else text. So is the start of an opening tag cut
        there (`<tool_`)."""
        out = self.feed("")
        buffer, self._buffer = self._buffer, ""
        cut = finish_reason == "length"
        if cut and self._mode == "text" and buffer.strip() and OPEN.startswith(buffer.strip()):
            self.cut = True  # a call cut before its tag was whole
            return [d for d in out if d.content != ""]
        if self._mode == "call":
            out += self._close_block(buffer, terminated=False, cut=cut)
        elif self._mode == "bare":
            out += self._bare(buffer, cut)
        elif self._mode in ("start", "text"):  # start: nothing but whitespace, which is the content
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
            self._mode = "call"
            return self._content(text)
        if self._mode == "call":
            end = self._buffer.find(CLOSE)
            if end == -1:
                return []  # a call is sent whole once its block ends: never cut, never a repeat
            block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
            return self._close_block(block, terminated=True, cut=False)
        return []  # bare: decided at finish; done: ended

    def _content(self, text: str) -> list[Delta]:
        if self._after_call:  # whitespace between or after calls is not content
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        return [Delta(content=text)] if text else []

    def _close_block(self, block: str, terminated: bool, cut: bool) -> list[Delta]:
        """The block's text without its tags: its calls, or text when it holds none of an offered function.
        An unterminated block (the reply ended inside it) loses what it wrote of the closing tag."""
        self._mode = "text"
        if not terminated:
            block = block[: len(block) - _held_tail(block, CLOSE)]
        calls = self._parse_calls(block)
        if calls is None:
            if cut:  # max_tokens ended the reply inside a call: it is neither a call nor text
                self.cut = True
                return []
            return self._content(OPEN + block + (CLOSE if terminated else ""))
        self._after_call = True
        return self._emit(calls)

    def _bare(self, text: str, cut: bool) -> list[Delta]:
        calls = self._parse_calls(text)
        if calls is None:
            header = _HEADER.match(text)
            if cut and header is not None and _name(header) in self.names:  # a bare call cut short
                self.cut = True
                return []
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
        """New calls, up to the first that repeats an earlier one: the reply ends there."""
        out = []
        for name, arguments in calls:
            key = (name, _canonical(arguments))
            if key in self._seen:
                self.repeated, self._mode = True, "done"
                self.end = self._fed - len(self._buffer)
                self._buffer = ""
                break
            self._seen.add(key)
            self.calls.append(ToolCall(_new_id(), name, arguments))
            out.append(Delta(index=len(self.calls) - 1, id=self.calls[-1].id, name=name, arguments=arguments))
        return out


def _canonical(arguments: str) -> str:
    """Arguments compared as JSON values (key order and spacing aside), or as text when not JSON."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (ValueError, RecursionError):
        return arguments


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


@dataclass(frozen=True)
class Reply:
    """A whole choice's text read for tool calls (`parse_whole`)."""

    content: str | None  # None when the reply holds only calls
    calls: list[ToolCall]
    end: int | None  # characters of the text that count when the reply ended at a repeated call, else None
    cut: bool  # a call cut short by max_tokens was dropped

    @property
    def cut_after_calls(self) -> bool:
        """`ToolCallParser.cut_after_calls`: the reply is its whole calls."""
        return self.cut and bool(self.calls)


def parse_whole(text: str, names: set[str], finish_reason: str | None = None) -> Reply:
    """Non-streamed: the content and calls of a choice that finished with `finish_reason`."""
    parser = ToolCallParser(names)
    deltas = parser.feed(text) + parser.finish(finish_reason)
    content = "".join(d.content for d in deltas if d.content is not None)
    if parser.calls:
        content = content.strip() or None
    return Reply(content, parser.calls, parser.end, parser.cut)
