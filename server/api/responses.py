"""OpenAI response objects, built as plain dicts in OpenAI's exact field order and shapes.

`Choice` accumulates one choice's outputs; the functions below turn choices into
`chat.completion`, `chat.completion.chunk`, `text_completion` objects, logprobs and `usage`
(with the `usage.speculation` extension).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.api.tool_calls import Reply, ToolCall, parse_whole
from server.types import RequestOutput, RequestStats, TokenLogprob, total_stats


def called(named: bool) -> str:
    """The finish reason of a choice that ended with tool calls: "tool_calls", but "stop" under a named
    `tool_choice` (what OpenAI answers, streamed or not)."""
    return "stop" if named else "tool_calls"


@dataclass
class Choice:
    """What one choice (one engine sequence) produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs or ())
        self.stats = out.stats
        if out.finished:
            self.finish_reason = out.finish_reason

    def take_tool_calls(self, names: set[str], named: bool = False) -> Reply:
        """Move the tool calls in `text` (of functions in `names`) to `tool_calls` (server/api/tool_calls.py).
        A choice that stopped by itself after calling, whose reply ended at a repeated call, or that max_tokens
        cut inside a call after whole ones (the cut call dropped), finishes with "tool_calls", or "stop" when the
        request named the function (`named`: OpenAI's rule, which vLLM follows); a choice whose only call was cut
        stays "length"."""
        reply = parse_whole(self.text, names, self.finish_reason)
        self.text, self.tool_calls = reply.content or "", reply.calls
        if reply.end is not None or reply.cut_after_calls:
            self.finish_reason = "stop"
        if self.tool_calls and self.finish_reason == "stop":
            self.finish_reason = called(named)
        return reply

    def keep_tokens(self, n: int) -> None:
        """Only the first `n` tokens count: the API ended the choice there (a repeated tool call)."""
        del self.token_ids[n:]
        del self.logprobs[n:]

    def message(self) -> dict[str, Any]:
        """The chat `message` object (content null when the reply is only tool calls)."""
        if not self.tool_calls:
            return {"role": "assistant", "content": self.text}
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.tool_calls
        ]
        return {"role": "assistant", "content": self.text or None, "tool_calls": calls}


def usage(prompt_tokens: int, choices: list[Choice], method: str) -> dict[str, Any]:
    """OpenAI usage plus `speculation`: figures summed over the choices (`total_stats`)."""
    completion = sum(len(c.token_ids) for c in choices)
    total = total_stats([c.stats for c in choices if c.stats is not None], method, prompt_tokens, completion)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": total.cached_tokens},
        "speculation": {
            "method": method,
            "draft_tokens": total.draft_tokens,
            "accepted_tokens": total.accepted_tokens,
            "acceptance_rate": total.acceptance_rate,
            "decode_steps": total.decode_steps,
            "by_proposer": {  # who drafted what (`auto` mixes proposers)
                name: {"draft_tokens": t.draft_tokens, "accepted_tokens": t.accepted_tokens}
                for name, t in total.by_proposer.items()
            },
            # the proposers the fail-safe turned off for it, and why (server/types.py `Fallback`); [] when none
            "fallbacks": [{"proposer": f.proposer, "reason": f.reason, "error": f.error} for f in total.fallbacks],
        },
    }


def vllm_metrics(choices: list[Choice]) -> dict[str, Any] | None:
    """vLLM's per-request speculation figures, `{"speculative_decoding": {...}}` (the response root's
    `metrics`, which AIPerf reads), for a request of one choice; None for several (as vLLM does).

    `acceptance_histogram[j]`: verify passes that accepted exactly j draft tokens, j = 0..K (`num_spec_tokens`,
    the request's K; `auto`'s ceiling); it sums to `num_spec_steps`, its j-weighted sum to
    `num_accepted_draft_tokens`. `mean_acceptance_length` = 1 + accepted / passes (1.0 before any pass)."""
    if len(choices) != 1 or choices[0].stats is None:
        return None
    stats = choices[0].stats
    at_least = [stats.decode_steps, *stats.accepted_per_position]  # [j]: passes that accepted j or more drafts
    histogram = [n - (at_least[j + 1] if j + 1 < len(at_least) else 0) for j, n in enumerate(at_least)]
    steps = stats.decode_steps
    return {
        "speculative_decoding": {
            "num_spec_steps": steps,
            "num_draft_tokens": stats.draft_tokens,
            "num_accepted_draft_tokens": stats.accepted_tokens,
            "num_spec_tokens": len(stats.accepted_per_position),
            "draft_acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": 1.0 + stats.accepted_tokens / steps if steps else 1.0,
            "acceptance_histogram": histogram,
        }
    }


class LogprobFormatter:
    """Turns `TokenLogprob`s into OpenAI's chat and completions logprob shapes."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        """`as_ids` (vLLM's `return_tokens_as_token_ids`): name each token `token_id:<id>` instead of its
        text, so tokens whose text is not valid UTF-8 on their own can still be told apart."""
        self._tokenizer = tokenizer
        self._as_ids = as_ids

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._tokenizer.decode([token_id])

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """Chat `choices[].logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
        return {
            "content": [
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(t, v) for t, v in lp.top],
                }
                for lp in logprobs
            ]
        }

    def completion(self, logprobs: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        """`choices[].logprobs` of a text completion; `text_offset` counts from `offset`."""
        tokens = [self.token(lp.token_id) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


def chat_completion(
    response_id: str,
    created: int,
    model: str,
    choices: list[Choice],
    fmt: LogprobFormatter | None,
    usage_: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": fmt.chat(c.logprobs) if fmt else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_,
        **_metrics(vllm_metrics(choices)),
    }


def _metrics(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """The `metrics` key of a response or usage chunk, when there are figures to report."""
    return {} if metrics is None else {"metrics": metrics}


def chat_chunk(
    response_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    include_usage: bool,
    usage_: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; `choices` are `{"index", "delta", "logprobs", "finish_reason"}`; `metrics`
    (vLLM's, `vllm_metrics`) rides the final usage chunk."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = usage_
    return {**chunk, **_metrics(metrics)}


def text_completion(
    response_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any] | None,
    include_usage: bool = True,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `text_completion` (whole or chunk); `choices`: `{"index", "text", "logprobs", "finish_reason"}`;
    `metrics`: vLLM's (`vllm_metrics`), on the whole answer and the final usage chunk."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage_
    return {**body, **_metrics(metrics)}
