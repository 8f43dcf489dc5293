"""Helpers for engine tests: build requests, run an engine to completion, fixed step costs."""

from __future__ import annotations

from server.speculation.adaptive import CostModel
from server.types import GenerationRequest, RequestStats, SamplingParams, SpeculationParams

PROMPTS = [
    "Hello world, this is",
    "a b c a b c a b c a b c a b",
    "x",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "def add(a, b):\n    return a + b\n\ndef add(",
]


def request(rid: str, prompt: list[int], method: str = "none", k: int = 4, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", 16)
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(rid, tuple(prompt), SamplingParams(**sampling), SpeculationParams(method, k))


def run(engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.token_ids
    return tokens


def final_stats(engine, requests: list[GenerationRequest]) -> dict[str, RequestStats]:
    """Run requests to completion; each request's final `RequestStats`."""
    for r in requests:
        engine.add_request(r)
    done: dict[str, RequestStats] = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.stats for o in engine.step().outputs if o.finished})
    return done


class FixedCosts(CostModel):
    """A step-cost model with given costs that ignores the engine's timings, for tests of `auto`:
    a pass over n tokens takes 1 + token_ratio * (n - 1) plain steps, and one draft token of proposer
    `name` takes `draft[name]` plain steps of one row."""

    def __init__(self, token_ratio: float = 0.05, draft: dict[str, float] | None = None) -> None:
        super().__init__()
        for n in (1, 2, 4, 8, 1, 2, 4, 8):
            super().observe_verify(n, 1.0 + token_ratio * (n - 1))
        for name, ratio in (draft or {}).items():
            super().observe_draft(name, 4, 4 * ratio)

    def observe_verify(self, tokens: int, seconds: float, prior: bool = False, rows: int | None = None) -> None:
        """Ignored: the costs are fixed."""

    def observe_draft(self, proposer: str, forwards: int, seconds: float, prior: bool = False, rows: int = 1) -> None:
        """Ignored: the costs are fixed."""
