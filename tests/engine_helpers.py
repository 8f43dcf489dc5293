"""Helpers for engine tests: build requests, run an engine to completion, fixed step costs."""

from __future__ import annotations

import torch

from server.speculation.cost import CostModel
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


def run_with_stats(engine, requests: list[GenerationRequest]) -> tuple[dict[str, list[int]], dict[str, RequestStats]]:
    """Run requests to completion: each request's tokens, and its final `RequestStats`."""
    for r in requests:  # one at a time: rows join as they would arrive
        engine.add_requests([r])
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: dict[str, RequestStats] = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.token_ids
            if out.finished:
                done[out.request_id] = out.stats
    return tokens, done


def run(engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    return run_with_stats(engine, requests)[0]


def final_stats(engine, requests: list[GenerationRequest]) -> dict[str, RequestStats]:
    """Run requests to completion; each request's final `RequestStats`."""
    return run_with_stats(engine, requests)[1]


def at_a_cdf_tie(model, prompt: list[int], prefix: list[int], tokens: tuple[int, int], params: dict) -> bool:
    """Whether the seeded request's draw for the token after `prefix` lies within float noise of the
    CDF boundary between `tokens` (a plain, cache-free forward recomputes p; each emitted token of a
    sampled n-gram row consumes one uniform of the request's generator, in order)."""
    from server.sampling import BatchSampling, probabilities

    sp = SamplingParams(temperature=params["temperature"], top_p=params["top_p"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + prefix])).logits[:, -1:]
    cdf = probabilities(logits, BatchSampling.from_params([sp], logits.device))[0, 0].cumsum(-1)
    gen = torch.Generator().manual_seed(params["seed"])
    u = [torch.rand(1, generator=gen) for _ in range(len(prefix) + 1)][-1].item() * cdf[-1].item()
    low, high = sorted(tokens)  # tokens between them may hold float-noise mass (1e-8): the boundary is one
    return cdf[high - 1].item() - cdf[low].item() < 1e-5 and abs(cdf[low].item() - u) < 1e-5


def assert_same_draws(model, prompt: list[int], got: list[int], want: list[int], params: dict, label: object = None):
    """A seeded request's text `got` is `want`, up to a tie at a CDF boundary: across verify widths the
    target's p comes from differently shaped matrix products, so wherever the texts first differ, the
    request's uniform draw must lie within float noise of the boundary between the two tokens."""
    first = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if first is not None:
        assert at_a_cdf_tie(model, prompt, want[:first], (got[first], want[first]), params), (label, first)


class FixedCosts(CostModel):
    """A step-cost model with given costs that ignores the engine's timings, for tests of `auto`: a pass
    over n tokens takes 1 + token_ratio * (n - 1) plain one-row passes, whatever its rows; one draft token
    of proposer `name` takes `draft[name]` of them, and one token of its backlog `backlog[name]`."""

    def __init__(
        self, token_ratio: float = 0.05, draft: dict[str, float] | None = None, backlog: dict[str, float] | None = None
    ) -> None:
        super().__init__()
        self.token_ratio, self.draft, self.backlog = token_ratio, draft or {}, backlog or {}

    def plain_time(self, rows: int) -> float:
        return 1.0 + self.token_ratio * (rows - 1)

    def ratios(self, rows: int) -> tuple[list[int], list[float]]:
        """Linear in the tokens fed: two points say it all (the curve continues their line)."""
        return [rows, rows + 1], [1.0, 1.0 + self.token_ratio / self.plain_time(rows)]

    def draft_time(self, proposer: str, rows: int = 1) -> float | None:
        return self.draft.get(proposer)

    def backlog_time(self, proposer: str, tokens: int) -> float:
        return self.backlog.get(proposer, 0.0) * tokens

    def observe_verify(self, rows: int, tokens: int, seconds: float, prior: bool = False) -> None:
        """Ignored: the costs are fixed."""

    def observe_draft(self, proposer: str, rows: int, forwards: int, seconds: float, prior: bool = False) -> None:
        """Ignored: the costs are fixed."""

    def observe_backlog(self, proposer: str, tokens: int, seconds: float) -> None:
        """Ignored: the costs are fixed."""
