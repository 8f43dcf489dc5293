"""Helpers for engine tests: build requests, run an engine to completion."""

from __future__ import annotations

from server.types import GenerationRequest, SamplingParams, SpeculationParams

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
