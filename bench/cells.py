"""Cells of the benchmark grid and the figures derived from them.

A cell is (workload, method, clients, temperature). Its rounds accumulate; its tokens/s is total
completion tokens over total wall time of its rounds, and its ratio compares it with the `none` cell
of the same workload, clients and temperature, measured interleaved with it in the same run.

The methods are the server's own (`server.speculation.registry.BUILTIN`): a proposer added there gets
cells here without a change. Per proposer, a cell also keeps what each proposer did (`ProposerFigures`),
from `usage.speculation.by_proposer` when the server reports it and from the per-token origins the bench
asks for (`speculation.include_tokens`); `auto` mixes proposers, so its theory is the mix's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.theory import (
    attainable_mixed_speedup,
    efficiency,
    expected_tokens_per_step,
    mean_accepted_length,
    mixed_speedup,
)
from server.speculation.registry import AUTO, BUILTIN, PLAIN

SPEC_METHODS: tuple[str, ...] = BUILTIN.methods  # none, every registered proposer, auto
PROPOSERS: tuple[str, ...] = BUILTIN.proposers


@dataclass
class ProposerFigures:
    """What one proposer did within a response or a cell (PLAIN: the passes that drafted nothing).

    `draft_tokens`/`accepted_tokens` come from `usage.speculation` (exact); `steps`, `first_accepted`,
    `rejections` and `emitted_tokens` from the per-token origins (each token names its pass and the
    proposer that drafted in it). `estimated` marks draft counts split among proposers by the bench
    because the server reported only the response's total (see `response_figures`).
    """

    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0  # verify passes in which this proposer drafted
    first_accepted: int = 0  # of those, passes whose first draft token was accepted
    rejections: int = 0  # of those, passes that ended in a recovered token
    emitted_tokens: int = 0  # tokens those passes emitted
    estimated: bool = False

    def add(self, other: ProposerFigures) -> None:
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.steps += other.steps
        self.first_accepted += other.first_accepted
        self.rejections += other.rejections
        self.emitted_tokens += other.emitted_tokens
        self.estimated = self.estimated or other.estimated

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def first_position_acceptance(self) -> float | None:
        return self.first_accepted / self.steps if self.steps and self.draft_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.emitted_tokens / self.steps if self.steps else None


def _passes(tokens: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per-token origin entries grouped by their pass (`step`), in order."""
    passes: dict[int, list[dict[str, Any]]] = {}
    for entry in tokens:
        passes.setdefault(int(entry["step"]), []).append(entry)
    return list(passes.values())


