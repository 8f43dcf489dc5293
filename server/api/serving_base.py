"""What the generation endpoints share: submitting to the scheduler, awaiting its output with the client's
disconnect watched (an abort frees the batch slots), SSE framing with a mid-stream failure as one more event,
the request-log line, and tool-call repeats ended early. `OpenAIServing` (serving.py) and the Responses API
(responses_serving.py, through it) build on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request, Response
from sse_starlette import EventSourceResponse

from server.api import responses as R
from server.api.errors import APIError, ClientDisconnected, scheduler_error, unless_disconnected
from server.api.offload import Offload
from server.api.origins import OriginTracker, tokens_for
from server.api.prompts import ModelInfo
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from server.api.tool_calls import ToolCallParser
from server.request_log import log_request
from server.request_stream import EngineError, NeverFits, QueueFull, RequestRejected, RequestStream, ShuttingDown
from server.scheduler import Scheduler
from server.traffic import TrafficRecorder
from server.types import GenerationRequest, RequestOutput, total_stats

T = TypeVar("T")

Events = AsyncIterator[tuple[int, RequestOutput]]


class ServingBase:
    """One scheduler and one model, and the plumbing every endpoint over them uses."""

    def __init__(
        self,
        info: ModelInfo,
        scheduler: Scheduler,
        offload: Offload | None = None,
        recorder: TrafficRecorder | None = None,
    ) -> None:
        """`offload` runs tokenization, chat templates and large responses off the event loop;
        `recorder` (`record_traffic`) writes finished choices for draft-head training."""
        self.info = info
        self.scheduler = scheduler
        self._offload = offload or Offload()
        self.recorder = recorder

    def _record(
        self, prompts: list[dict[str, Any]], requests: list[GenerationRequest], choices: list[R.Choice]
    ) -> None:
        """Each choice that finished by itself or at max_tokens, with its prompt (`prompts[i]` for
        choice i) and the text of every token it generated (tool calls included)."""
        if self.recorder is None:
            return
        for prompt, req, c in zip(prompts, requests, choices, strict=True):
            if c.finish_reason in ("stop", "length", "tool_calls"):
                text = self.info.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                self.recorder.record(prompt, req.prompt_token_ids, text, c.token_ids)

    # ---- shared plumbing -------------------------------------------------------------------

    def _formatter(self, body: ChatCompletionRequest | CompletionRequest) -> R.LogprobFormatter:
        return R.LogprobFormatter(self.info.tokenizer, as_ids=bool(body.return_tokens_as_token_ids))

    def _check_fits(self, num_sequences: int, param: str) -> None:
        """400 naming `param` when the request holds more sequences than an idle server admits (checked
        before any tokenizing; the scheduler's `check_fits` is the rule)."""
        try:
            self.scheduler.check_fits(num_sequences)
        except NeverFits as exc:
            raise APIError(400, str(exc), param=param, code="too_many_sequences") from exc

    def _submit(self, requests: list[GenerationRequest]) -> RequestStream:
        try:
            return self.scheduler.submit(requests)
        except (RequestRejected, QueueFull, ShuttingDown) as exc:
            raise scheduler_error(exc) from exc

    async def _await(self, request: Request, stream: RequestStream, work: Awaitable[T]) -> T:
        """Await scheduler output; abort on client disconnect; scheduler failures become API errors."""
        try:
            return await unless_disconnected(request, work)
        except ClientDisconnected:
            self.scheduler.abort(stream)
            raise
        except (RequestRejected, EngineError, ShuttingDown) as exc:
            raise scheduler_error(exc) from exc

    async def _collect(
        self,
        request: Request,
        stream: RequestStream,
        choices: list[R.Choice],
        trackers: list[OriginTracker] | None = None,
        watch: Callable[[int, RequestOutput], None] | None = None,
    ) -> float | None:
        """Gather every choice's output (and its token origins, with `trackers`; `watch(index, output)` sees
        each output, and may end its choice early); returns when (monotonic) the first output arrived."""
        first: list[float] = []

        async def run() -> None:
            async for index, out in stream.events():
                if not first:
                    first.append(time.monotonic())
                choices[index].add(out)
                if trackers:
                    trackers[index].feed(out)
                if watch is not None:
                    watch(index, out)

        await self._await(request, stream, run())
        return first[0] if first else None

    async def _started_or_log_abort(
        self, request: Request, stream: RequestStream, log: Callable[..., None], started: float
    ) -> tuple[Events, float]:
        """`_started`, and the time to the first output since `started`; writes the request's log line
        (finish_reason "abort") if the client goes away first."""
        try:
            events = await self._started(request, stream)
        except ClientDisconnected:
            log(None, "abort")
            raise
        return events, time.monotonic() - started

    async def _started(self, request: Request, stream: RequestStream) -> Events:
        """The stream's events, once the first has arrived: admission errors are still a 4xx, not SSE."""
        events = stream.events()
        first = await self._await(request, stream, anext(events))

        async def chained() -> Events:
            yield first
            async for event in events:
                yield event

        return chained()

    def _sse(
        self,
        stream: RequestStream,
        events: AsyncIterator[dict[str, Any]],
        on_error: Callable[[APIError], dict[str, Any]] | None = None,
        done: bool = True,
    ) -> Response:
        """`events` as server-sent events; a failure after the stream started is one more event
        (`on_error(error)`, default `{"error": ...}` as data), then `data: [DONE]` unless not `done`."""

        async def guarded() -> AsyncIterator[dict[str, Any]]:
            try:
                async for event in events:
                    yield event
            except (RequestRejected, EngineError, ShuttingDown) as exc:
                error = scheduler_error(exc)
                yield on_error(error) if on_error is not None else {"data": json.dumps(error.body())}
            finally:
                if not stream.finished:
                    self.scheduler.abort(stream)  # the client went away mid-stream
            if done:
                yield {"data": "[DONE]"}

        return EventSourceResponse(guarded(), sep="\n", ping=15)

    def _log(
        self,
        response_id: str,
        user: str | None,
        choices: list[R.Choice],
        method: str,
        prompt_tokens: int,
        started: float,
        ttft: float | None,
        finish_reason: str | None = None,
    ) -> None:
        """One request-log line for the whole API request (its choices summed, every prompt counted),
        with its `user`; `finish_reason` overrides the first choice's (an abort before any output)."""
        total = total_stats([c.stats for c in choices if c.stats is not None], method, prompt_tokens,
                            sum(len(c.token_ids) for c in choices))
        reason = finish_reason or choices[0].finish_reason
        log_request(response_id, self.info.name, total, reason, ttft, time.monotonic() - started, user)

    async def _collect_or_log_abort(
        self,
        request: Request,
        stream: RequestStream,
        choices: list[R.Choice],
        log: Callable[..., None],
        trackers: list[OriginTracker] | None = None,
        watch: Callable[[int, RequestOutput], None] | None = None,
    ) -> float | None:
        """`_collect`, writing the request's log line (finish_reason "abort") if the client goes away."""
        try:
            return await self._collect(request, stream, choices, trackers, watch)
        except ClientDisconnected:
            log(None, "abort")
            raise

    def _end_at_repeat(
        self, stream: RequestStream, parsers: list[ToolCallParser]
    ) -> Callable[[int, RequestOutput], None]:
        """A `_collect` watch that reads each choice's tool calls as they are written and ends a choice whose
        reply repeats one of its calls (server/api/tool_calls.py): generating it further would be wasted."""

        def watch(index: int, out: RequestOutput) -> None:
            parser = parsers[index]
            parser.feed(out.text)
            if parser.repeated and not out.finished:
                self.scheduler.finish(stream, index)

        return watch

    def _keep_tokens(self, choice: R.Choice, prompt: list[int], chars: int) -> None:
        """`choice` ended at a repeated call after `chars` characters of its text: only the tokens that wrote
        them count (usage, logprobs), the same whatever the engine generated before it stopped."""
        choice.keep_tokens(tokens_for(self.info.tokenizer, prompt, choice.token_ids, chars))
