"""A deterministic stand-in for `Engine`, for scheduler tests where a fake is the clearer test.

Each step emits one token per running request: token t+1 of a request is `(prompt[-1] + t + 1) % 1000 + 300`
(plain word pieces of the SmolLM2 vocabulary). It records every step's batch so tests can check
admission and aborts at step boundaries. A request whose last prompt id is `fail_on` fails alone in its
first step (`StepResult.failed`, as the engine reports a row whose step raised), `fatal_on` makes
`step()` raise (what escapes the engine's isolation), and
prompts longer than `max_context` are refused by `add_requests` with ValueError (the engine trusts the
scheduler's check; the fake refuses so the scheduler's handling of a refusal can be tested).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.types import (
    GenerationRequest,
    RequestOutput,
    RequestStats,
    SeqStepStats,
    ServingLimits,
    StepResult,
    TokenSource,
)


@dataclass
class _Running:
    req: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=lambda: RequestStats(method="none"))


def fake_token(req: GenerationRequest, t: int) -> int:
    return (req.prompt_token_ids[-1] + t + 1) % 1000 + 300


class FakeEngine:
    def __init__(
        self,
        tokenizer,
        *,
        step_s: float = 0.0,
        max_context: int = 1_000_000,
        fail_on: int | None = None,
        fatal_on: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.weights = "fp32"
        self.kv_cache_dtype = "float32"
        self.activations = "float32"
        self.architecture = "llama"
        self.architectures = ["llama"]
        self.max_context = max_context
        self.limits = ServingLimits(max_context=max_context, vocab_size=len(tokenizer), methods=("none", "auto"))
        self.draft_name = None
        self.step_s = step_s
        self.fail_on = fail_on
        self.fatal_on = fatal_on
        self.running: dict[str, _Running] = {}
        self.batches: list[list[str]] = []  # request ids of each step
        self.aborted: list[str] = []
        self.releases: list[int] = []  # per release_idle_memory call: rows running then

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_requests(self, reqs: list[GenerationRequest]) -> None:
        for req in reqs:
            if len(req.prompt_token_ids) + req.sampling.max_tokens > self.max_context:
                raise ValueError("prompt too long")
        for req in reqs:
            self.running[req.request_id] = _Running(req, stats=RequestStats(method=req.speculation.method))

    def abort_request(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def release_idle_memory(self) -> None:
        self.releases.append(len(self.running))

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def fits(self, requests) -> bool:
        return True  # no KV budget

    def kv_cache_usage(self) -> float:
        return len(self.running) / 100

    def step(self) -> StepResult:
        time.sleep(self.step_s)
        self.batches.append(list(self.running))
        last = {rid: r.req.prompt_token_ids[-1] for rid, r in self.running.items()}
        if self.fatal_on is not None and self.fatal_on in last.values():
            raise RuntimeError("boom")
        failed = {rid: "ValueError: boom" for rid, token in last.items() if token == self.fail_on}
        for rid in failed:
            del self.running[rid]
        outputs, seq_stats = [], []
        for rid, run in list(self.running.items()):
            tok = fake_token(run.req, len(run.tokens))
            before = self.tokenizer.decode(run.tokens)
            run.tokens.append(tok)
            text = self.tokenizer.decode(run.tokens)[len(before) :]
            run.stats.completion_tokens += 1
            run.stats.decode_steps += 1
            done = len(run.tokens) >= run.req.sampling.max_tokens
            if done:
                del self.running[rid]
            source = TokenSource("plain", None, run.stats.decode_steps - 1)
            outputs.append(RequestOutput(rid, [tok], text, None, done, "length" if done else None, run.stats, [source]))
            seq_stats.append(SeqStepStats(rid, run.stats.method, "none", 0, 0, 1, False))
        return StepResult(outputs, seq_stats, failed=failed)
