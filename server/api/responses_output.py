"""Response objects of the Responses API and the stream events that build them, in the `openai` package's
shapes (`openai.types.responses`).

`ResponseOutput` turns a choice's pieces (content text and whole tool calls, `server/api/tool_calls.py`)
into `output` items in the order the model wrote them: a `message` item (one `output_text` part) for
text, a `function_call` item per call. For a stream it returns the events that announce them:

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added, response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done, ...
    response.completed (or response.incomplete, when max_output_tokens cut the answer)

Whitespace before a call is not shown as a message; an answer with neither text nor calls is one empty
message, as OpenAI answers.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any, Literal

from server.api.tool_calls import Delta

Status = Literal["completed", "incomplete"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response_id() -> str:
    return _id("resp")


class ResponseOutput:
    """The `output` items of one answer, built piece by piece; each method returns the stream events of
    what it added (without `sequence_number`, which the stream numbers)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the message item being written
        self._pending = ""  # leading whitespace not yet shown: it may only precede a call

    @property
    def text(self) -> str:
        """The answer's text (all its message items)."""
        return "".join(p["text"] for item in self.items if item["type"] == "message" for p in item["content"])

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [item for item in self.items if item["type"] == "function_call"]

    def add(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            events += self._call(d) if d.index is not None else self._text(d.content or "")
        return events

    def finish(self, status: Status) -> list[dict[str, Any]]:
        """Close the message being written (`status` says whether max_output_tokens cut it); an answer
        with no item at all gets one message with what text it has."""
        if self._message is None and not self.items:
            return self._open(self._pending) + self._close(status)
        return self._close(status)

    # ---- text ------------------------------------------------------------------------------
    def _text(self, text: str) -> list[dict[str, Any]]:
        if self._message is None:
            self._pending += text
            if not self._pending.strip():
                return []
            text, self._pending = self._pending, ""
            return self._open(text)
        part = self._message["content"][0]
        part["text"] += text
        return [self._event("response.output_text.delta", content_index=0, delta=text, logprobs=[])]

    def _open(self, text: str) -> list[dict[str, Any]]:
        self._message = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}
        self.items.append(self._message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [
            self._item_event("response.output_item.added", self._message),
            self._event("response.content_part.added", content_index=0, part=copy.deepcopy(part)),
        ]
        self._message["content"].append(part)
        return events + (self._text(text) if text else [])

    def _close(self, status: Status) -> list[dict[str, Any]]:
        message, self._message, self._pending = self._message, None, ""
        if message is None:
            return []
        part = message["content"][0]
        message["status"] = status
        return [
            self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[], item=message),
            self._event("response.content_part.done", content_index=0, part=copy.deepcopy(part), item=message),
            self._item_event("response.output_item.done", message),
        ]

    # ---- calls -----------------------------------------------------------------------------
    def _call(self, d: Delta) -> list[dict[str, Any]]:
        events = self._close("completed")  # a message before a call is complete
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": d.id or _id("call"), "name": d.name or ""}
        self.items.append(item)
        events.append(self._item_event("response.output_item.added", item))
        item["arguments"] = d.arguments or ""
        item["status"] = "completed"
        events += [
            self._event("response.function_call_arguments.delta", delta=item["arguments"], item=item),
            self._event("response.function_call_arguments.done", arguments=item["arguments"], item=item),
            self._item_event("response.output_item.done", item),
        ]
        return events

    # ---- events ----------------------------------------------------------------------------
    def _event(self, kind: str, item: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """An event about `item` (default: the message being written)."""
        item = item or self._message
        assert item is not None
        return {"type": kind, "item_id": item["id"], "output_index": self.items.index(item), **fields}

    def _item_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "output_index": self.items.index(item), "item": copy.deepcopy(item)}


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's `usage` (server/api/responses.py) in the Responses API's words, `speculation` kept."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
        "speculation": usage["speculation"],
    }


def response_object(
    response_id: str,
    created: int,
    model: str,
    echo: dict[str, Any],
    status: Literal["in_progress", "completed", "incomplete"],
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A `response` object; `echo`: the request's settings (`responses_request.echo`)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"],
        "max_tool_calls": None,
        "model": model,
        "output": copy.deepcopy(output),
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": echo["previous_response_id"],
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": echo["store"],
        "temperature": echo["temperature"],
        "text": echo["text"],
        "tool_choice": echo["tool_choice"],
        "tools": echo["tools"],
        "top_logprobs": 0,
        "top_p": echo["top_p"],
        "truncation": echo["truncation"],
        "usage": usage,
        "user": echo["user"],
        "metadata": echo["metadata"],
    }
