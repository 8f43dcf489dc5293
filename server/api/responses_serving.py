"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API.

A request is served as the chat completion it means (`responses_request.chat_request`): the same chat
template, grammar path (`text.format`, forced tool calls), sampling, speculation and checks, through the
same scheduler as `/v1/chat/completions` (`OpenAIServing`). Its one choice's text goes through the
tool-call parser when there are tools, and becomes `output` items (`responses_output.py`); a stream sends
the Responses API's events (`event:` and `data:` lines, no `[DONE]`). A finished response is kept in the
`ResponseStore` unless `store: false`, for `previous_response_id`, `GET` and `GET .../input_items` (its
`input` items, paginated as OpenAI's). Errors name the Responses fields (`input`, `max_output_tokens`,
`text.format`), not the chat fields they became, in `param` and in their wording.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from server.api import responses as R
from server.api.chat_template import tool_call_format
from server.api.errors import APIError, validation_error
from server.api.prompts import chat_prompt_ids, check_model, generation_requests, tool_stops
from server.api.response_store import ResponseStore, StoredResponse
from server.api.responses_output import (
    ResponseOutput,
    Status,
    new_response_id,
    response_object,
    response_usage,
)
from server.api.responses_request import ResponsesRequest, chat_request, echo, input_item_objects, input_messages
from server.api.serving import OpenAIServing
from server.api.structured import request_grammar
from server.api.tool_calls import Delta, ToolCallParser

T = TypeVar("T")

# The chat fields a Responses request became -> the fields the client sent.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}
# The same words inside an error's message: a chat field's name (not part of a longer name) -> the Responses one.
_WORDS = re.compile(r"(?<![\w.])(messages|max_completion_tokens|max_tokens|response_format\.json_schema\.schema|"
                    r"response_format\.json_schema|response_format)(?![\w])")
_WORD_FOR = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
             "response_format.json_schema.schema": "text.format.schema", "response_format.json_schema": "text.format",
             "response_format": "text.format"}


def _responses_param(param: str | None) -> str | None:
    """`param` of an error raised for the chat request, as the field of the Responses request."""
    if param is None:
        return None
    for chat, responses in _PARAMS.items():
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            return responses if chat == "messages" else responses + param[len(chat):]
    return param


def responses_wording(message: str) -> str:
    """An error message written for the chat request, in the Responses request's words (`max_tokens` ->
    `max_output_tokens`, `messages` -> `input`, `response_format` -> `text.format`).

    >>> responses_wording("min_tokens (9) must not exceed max_tokens (4); the messages hold 12 tokens")
    'min_tokens (9) must not exceed max_output_tokens (4); the input hold 12 tokens'
    """
    return _WORDS.sub(lambda m: _WORD_FOR[m.group(1)], message)


