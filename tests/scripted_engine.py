"""An engine stand-in whose every reply is a fixed text: API tests of what the server makes of a
model's output (tool calls) without a model that writes it.

Each request's reply is the tokens of `script` (SmolLM2 tokenizer), `per_step` per step, through the
real `IncrementalDetokenizer` (so stop strings, including those the server adds, behave as in the
engine). It finishes with "stop" at the end of the script or a stop string, "length" at max_tokens.
`requests` records every GenerationRequest (prompts and sampling can be checked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.engine.detokenizer import IncrementalDetokenizer
from server.types import GenerationRequest, RequestOutput, RequestStats, SeqStepStats, ServingLimits, StepResult


@dataclass
class _Running:
    req: GenerationRequest
    detok: IncrementalDetokenizer
    sent: int = 0
    stats: RequestStats = field(default_factory=lambda: RequestStats(method="none"))


class ScriptedEngine:
    def __init__(
        self, tokenizer, script: str, per_step: int = 3, model_name: str = "scripted-model", step_s: float = 0.0
    ):
        """`step_s`: how long each step takes (a real engine's steps take time: what the API does meanwhile)."""
        self.step_s = step_s
        self.tokenizer = tokenizer
        self.script_ids = tokenizer.encode(script, add_special_tokens=False)
        self.per_step = per_step
        self.model_name = model_name
        self.weights = "fp32"  # the weights format the model card names (a scripted engine has none)
        self.kv_cache_dtype = "float32"
        self.activations = "float32"
        self.architecture = "llama"
        self.architectures = ["llama"]
        self.limits = ServingLimits(max_context=100_000, vocab_size=len(tokenizer), methods=("none", "auto"))
        self.draft_name = None
        self.running: dict[str, _Running] = {}
        self.requests: list[GenerationRequest] = []
        self.releases: list[int] = []  # per release_idle_memory call: rows running then
        self.aborted: list[tuple[str, int]] = []  # (request id, tokens it had generated) per abort

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_requests(self, reqs: list[GenerationRequest]) -> None:
        for req in reqs:
            self.requests.append(req)
            detok = IncrementalDetokenizer.for_request(self.tokenizer, list(req.prompt_token_ids), req.sampling)
            stats = RequestStats(method=req.speculation.method, prompt_tokens=len(req.prompt_token_ids))
            self.running[req.request_id] = _Running(req, detok, stats=stats)

    def abort_request(self, request_id: str) -> None:
        run = self.running.pop(request_id, None)
        if run is not None:
            self.aborted.append((request_id, run.sent))

    def release_idle_memory(self) -> None:
        self.releases.append(len(self.running))

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def fits(self, requests) -> bool:
        return True  # no KV budget

    def kv_cache_usage(self) -> float:
        return 0.0

    def step(self) -> StepResult:
        time.sleep(self.step_s)
        outputs, seq_stats = [], []
        for rid, run in list(self.running.items()):
            limit = run.req.sampling.max_tokens
            tokens = self.script_ids[run.sent : min(run.sent + self.per_step, limit)]
            emitted, reason = [], None
            for t in tokens:
                emitted.append(t)
                run.detok.add(t)
                if run.detok.stopped:
                    reason = "stop"
                    break
            run.sent += len(emitted)
            if reason is None and run.sent >= len(self.script_ids):
                reason = "stop"
            elif reason is None and run.sent >= limit:
                reason = "length"
            run.stats.completion_tokens = run.sent
            run.stats.decode_steps += 1
            if reason is not None:
                del self.running[rid]
            text = run.detok.take(final=reason is not None)
            outputs.append(RequestOutput(rid, emitted, text, None, reason is not None, reason, run.stats))
            seq_stats.append(SeqStepStats(rid, run.stats.method, "none", 0, 0, len(emitted), False))
        return StepResult(outputs, seq_stats)
