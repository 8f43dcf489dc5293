"""`auto`'s acceptance model: how likely each draft position of a proposer is to be kept, for a row.

Kept per proposer and confidence level (an n-gram draft copied after a long match is usually kept whole,
one after a one-token match rarely, and the same row sees both), greedy apart from sampled rows (a sampled
row keeps a right draft only with probability p(x)), and per draft position: the rate at position j is
estimated from the comparisons made there, i.e. from the drafts whose first j tokens were all kept. Tokens
after a draft's first rejected one are never compared, and a first draft token (often a guess) is kept
less often than later ones (a copy going on): 16 drafts of which the first 3 were kept say ~1 for
positions 0-2, ~0 for position 3, and nothing after it.

Three layers, each the prior of the next: the proposer's declared prior for the level
(`Traits.confidence_priors`, handed in by the policy), the engine-wide figures (every row's drafts,
decayed slowly), and the row's own recent drafts (decayed fast). Below the model: what acceptance buys,
the expected tokens of a verify pass and the speedup formula `auto` maximises (policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.speculation.tuning import AutoTuning


@dataclass
class _Counts:
    """Decayed counts per draft position: how often it was reached (every earlier draft kept, so it was
    compared with the target's token) and kept."""

    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def update(self, drafted: int, accepted: int, decay: float) -> None:
        if len(self.reached) < drafted:
            self.reached += [0.0] * (drafted - len(self.reached))
            self.kept += [0.0] * (drafted - len(self.kept))
        for j in range(len(self.reached)):
            self.reached[j] = self.reached[j] * decay + (1.0 if j <= accepted and j < drafted else 0.0)
            self.kept[j] = self.kept[j] * decay + (1.0 if j < accepted else 0.0)

    def chained(self, first: float, weight: float, run_weight: float, k_max: int) -> list[float]:
        """Per position j < k_max, the rate of keeping it given every earlier one was kept, from one prior:
        `first` for position 0 (`weight` comparisons' worth), and for each later position the rate of the
        one before it (`run_weight`), so positions never reached inherit the last known rate (copying comes
        in runs: without that, a row that drafted little would never learn that longer drafts pay)."""
        rates: list[float] = []
        anchor, w = first, weight
        for j in range(max(k_max, 1)):
            if j < len(self.reached):
                anchor = (self.kept[j] + anchor * w) / (self.reached[j] + w)
            w = run_weight
            rates.append(anchor)
        return rates

    def over(self, prior: list[float], weight: float, k_max: int) -> list[float]:
        """The same from a prior per position (a wider history's rates, `weight` comparisons' worth at each
        position); positions this history never reached inherit its last rate."""
        rates: list[float] = []
        for j in range(max(k_max, 1)):
            if j < len(self.reached) or not rates:
                reached, kept = (self.reached[j], self.kept[j]) if j < len(self.reached) else (0.0, 0.0)
                rates.append((kept + prior[min(j, len(prior) - 1)] * weight) / (reached + weight))
            else:
                rates.append(rates[-1])
        return rates


def _key(proposer: str, level: int, sampled: bool) -> tuple[str, int, bool]:
    return proposer, level, sampled


class AcceptanceModel:
    """Per row and engine-wide acceptance of drafts (see the module docstring)."""

    def __init__(self, tuning: AutoTuning | None = None) -> None:
        self.tuning = tuning or AutoTuning()
        self._engine: dict[tuple[str, int, bool], _Counts] = {}
        self._rows: dict[str, dict[tuple[str, int, bool], _Counts]] = {}

    def observe(
        self, request_id: str, proposer: str, drafted: int, accepted: int, level: int = 0, sampled: bool = False
    ) -> None:
        """The target kept `accepted` of the `drafted` tokens `proposer` drafted at confidence `level`."""
        if not drafted:
            return
        key = _key(proposer, level, sampled)
        self._rows.setdefault(request_id, {}).setdefault(key, _Counts()).update(drafted, accepted,
                                                                                 self.tuning.row_decay)
        self._engine.setdefault(key, _Counts()).update(drafted, accepted, self.tuning.engine_decay)

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def seen(self) -> set[tuple[str, int, bool]]:
        """(proposer, level, sampled) of every kind of draft observed so far."""
        return set(self._engine)

    def rates(
        self, request_id: str, proposer: str, k_max: int, level: int = 0, sampled: bool = False, prior: float = 0.5
    ) -> list[float]:
        """Per draft position j < k_max, the chance the row keeps `proposer`'s draft there given it kept
        every one before it; `prior`: the first position's before any evidence (the proposer's declared)."""
        t, key = self.tuning, _key(proposer, level, sampled)
        engine = self._engine.get(key)
        rates = engine.chained(prior, t.level_prior_weight, t.run_weight, k_max) if engine else [prior] * max(k_max, 1)
        row = self._rows.get(request_id, {}).get(key)
        return row.over(rates, t.row_prior_weight, k_max) if row else rates


# ---- what acceptance buys ---------------------------------------------------------------------------
def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one verify pass of k drafts at per-token acceptance a."""
    if k == 0:
        return 1.0
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_tokens_upto(rates: list[float], k_max: int) -> list[float]:
    """Expected tokens from k = 0..k_max drafts (index k), `rates[j]` being the acceptance at draft
    position j given every earlier draft was kept (the last rate repeats past the list)."""
    out, run = [1.0], 1.0
    for j in range(k_max):
        run *= rates[min(j, len(rates) - 1)]  # P(the first j + 1 drafts are all kept)
        out.append(out[-1] + run)
    return out


def speedup(a: float, k: int, c: float) -> float:
    """Expected speedup over plain decoding: expected tokens per step over the step's relative cost."""
    return expected_tokens(a, k) / (c * k + 1.0)


def best_k(a: float | list[float], c: float | list[float], k_max: int) -> tuple[int, float]:
    """The k in [0, k_max] of highest predicted speedup, and that speedup. `a`: one acceptance, or one
    per draft position given the earlier ones were kept (copying comes in runs, which one rate
    underestimates). `c`: one cost per draft token, or one per k (index k - 1): a pass's time is not
    linear in its width."""
    rates = [a] if isinstance(a, float | int) else a
    costs = [c] * k_max if isinstance(c, float | int) else c
    best = (0, 1.0)
    run = expected = 1.0
    for k in range(1, k_max + 1):
        run *= rates[min(k - 1, len(rates) - 1)]
        expected += run
        s = expected / (costs[k - 1] * k + 1.0)
        if s > best[1]:
            best = (k, s)
    return best
