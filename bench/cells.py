"""Cells of the benchmark grid and the figures derived from them.

A cell is (workload, method, clients, temperature). Its waves accumulate; its tokens/s is total
completion tokens over total wall time of its waves, and its ratio compares it with the `none` cell
of the same workload, clients and temperature, measured interleaved with it in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.theory import (
    attainable_speedup,
    efficiency,
    expected_tokens_per_step,
    mean_accepted_length,
    theoretical_speedup,
)

SPEC_METHODS = ("none", "ngram", "draft", "auto")


@dataclass(frozen=True)
class CellKey:
    workload: str
    method: str
    clients: int
    temperature: float


@dataclass
class Cell:
    key: CellKey
    k: int | None  # requested draft tokens per step (None: the server chooses, e.g. auto)
    requests: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    reported_methods: set[str] = field(default_factory=set)

    def add(self, requests: int, completion_tokens: int, wall_s: float, draft_tokens: int = 0,
            accepted_tokens: int = 0, decode_steps: int = 0, reported_methods: tuple[str, ...] = ()) -> None:
        self.requests += requests
        self.completion_tokens += completion_tokens
        self.wall_s += wall_s
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens
        self.decode_steps += decode_steps
        self.reported_methods.update(reported_methods)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return mean_accepted_length(self.accepted_tokens, self.decode_steps) if self.decode_steps else None

    @property
    def drafts_per_step(self) -> float | None:
        return self.draft_tokens / self.decode_steps if self.decode_steps else None


def cost_method(cell: Cell) -> str | None:
    """Which proposer's c applies: the method itself, or the one `auto` reports when it names one."""
    if cell.key.method in ("ngram", "draft"):
        return cell.key.method
    if cell.key.method == "auto" and len(cell.reported_methods) == 1:
        (reported,) = cell.reported_methods
        return reported if reported in ("ngram", "draft", "none") else None
    return None


def cost_map(costs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Measured costs (BatchCosts.to_json rows) keyed by batch size, as `summarize` reads them."""
    return {c["batch"]: {"ngram": c["c_ngram"], "draft": c["c_draft"], "verify": c["verify_ratio"], "k": c["k"]}
            for c in costs}


def summarize(cells: list[Cell], costs: dict[int, dict[str, float | None]]) -> list[dict[str, Any]]:
    """One JSON-ready row per cell with the derived figures.

    `costs[clients]` maps "ngram"/"draft" to the measured c at that batch size, and optionally
    "verify" to the cost of a K+1-token target pass in target steps and "k" to that K.
    """
    tps = {c.key: c.tokens_per_s for c in cells}
    rows = []
    for cell in cells:
        k = cell.key
        base = tps.get(CellKey(k.workload, "none", k.clients, k.temperature))
        ratio = cell.tokens_per_s / base if base else None
        a = cell.acceptance_rate
        which = cost_method(cell)
        c = costs.get(k.clients, {}).get(which) if which in ("ngram", "draft") else None
        kk = cell.k if cell.k is not None else (round(cell.drafts_per_step) if cell.drafts_per_step else None)
        theory = expected = None
        if k.method == "none" or which == "none":
            theory = 1.0
        elif a is not None and c is not None and kk:
            theory = theoretical_speedup(a, kk, c)
            expected = expected_tokens_per_step(a, kk)
        bound = None
        batch_costs = costs.get(k.clients, {})
        if c is not None and batch_costs.get("verify") and batch_costs.get("k") and cell.mean_accepted_length:
            bound = attainable_speedup(cell.mean_accepted_length, cell.drafts_per_step or 0.0, c,
                                       batch_costs["verify"], batch_costs["k"])
        peer = k.method.startswith("hf-")
        rows.append({
            "workload": k.workload,
            "method": k.method,
            "clients": k.clients,
            "temperature": k.temperature,
            "k": cell.k,
            "requests": cell.requests,
            "completion_tokens": cell.completion_tokens,
            "wall_s": round(cell.wall_s, 3),
            "tokens_per_s": cell.tokens_per_s,
            "ratio_to_none": ratio,
            "draft_tokens": None if peer else cell.draft_tokens,
            "accepted_tokens": None if peer else cell.accepted_tokens,
            "decode_steps": None if peer else cell.decode_steps,
            "drafts_per_step": cell.drafts_per_step,
            "acceptance_rate": a,
            "mean_accepted_length": cell.mean_accepted_length,
            "expected_tokens_per_step": expected,
            "c": c,
            "theoretical_speedup": theory,
            "efficiency": efficiency(ratio, theory) if k.method != "none" else None,
            "attainable_speedup": bound,
            "overhead_efficiency": efficiency(ratio, bound) if k.method != "none" else None,
            "reported_methods": sorted(cell.reported_methods),
        })
    return rows