def response_figures(spec: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, ProposerFigures]:
    """Per proposer (and PLAIN) for one response, from its `usage.speculation` and its choices.

    Each choice's `speculation.tokens` (present when the request asked for origins) gives the passes:
    a pass's proposer is the one its tokens name (none: plain), its first draft was accepted when it
    emitted an `accepted` token, and it was cut by a rejection when it ends in `recovered`. Draft and
    accepted counts come from `spec["by_proposer"]` (`{name: {"draft_tokens", "accepted_tokens"}}`)
    when the server reports it; else, with one proposer, from the response's totals; else (several
    proposers, totals only) each proposer gets its examined drafts (accepted + rejections, the
    rejected one included) and the never-examined rest (drafts after a rejection) is split by
    rejections, marked `estimated`. Without origins, the response gives nothing here and the cell
    falls back to its method and totals (`Cell.figures`).
    """
    figs: dict[str, ProposerFigures] = {}
    for choice in choices:
        for entries in _passes((choice.get("speculation") or {}).get("tokens") or []):
            name = entries[0].get("proposer") or PLAIN
            f = figs.setdefault(name, ProposerFigures())
            accepted = sum(e["origin"] == "accepted" for e in entries)
            f.steps += 1
            f.accepted_tokens += accepted
            f.first_accepted += accepted > 0
            f.rejections += entries[-1]["origin"] == "recovered"
            f.emitted_tokens += len(entries)
    if not figs:
        return figs
    reported = spec.get("by_proposer")
    drafting = [name for name in figs if name != PLAIN]
    if isinstance(reported, dict) and reported:
        for name, tally in reported.items():
            f = figs.setdefault(name, ProposerFigures())
            f.draft_tokens = int(tally.get("draft_tokens", 0))
            f.accepted_tokens = int(tally.get("accepted_tokens", 0))
    elif len(drafting) == 1:
        f = figs[drafting[0]]
        f.draft_tokens = int(spec.get("draft_tokens", 0))
        f.accepted_tokens = int(spec.get("accepted_tokens", 0))
    elif drafting:
        examined = {name: figs[name].accepted_tokens + figs[name].rejections for name in drafting}
        rest = max(int(spec.get("draft_tokens", 0)) - sum(examined.values()), 0)
        rejections = sum(figs[name].rejections for name in drafting)
        for name in drafting:
            share = rest * figs[name].rejections / rejections if rejections else 0.0
            figs[name].draft_tokens = examined[name] + round(share)
            figs[name].estimated = True
    return figs


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
    proposers: dict[str, ProposerFigures] = field(default_factory=dict)  # from origins (see response_figures)
    rounds: dict[int, tuple[int, float]] = field(default_factory=dict)  # round -> (completion tokens, wall s)

    def add(self, requests: int, completion_tokens: int, wall_s: float, draft_tokens: int = 0,
            accepted_tokens: int = 0, decode_steps: int = 0, reported_methods: tuple[str, ...] = (),
            proposers: dict[str, ProposerFigures] | None = None, round_index: int | None = None) -> None:
        if round_index is not None:
            tokens, wall = self.rounds.get(round_index, (0, 0.0))
            self.rounds[round_index] = (tokens + completion_tokens, wall + wall_s)
        self.requests += requests
        self.completion_tokens += completion_tokens
        self.wall_s += wall_s
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens
        self.decode_steps += decode_steps
        self.reported_methods.update(reported_methods)
        for name, figs in (proposers or {}).items():
            self.proposers.setdefault(name, ProposerFigures()).add(figs)

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

    def figures(self) -> dict[str, ProposerFigures]:
        """Per proposer (and PLAIN), from the origins when the responses had them; else the cell's
        totals under the one proposer it names (the method itself, or what `auto` reported), or {}."""
        if self.proposers:
            return self.proposers
        which = cost_method(self)
        if which == PLAIN or (which is None and self.key.method == PLAIN):
            return {PLAIN: ProposerFigures(steps=self.decode_steps, emitted_tokens=self.completion_tokens)}
        if which is None or not self.decode_steps:
            return {}
        return {which: ProposerFigures(self.draft_tokens, self.accepted_tokens, steps=self.decode_steps,
                                       emitted_tokens=self.accepted_tokens + self.decode_steps)}


def cost_method(cell: Cell) -> str | None:
    """The one proposer a cell ran: the method itself, or the one `auto` reports when it names one."""
    if cell.key.method in PROPOSERS:
        return cell.key.method
    if cell.key.method == AUTO and len(cell.reported_methods) == 1:
        (reported,) = cell.reported_methods
        return reported if reported in (*PROPOSERS, PLAIN) else None
    return None


