"""The two generation endpoints: validate -> submit to the scheduler -> JSON or SSE.

`OpenAIServing.chat` and `.completions` return either a JSON dict (stream false) or an
`EventSourceResponse` whose events are OpenAI chunks followed by `data: [DONE]`. A client that
disconnects has its sequences aborted (the scheduler frees their batch slots at the next step) and
the request still gets its log line (finish_reason "abort"). With `tools`, each choice's text goes
through a `ToolCallParser` (server/api/tool_calls.py) as it is written: calls become `tool_calls` (each
streamed whole as `delta.tool_calls`), a choice that called and then stopped finishes with "tool_calls"
("stop" under a named `tool_choice`, as OpenAI answers), and a choice that repeats one of its calls is
ended there (`Scheduler.finish`: the engine stops generating it; usage counts its tokens up to the end of
the repeat).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response

from server.api import responses as R
from server.api.chat_template import tool_call_format
from server.api.origins import attach, origin_trackers
from server.api.prompts import (
    ModelInfo,
    chat_prompt_ids,
    check_model,
    completion_prompt_ids,
    generation_requests,
    response_ids,
    tool_stops,
)
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from server.api.serving_base import ServingBase
from server.api.structured import request_grammar
from server.api.tool_calls import ToolCallParser, merged
from server.types import RequestOutput


def _usage_options(body: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    """(a final usage chunk, usage on every chunk) as `stream_options` asks."""
    opts = body.stream_options
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


class OpenAIServing(ServingBase):
    """Chat and text completions over one scheduler and one model."""

    # ---- chat ------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request) -> dict[str, Any] | Response:
        check_model(self.info, body.model)
        self._check_fits(body.n or 1, "n")
        started = time.monotonic()
        prompt = await self._offload(chat_prompt_ids, self.info, body)
        response_id, engine_id = response_ids("chatcmpl", body.request_id)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        grammar = await self._offload(request_grammar, body, tool_call_format(self.info.tokenizer))  # compiles schemas
        requests = generation_requests(
            self.info, body, engine_id, [prompt], max_tokens, logprobs, "messages", tool_stops(body), grammar
        )
        echoed = _echoed(body)  # vLLM's `echo`: the final assistant message the reply starts with
        token_ids = bool(body.return_token_ids)
        method = requests[0].speculation.method
        choices = [R.Choice(i) for i in range(len(requests))]
        trackers = origin_trackers(self.info.tokenizer, body, [r.prompt_token_ids for r in requests])
        created = int(time.time())
        fmt = self._formatter(body) if logprobs is not None else None
        tool_names = {t.function.name for t in body.active_tools}
        named = bool(tool_names) and not isinstance(body.tool_choice, str | None)  # a named function: "stop" (R.called)

        def log(ttft: float | None, finish_reason: str | None = None) -> None:
            self._log(response_id, body.user, choices, method, len(prompt), started, ttft, finish_reason)
            if finish_reason is None:
                messages = [m.model_dump(exclude_none=True) for m in body.messages]
                self._record([{"messages": messages}] * len(choices), requests, choices)

        stream = self._submit(requests)
        if not body.stream:
            watch = self._end_at_repeat(stream, [ToolCallParser(tool_names) for _ in choices]) if tool_names else None
            first = await self._collect_or_log_abort(request, stream, choices, log, trackers, watch)

            def build() -> dict[str, Any]:  # decodes every logprob token: off the loop
                for c in choices if tool_names else ():
                    reply = c.take_tool_calls(tool_names, named)
                    if reply.end is not None:
                        self._keep_tokens(c, prompt, reply.end)
                for c in choices if echoed else ():
                    c.text = echoed + c.text
                response = R.chat_completion(
                    response_id, created, self.info.name, choices, fmt, R.usage(len(prompt), choices, method)
                )
                attach(response["choices"], trackers, [len(c.token_ids) for c in choices])
                if token_ids:
                    _with_token_ids(response, prompt, choices)
                return response

            response = await self._offload(build)
            log(first and first - started)
            return response

        events, ttft = await self._started_or_log_abort(request, stream, log, started)
        include_usage, continuous = _usage_options(body)
        parsers = [ToolCallParser(tool_names) if tool_names else None for _ in choices]

        def chunk(
            choice_list: list[dict[str, Any]], usage_: dict[str, Any] | None = None, final: bool = False,
            first: bool = False,
        ) -> dict[str, str]:
            if continuous and usage_ is None:
                usage_ = R.usage(len(prompt), choices, method)
            metrics = R.vllm_metrics(choices) if final else None
            obj = R.chat_chunk(
                response_id, created, self.info.name, choice_list, include_usage or continuous, usage_, metrics
            )
            if token_ids and first:
                obj["prompt_token_ids"] = prompt
            return {"data": json.dumps(obj)}

        def deltas(index: int, out: RequestOutput) -> list[dict[str, Any]]:
            """The chunk deltas of one output: its text, or what the tool-call parser makes of it."""
            parser = parsers[index]
            if parser is None:
                return [{"content": out.text}] if out.text else []
            pieces = parser.feed(out.text) + (parser.finish(out.finish_reason) if out.finished else [])
            text = "".join(d.content for d in pieces if d.content is not None)
            calls = [d.to_openai() for d in merged([d for d in pieces if d.index is not None])]
            return ([{"content": text}] if text else []) + ([{"tool_calls": calls}] if calls else [])

        async def gen() -> AsyncIterator[dict[str, Any]]:
            logged = False
            try:
                for c in choices:
                    delta = {"role": "assistant", "content": ""}
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}],
                                first=c.index == 0)
                    if echoed:
                        echo = {"index": c.index, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}
                        yield chunk([echo])
                async for index, out in events:
                    choices[index].add(out)
                    spec = trackers[index].feed(out) if trackers else None
                    lp = fmt.chat(out.logprobs) if fmt and out.logprobs else None
                    ids = out.token_ids if token_ids else None
                    parts = deltas(index, out) or ([{"content": ""}] if lp or (spec and spec["tokens"]) or ids else [])
                    for part in parts:
                        choice = {"index": index, "delta": part, "logprobs": lp, "finish_reason": None}
                        if ids is not None:
                            choice["token_ids"], ids = ids, []
                        yield chunk([choice if spec is None else {**choice, "speculation": spec}])
                        lp, spec = None, None
                    parser = parsers[index]
                    ended = parser is not None and parser.repeated  # at a repeated call: the reply is over
                    if ended and not out.finished:
                        self.scheduler.finish(stream, index)
                    if out.finished or ended:
                        if ended:
                            self._keep_tokens(choices[index], prompt, parser.end or 0)
                            choices[index].finish_reason = R.called(named)
                        elif parser is not None and parser.calls and (
                                out.finish_reason == "stop" or parser.cut_after_calls):
                            choices[index].finish_reason = R.called(named)
                        reason = choices[index].finish_reason
                        yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
                log(ttft)
                logged = True
                if include_usage:
                    yield chunk([], R.usage(len(prompt), choices, method), final=True)
            finally:
                if not logged:  # the client went away mid-stream (or the engine failed)
                    log(ttft, "abort")

        return self._sse(stream, gen())

    # ---- text completions ------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> dict[str, Any] | Response:
        check_model(self.info, body.model)
        n = body.n or 1
        self._check_fits(len(body.prompt) * n, "n" if n > 1 else "prompt")
        started = time.monotonic()
        prompts = await self._offload(completion_prompt_ids, self.info, body)
        response_id, engine_id = response_ids("cmpl", body.request_id)
        grammar = await self._offload(request_grammar, body)  # compiles schemas
        requests = generation_requests(
            self.info, body, engine_id, prompts, body.max_tokens, body.logprobs, "prompt", (), grammar
        )
        n_choices = body.n or 1
        echoes = await self._offload(_echoed_prompts, self.info, body, prompts) if body.echo else None
        token_ids = bool(body.return_token_ids)
        method = requests[0].speculation.method
        prompt_tokens = sum(len(p) for p in prompts)
        choices = [R.Choice(i) for i in range(len(requests))]
        trackers = origin_trackers(self.info.tokenizer, body, [r.prompt_token_ids for r in requests])
        created = int(time.time())
        fmt = self._formatter(body) if body.logprobs is not None else None

        def log(ttft: float | None, finish_reason: str | None = None) -> None:
            self._log(response_id, body.user, choices, method, prompt_tokens, started, ttft, finish_reason)
            if finish_reason is None:  # choice i answers prompt i // n; token-id prompts are kept as ids only
                n = body.n or 1
                texts = [{"prompt": p} if isinstance(p, str) else {} for p in body.prompt]
                self._record([texts[i // n] for i in range(len(choices))], requests, choices)

        stream = self._submit(requests)
        if not body.stream:
            first = await self._collect_or_log_abort(request, stream, choices, log, trackers)
            log(first and first - started)

            def build() -> dict[str, Any]:  # decodes every logprob token: off the loop
                response = R.text_completion(
                    response_id,
                    created,
                    self.info.name,
                    [
                        {
                            "index": c.index,
                            "text": (echoes[c.index // n_choices] if echoes else "") + c.text,
                            "logprobs": fmt.completion(c.logprobs) if fmt else None,
                            "finish_reason": c.finish_reason,
                            **({"prompt_token_ids": prompts[c.index // n_choices], "token_ids": c.token_ids}
                               if token_ids else {}),
                        }
                        for c in choices
                    ],
                    R.usage(prompt_tokens, choices, method),
                    metrics=R.vllm_metrics(choices),
                )
                attach(response["choices"], trackers)
                return response

            return await self._offload(build)

        events, ttft = await self._started_or_log_abort(request, stream, log, started)
        include_usage, continuous = _usage_options(body)

        def chunk(
            choice_list: list[dict[str, Any]], usage_: dict[str, Any] | None = None, final: bool = False
        ) -> dict[str, str]:
            if continuous and usage_ is None:
                usage_ = R.usage(prompt_tokens, choices, method)
            metrics = R.vllm_metrics(choices) if final else None
            obj = R.text_completion(
                response_id, created, self.info.name, choice_list, usage_, include_usage or continuous, metrics
            )
            return {"data": json.dumps(obj)}

        async def gen() -> AsyncIterator[dict[str, Any]]:
            offsets = [0] * len(choices)
            logged = False
            try:
                for c in choices if echoes or token_ids else ():  # the prompt first, as vLLM streams it
                    first: dict[str, Any] = {"index": c.index, "text": echoes[c.index // n_choices] if echoes else "",
                                             "logprobs": None, "finish_reason": None}
                    if token_ids:
                        first.update(prompt_token_ids=prompts[c.index // n_choices], token_ids=[])
                    yield chunk([first])
                async for index, out in events:
                    choices[index].add(out)
                    spec = trackers[index].feed(out) if trackers else None
                    if out.text or out.logprobs or out.finished or (spec and spec["tokens"]) or (
                            token_ids and out.token_ids):
                        lp = fmt.completion(out.logprobs or [], offsets[index]) if fmt else None
                        offsets[index] += sum(len(t) for t in lp["tokens"]) if lp else 0
                        reason = out.finish_reason if out.finished else None
                        choice = {"index": index, "text": out.text, "logprobs": lp, "finish_reason": reason}
                        if token_ids:
                            choice["token_ids"] = out.token_ids
                        yield chunk([choice if spec is None else {**choice, "speculation": spec}])
                log(ttft)
                logged = True
                if include_usage:
                    yield chunk([], R.usage(prompt_tokens, choices, method), final=True)
            finally:
                if not logged:
                    log(ttft, "abort")

        return self._sse(stream, gen())


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the final message's content when it is the assistant's (the role of the reply),
    which the reply's content then starts with; "" otherwise."""
    last = body.messages[-1]
    return (last.content or "") if body.echo and last.role == "assistant" else ""


def _echoed_prompts(info: ModelInfo, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """vLLM's completions `echo`: each prompt's text as the engine received it (a string prompt as sent, unless
    `truncate_prompt_tokens` cut it; token ids decoded)."""
    out = []
    for given, ids in zip(body.prompt, prompts, strict=True):
        cut = body.truncate_prompt_tokens is not None
        out.append(given if isinstance(given, str) and not cut else info.tokenizer.decode(ids))
    return out


def _with_token_ids(response: dict[str, Any], prompt: list[int], choices: list[R.Choice]) -> None:
    """vLLM's `return_token_ids` on a chat completion: the prompt's ids at the root, each choice's own."""
    response["prompt_token_ids"] = prompt
    for entry, c in zip(response["choices"], choices, strict=True):
        entry["token_ids"] = c.token_ids