def _renamed(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, its 400s naming the Responses request's fields, in its words."""

    def call(*args: Any) -> T:
        try:
            return fn(*args)
        except APIError as exc:
            exc.param = _responses_param(exc.param)
            exc.message = responses_wording(exc.message)
            raise
        except ValidationError as exc:  # the chat request built from a valid Responses request: never, but
            error = validation_error(RequestValidationError(exc.errors(include_url=False)))
            error.param = _responses_param(error.param)
            error.message = responses_wording(error.message)
            raise error from exc

    return call


def _page_size(query: Mapping[str, str]) -> int:
    text = query.get("limit", "20")
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 100:
        raise APIError(400, f"limit must be an integer from 1 to 100, got {text[:40]!r}", param="limit")
    return int(text)


class ResponsesServing:
    """The Responses API over an `OpenAIServing` (its scheduler and model) and a `ResponseStore`."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    # ---- GET / DELETE ----------------------------------------------------------------------
    def get(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id, "response_id").response

    def input_items(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """OpenAI's `GET /v1/responses/{id}/input_items`: a page of the response's `input` items (`order` desc,
        the default: the last first; `after`/`before`: item ids the page starts after or ends before; `limit`
        1..100, default 20), as `{"object": "list", "data", "first_id", "last_id", "has_more"}`."""
        entry = self._stored(response_id, "response_id")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, got {order[:40]!r}", param="order")
        limit = _page_size(query)
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        ids = [item["id"] for item in items]
        start, end = 0, len(items)
        for param in ("after", "before"):
            mark = query.get(param)
            if mark is None:
                continue
            if mark not in ids:
                raise APIError(400, f"{param}: no input item {mark[:80]!r} in response {response_id!r}",
                               param=param)
            if param == "after":
                start = ids.index(mark) + 1
            else:
                end = ids.index(mark)
        page = items[start:end][:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}

    def delete(self, response_id: str) -> dict[str, Any]:
        self._stored(response_id, "response_id")
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _stored(self, response_id: str, param: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"No stored response with id {response_id!r} (never stored, store: false, evicted, or the server "
                "restarted)",
                param=param,
                code="response_not_found",
            )
        return entry

    # ---- POST ------------------------------------------------------------------------------
    async def create(self, body: ResponsesRequest, request: Request) -> dict[str, Any] | Response:
        serving, info = self.serving, self.serving.info
        offload = serving._offload
        check_model(info, body.model)
        history = self._stored(body.previous_response_id, "previous_response_id").messages if (
            body.previous_response_id is not None) else []
        started = time.monotonic()
        chat = await offload(_renamed(chat_request), body, history)
        prompt = await offload(_renamed(chat_prompt_ids), info, chat)
        grammar = await offload(_renamed(request_grammar), chat, tool_call_format(info.tokenizer))
        response_id = new_response_id()
        requests = _renamed(generation_requests)(
            info, chat, response_id, [prompt], chat.max_tokens, None, "input", tool_stops(chat), grammar
        )
        method = requests[0].speculation.method
        choice = R.Choice(0)
        names = {t.function.name for t in chat.active_tools}
        created = int(time.time())
        settings = echo(body)
        conversation = history + input_messages(body)
        items = input_item_objects(body)

        def log(ttft: float | None, finish_reason: str | None = None) -> None:
            serving._log(response_id, body.user, [choice], method, len(prompt), started, ttft, finish_reason)
            if finish_reason is None:
                serving._record([{"messages": [m.model_dump(exclude_none=True) for m in chat.messages]}], requests,
                                [choice])

        def finished(output: ResponseOutput) -> dict[str, Any]:
            """The final response object, stored unless `store: false`."""
            status: Status = "incomplete" if choice.finish_reason == "length" else "completed"
            usage = response_usage(R.usage(len(prompt), [choice], method))
            response = response_object(response_id, created, info.name, settings, status, output.items, usage)
            if body.stored:
                answer = {"role": "assistant", "content": output.text or (None if output.calls else "")}
                if output.calls:
                    answer["tool_calls"] = [
                        {"id": c["call_id"], "type": "function",
                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in output.calls
                    ]
                messages = [*conversation, answer]
                size = len(json.dumps(response)) + len(json.dumps(messages)) + len(json.dumps(items))
                self.store.put(StoredResponse(response, messages, size, items))
            return response

        def end_at_repeat(parser: ToolCallParser) -> None:
            """The reply repeated a call: it ends there (tool_calls.py); only the tokens that wrote it count."""
            serving._keep_tokens(choice, prompt, parser.end or 0)
            choice.finish_reason = "stop"

        stream = serving._submit(requests)
        if not body.stream:
            watch = serving._end_at_repeat(stream, [ToolCallParser(names)]) if names else None
            first = await serving._collect_or_log_abort(request, stream, [choice], log, None, watch)

            def build() -> dict[str, Any]:
                output = ResponseOutput()
                if names:
                    parser = ToolCallParser(names)
                    output.add(parser.feed(choice.text) + parser.finish(choice.finish_reason))
                    if parser.repeated:
                        end_at_repeat(parser)
                    elif parser.cut_after_calls:  # the answer is its whole calls (tool_calls.py)
                        choice.finish_reason = "stop"
                else:
                    output.add([Delta(content=choice.text)])
                output.finish("incomplete" if choice.finish_reason == "length" else "completed")
                return finished(output)

            response = await offload(build)
            log(first and first - started)
            return response

        events, ttft = await serving._started_or_log_abort(request, stream, log, started)
        sequence = _Sequence()

        async def gen() -> AsyncIterator[dict[str, Any]]:
            logged = False
            try:
                snapshot = response_object(response_id, created, info.name, settings, "in_progress", [], None)
                yield sequence.event({"type": "response.created", "response": snapshot})
                yield sequence.event({"type": "response.in_progress", "response": snapshot})
                output = ResponseOutput()
                parser = ToolCallParser(names) if names else None
                async for _, out in events:
                    choice.add(out)
                    if parser is None:
                        deltas = [Delta(content=out.text)] if out.text else []
                    else:
                        deltas = parser.feed(out.text) + (parser.finish(out.finish_reason) if out.finished else [])
                    for event in output.add(deltas):
                        yield sequence.event(event)
                    if parser is not None and parser.repeated:
                        if not out.finished:
                            serving.scheduler.finish(stream, 0)
                        end_at_repeat(parser)
                    elif parser is not None and parser.cut_after_calls:  # the answer is its whole calls
                        choice.finish_reason = "stop"
                status: Status = "incomplete" if choice.finish_reason == "length" else "completed"
                for event in output.finish(status):
                    yield sequence.event(event)
                response = await offload(finished, output)
                log(ttft)
                logged = True
                yield sequence.event({"type": f"response.{status}", "response": response})
            finally:
                if not logged:
                    log(ttft, "abort")

        return serving._sse(stream, gen(), on_error=sequence.error, done=False)


class _Sequence:
    """Numbers a stream's events (`sequence_number`) and frames them as SSE (`event:` names the type)."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, event: dict[str, Any]) -> dict[str, str]:
        numbered = {**event, "sequence_number": self.next}
        self.next += 1
        return {"event": event["type"], "data": json.dumps(numbered)}

    def error(self, error: APIError) -> dict[str, str]:
        """A failure after the stream started: the Responses API's `error` event."""
        detail = error.body()["error"]
        return self.event({"type": "error", "code": detail["code"] or detail["type"], "message": detail["message"],
                           "param": detail["param"]})

