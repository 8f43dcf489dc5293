"""In-process measurement of the draft-to-target cost ratio c (and the verify cost) per batch size.

c is what the cost model calls the price of one draft token in target steps:
  * draft: one draft-model forward of one token per row / one target forward of one token per row,
    both through the engine's own `ModelRunner` at the same context (the workload prompts);
  * ngram: the engine's `ngram_lookup` for every row of the batch / one target forward (about 0).
`verify` = a target forward over K+1 tokens per row / one over 1 token: the cost model assumes 1.
Measurements of the kinds alternate within each repeat, and the median is kept, so drift on a
shared machine hits all of them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from server.model.loading import LoadedModel
from server.model.runner import ModelRunner
from server.speculation.ngram import ngram_lookup


@dataclass(frozen=True)
class BatchCosts:
    batch: int
    context: int  # mean tokens per row before the timed forward
    target_step_ms: float  # one target forward, one new token per row
    draft_step_ms: float | None  # same for the draft model
    verify_ms: float  # one target forward, K+1 new tokens per row
    ngram_ms: float  # n-gram lookup for every row
    k: int

    @property
    def c_draft(self) -> float | None:
        return self.draft_step_ms / self.target_step_ms if self.draft_step_ms is not None else None

    @property
    def c_ngram(self) -> float:
        return self.ngram_ms / self.target_step_ms

    @property
    def verify_ratio(self) -> float:
        return self.verify_ms / self.target_step_ms

    def to_json(self) -> dict[str, float | int | None]:
        return {**asdict(self), "c_draft": self.c_draft, "c_ngram": self.c_ngram, "verify_ratio": self.verify_ratio}


def _prefilled(model: LoadedModel, rows: list[list[int]]) -> ModelRunner:
    runner = ModelRunner(model.model)
    runner.join([f"row{b}" for b in range(len(rows))], rows)
    return runner


def _timed_step(runner: ModelRunner, width: int, token: int) -> float:
    """Seconds for one forward of `width` tokens per row; rolled back afterwards (bookkeeping only)."""
    started = time.perf_counter()
    runner.forward([[token] * width for _ in runner.rows])
    elapsed = time.perf_counter() - started
    for b in range(len(runner.rows)):
        runner.rollback(b, width)
    return elapsed


def measure_costs(
    target: LoadedModel,
    draft: LoadedModel | None,
    contexts: list[list[int]],
    batch_sizes: list[int],
    k: int,
    repeats: int = 7,
    ngram_max: int = 4,
    ngram_min: int = 1,
) -> dict[int, BatchCosts]:
    """Per batch size: medians of alternating target / draft / verify / n-gram timings."""
    results = {}
    token = int(contexts[0][-1])
    for batch in batch_sizes:
        rows = [contexts[b % len(contexts)] for b in range(batch)]
        target_kv = _prefilled(target, rows)
        draft_kv = _prefilled(draft, rows) if draft is not None else None
        samples: dict[str, list[float]] = {"target": [], "draft": [], "verify": [], "ngram": []}
        kinds: list[tuple[str, Callable[[], float]]] = [
            ("target", lambda kv=target_kv: _timed_step(kv, 1, token)),
            ("verify", lambda kv=target_kv: _timed_step(kv, k + 1, token)),
            ("ngram", lambda rows=rows: _time_ngram(rows, k, ngram_max, ngram_min)),
        ]
        if draft_kv is not None:
            kinds.append(("draft", lambda kv=draft_kv: _timed_step(kv, 1, token)))
        with torch.no_grad():
            for _, run in kinds:  # warm-up: first calls allocate
                run()
            for r in range(repeats):
                for name, run in kinds if r % 2 == 0 else reversed(kinds):
                    samples[name].append(run())
        ms = {name: statistics.median(v) * 1e3 if v else None for name, v in samples.items()}
        results[batch] = BatchCosts(
            batch=batch,
            context=round(sum(len(r) for r in rows) / batch),
            target_step_ms=ms["target"],
            draft_step_ms=ms["draft"],
            verify_ms=ms["verify"],
            ngram_ms=ms["ngram"],
            k=k,
        )
    return results


def _time_ngram(rows: list[list[int]], k: int, n_max: int, n_min: int) -> float:
    started = time.perf_counter()
    for tokens in rows:
        ngram_lookup(tokens, k, n_max, n_min)
    return time.perf_counter() - started