def cost_map(costs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Measured costs (BatchCosts.to_json rows) keyed by batch size, as `summarize` reads them:
    each proposer's c (`c_<name>`), "verify" and "k"."""
    out: dict[int, dict[str, Any]] = {}
    for c in costs:
        row: dict[str, Any] = {name: c.get(f"c_{name}") for name in PROPOSERS}
        row.update(verify=c["verify_ratio"], k=c["k"])
        out[c["batch"]] = row
    return out


def _theory(cell: Cell, figs: dict[str, ProposerFigures], costs: dict[str, Any]) -> tuple[float | None, float | None]:
    """(theoretical speedup, expected tokens per pass) of the cell's mix of passes, or Nones when a
    proposer's c or drafts are unknown. K per proposer: the cell's K, else its drafts per pass."""
    if not figs:
        return None, None
    passes = []
    for name, f in figs.items():
        if name == PLAIN:
            passes.append((f.steps, 0.0, 0, 0.0))
            continue
        c, a = costs.get(name), f.acceptance_rate
        k = cell.k if cell.k is not None else (round(f.draft_tokens / f.steps) if f.steps else 0)
        if c is None or a is None or not k or not f.steps:
            return None, None
        passes.append((f.steps, a, k, c))
    steps = sum(n for n, *_ in passes)
    if not steps:
        return None, None
    theory = mixed_speedup(passes)
    expected = sum(n * expected_tokens_per_step(a, k) for n, a, k, _ in passes) / steps
    return theory, expected


def _mix_cost(figs: dict[str, ProposerFigures], costs: dict[str, Any]) -> tuple[float | None, list | None]:
    """(draft-weighted c, [(drafts, c)] per proposer), or Nones when a drafting proposer has no c."""
    drafts = [(f.draft_tokens, costs.get(name)) for name, f in figs.items() if name != PLAIN and f.draft_tokens]
    if not drafts or any(c is None for _, c in drafts):
        return None, None
    total = sum(d for d, _ in drafts)
    return sum(d * c for d, c in drafts) / total, drafts


RAW_FIELDS = ("draft_tokens", "accepted_tokens", "steps", "first_accepted", "rejections", "emitted_tokens", "estimated")


def proposer_rows(figs: dict[str, ProposerFigures], costs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """JSON-ready per-proposer figures of a cell: the raw counts (`RAW_FIELDS`, from which
    `proposers_from_rows` rebuilds them) and the derived rates."""
    return {name: {**{k: getattr(f, k) for k in RAW_FIELDS}, "acceptance_rate": f.acceptance_rate,
                   "first_position_acceptance": f.first_position_acceptance, "tokens_per_step": f.tokens_per_step,
                   "c": costs.get(name)}
            for name, f in figs.items()}


def proposers_from_rows(rows: dict[str, dict[str, Any]]) -> dict[str, ProposerFigures]:
    """Inverse of `proposer_rows` (derived figures dropped)."""
    return {name: ProposerFigures(**{k: r[k] for k in RAW_FIELDS if k in r}) for name, r in rows.items()}


def round_ratios(cell: Cell, plain: Cell) -> list[float]:
    """The cell's tokens/s over `none`'s, round by round (each round gives every method the same
    prompts and seeds, back to back): how far a single round strays from the cell's ratio."""
    out = []
    for r, (tokens, wall) in sorted(cell.rounds.items()):
        base = plain.rounds.get(r)
        if base and wall and base[0] and base[1]:
            out.append(round((tokens / wall) / (base[0] / base[1]), 3))
    return out


def summarize(cells: list[Cell], costs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One JSON-ready row per cell with the derived figures.

    `costs[clients]` maps each proposer's name to its measured c at that batch size, and optionally
    "verify" to the cost of a K+1-token target pass in target steps and "k" to that K. Theory and the
    attainable bound use each proposer's own acceptance and c, weighted by its passes (`_theory`).
    """
    by_key = {c.key: c for c in cells}
    rows = []
    for cell in cells:
        k = cell.key
        plain = by_key.get(CellKey(k.workload, "none", k.clients, k.temperature))
        base = plain.tokens_per_s if plain is not None else None
        ratio = cell.tokens_per_s / base if base else None
        peer = k.method.startswith("hf-")
        batch_costs = costs.get(k.clients, {})
        figs = {} if peer else cell.figures()
        theory, expected = (1.0, None) if k.method == PLAIN else _theory(cell, figs, batch_costs)
        c, drafts = _mix_cost(figs, batch_costs)
        bound = None
        if drafts and batch_costs.get("verify") and batch_costs.get("k") and cell.decode_steps:
            bound = attainable_mixed_speedup(cell.accepted_tokens + cell.decode_steps, cell.decode_steps, drafts,
                                             batch_costs["verify"], batch_costs["k"])
        first = [f for name, f in figs.items() if name != PLAIN]
        first_accepted, first_steps = sum(f.first_accepted for f in first), sum(f.steps for f in first)
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
            "round_ratios": round_ratios(cell, plain) if plain is not None and k.method != PLAIN else [],
            "rounds": {str(r): [t, round(w, 3)] for r, (t, w) in sorted(cell.rounds.items())},
            "draft_tokens": None if peer else cell.draft_tokens,
            "accepted_tokens": None if peer else cell.accepted_tokens,
            "decode_steps": None if peer else cell.decode_steps,
            "drafts_per_step": cell.drafts_per_step,
            "acceptance_rate": cell.acceptance_rate,
            "first_position_acceptance": first_accepted / first_steps if cell.proposers and first_steps else None,
            "mean_accepted_length": cell.mean_accepted_length,
            "expected_tokens_per_step": expected,
            "c": c,
            "theoretical_speedup": theory,
            "efficiency": efficiency(ratio, theory) if k.method != PLAIN else None,
            "attainable_speedup": bound,
            "overhead_efficiency": efficiency(ratio, bound) if k.method != PLAIN else None,
            "reported_methods": sorted(cell.reported_methods),
            "by_proposer": proposer_rows(cell.proposers, batch_costs) if not peer else {},
        })
    return rows
