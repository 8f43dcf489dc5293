"""Method `auto`: choose each sequence's proposer and K every step to maximise expected tokens/s.

With per-token acceptance a and a draft-token cost c (relative to one verify step), K drafts give

    speedup(a, K, c) = (1 - a^(K+1)) / ((1 - a) (c K + 1))

tokens per unit of plain-decoding time (Leviathan et al. 2023). Both a and c are measured online:
a per sequence and proposer (recent history, with the engine-wide average as a prior), c from the
engine's own timings: the marginal cost of verifying one more token in the current batch (it grows
as the batch grows and verification stops being nearly free) plus the proposer's own cost per
draft token. When no (proposer, K) beats plain decoding, the sequence decodes plainly that step.
Only *which* tokens are proposed changes; acceptance stays the lossless rule, so `auto` never
changes the output distribution, and greedy output is identical.

In a batch, the verify pass is padded to its widest row, so widening it costs the same whoever
drafts: `batch_width` picks one width for the whole batch (the sum of every row's expected tokens
over the pass's measured time), and every flexible row drafts up to it.

N-gram acceptance is kept per match length (`match_bucket`): a draft copied after a long match is
usually accepted whole, one after a one-token match rarely, and the same sequence sees both.

A seeded sampling request must reproduce. N-gram drafts cannot change its text (the sampler draws
every token as plain decoding would and only compares it with the draft: `rejection.py`), but the
draft model samples its drafts from the request's random stream, so seeded sampling requests
(`reproducible=True`) use n-gram drafts only, and then any K, any batch and any timing give the same
text.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PRIOR_WEIGHT = 8.0  # draft tokens' worth of engine-wide history a new sequence starts from
DECAY = 0.9  # per step: recent acceptance matters more (text alternates copy-heavy and free parts)
MIN_GAIN = 1.03  # speculate only when it is predicted to pay by a margin (estimates are noisy)
DEFAULT_DRAFT_COST = 0.75  # a draft model's cost per token before timings exist (DESIGN.md: bf16 copy)
DETERMINISTIC = ("ngram",)  # proposers whose drafts never change what a seeded request samples
PROBE_OVERHEAD = 0.02  # the probes of one unused proposer may cost this fraction of the steps, at most


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one verify pass of k drafts at per-token acceptance a."""
    if k == 0:
        return 1.0
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_tokens_upto(rates: list[float], k_max: int) -> list[float]:
    """Expected tokens from k = 0..k_max drafts (index k), with `rates[j]` the acceptance of draft
    position j given that every earlier draft was accepted (the last rate repeats past the list)."""
    out, run = [1.0], 1.0
    for j in range(k_max):
        run *= rates[min(j, len(rates) - 1)]  # P(the first j + 1 drafts are all accepted)
        out.append(out[-1] + run)
    return out


def speedup(a: float, k: int, c: float) -> float:
    """Expected speedup over plain decoding: expected tokens per step over the step's relative cost."""
    return expected_tokens(a, k) / (c * k + 1.0)


def best_k(a: float | list[float], c: float, k_max: int) -> tuple[int, float]:
    """The K in [0, k_max] with the highest predicted speedup, and that speedup.

    `a` is one per-token acceptance, or per draft position j the acceptance given that every
    earlier draft was accepted (copying comes in runs: once the first draft is right, the next
    ones usually are too, which a single rate underestimates).
    """
    rates = [a] * k_max if isinstance(a, float | int) else a
    best = (0, 1.0)
    for k, expected in enumerate(expected_tokens_upto(rates, k_max)[1:], start=1):
        s = expected / (c * k + 1.0)
        if s > best[1]:
            best = (k, s)
    return best


class CostModel:
    """Step timings, fitted online: verify time T(n) = fixed + per_token * n for n fed tokens, and
    the draft model's time per forward. Relative costs are what the policy needs."""

    def __init__(self, window: int = 128, prior_token_ratio: float = 0.05) -> None:
        self._verify: deque[tuple[int, float]] = deque(maxlen=window)
        self._draft_forward: deque[float] = deque(maxlen=window)
        self.prior_token_ratio = prior_token_ratio  # per-token slope as a fraction of T(1) before data
        self._fitted: tuple[float, float] | None = None  # `_fit`'s result until the next timing

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self._verify.append((tokens, seconds))
        self._fitted = None

    def observe_draft(self, forwards: int, seconds: float) -> None:
        if forwards:
            self._draft_forward.append(seconds / forwards)

    def _fit(self) -> tuple[float, float] | None:
        """(fixed, per_token), or None before 4 timings. Computed once per new timing: the policy
        asks for it many times a step (every row, every candidate width)."""
        if self._fitted is None and len(self._verify) >= 4:
            self._fitted = self._least_squares()
        return self._fitted

    def _least_squares(self) -> tuple[float, float]:
        """Least squares over the timings. When every timed pass had the same width (a batch where
        nobody drafts), the slope cannot be fitted: the prior slope is assumed through the timings'
        mean, T(n) = a (1 + r (n - 1)) with r = `prior_token_ratio`."""
        n = [float(t) for t, _ in self._verify]
        y = [s for _, s in self._verify]
        mean_n, mean_y = sum(n) / len(n), sum(y) / len(y)
        var = sum((x - mean_n) ** 2 for x in n)
        if var < 1e-9:
            r = self.prior_token_ratio
            a = mean_y / (1.0 + r * (mean_n - 1.0))
            return a * (1.0 - r), a * r
        slope = sum((x - mean_n) * (v - mean_y) for x, v in zip(n, y, strict=True)) / var
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_n, 1e-6), slope

    @property
    def fitted(self) -> bool:
        """Enough timings (4) to predict a pass's time from its width."""
        return self._fit() is not None

    def verify_time(self, tokens: int) -> float | None:
        fit = self._fit()
        if fit is None:
            if not self._verify:
                return None
            mean = sum(s for _, s in self._verify) / len(self._verify)
            return mean
        fixed, per_token = fit
        return fixed + per_token * tokens

    def token_cost(self, rows: int) -> float:
        """Relative cost, for one of `rows` sequences, of verifying one more token each step: the
        time it adds to a step against that sequence's share of a plain-decoding step of the same
        batch. Alone, verifying is nearly free; in a full batch on a CPU, each token costs about
        its share."""
        fit = self._fit()
        if fit is None:
            return self.prior_token_ratio * rows
        fixed, per_token = fit
        return rows * per_token / (fixed + per_token * rows)

    def draft_forward_time(self) -> float | None:
        """Mean seconds of one draft-model forward (None before any)."""
        if not self._draft_forward:
            return None
        return sum(self._draft_forward) / len(self._draft_forward)

    def draft_cost(self, rows: int) -> float | None:
        """Relative cost of one draft-model token (one batched draft forward) against a plain step."""
        if not self._draft_forward:
            return None
        step = self.verify_time(rows)
        if not step:
            return None
        return (sum(self._draft_forward) / len(self._draft_forward)) / step


NGRAM_BUCKETS = (1, 2, 3, 8)  # match lengths 1, 2, 3-7, 8+ keep separate acceptance statistics
NGRAM_PRIOR = {1: 0.2, 2: 0.35, 3: 0.55, 8: 0.7}  # per bucket, before any evidence


def match_bucket(match_len: int) -> int:
    """The statistics bucket of an n-gram match length (>= 1)."""
    return max(b for b in NGRAM_BUCKETS if b <= max(match_len, 1))


SAMPLED_PRIOR_SCALE = 0.7  # sampling accepts a draft with probability p(x) <= 1: start lower than greedy


def _key(method: str, match_len: int | None, sampled: bool = False) -> str:
    """Where acceptance of `method` is recorded: n-gram drafts per match-length bucket when known, and
    greedy and sampled requests apart (a sampled request keeps a right draft only with p(x))."""
    key = f"ngram@{match_bucket(match_len)}" if method == "ngram" and match_len else method
    return f"{key}~" if sampled else key


@dataclass
class _Acceptance:
    """Decayed counts: drafted and accepted tokens, and per draft position how often it was reached
    (every earlier draft accepted) and accepted."""

    drafted: float = 0.0
    accepted: float = 0.0
    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def update(self, drafted: int, accepted: int, decay: float = 1.0) -> None:
        self.drafted = self.drafted * decay + drafted
        self.accepted = self.accepted * decay + accepted
        if len(self.reached) < drafted:
            self.reached += [0.0] * (drafted - len(self.reached))
            self.kept += [0.0] * (drafted - len(self.kept))
        for j in range(len(self.reached)):
            self.reached[j] = self.reached[j] * decay + (1.0 if j <= accepted and j < drafted else 0.0)
            self.kept[j] = self.kept[j] * decay + (1.0 if j < accepted else 0.0)

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.drafted + weight)

    def by_position(self, prior: float, weight: float, k_max: int) -> list[float]:
        """Acceptance at each draft position given the earlier ones were accepted. Position 0 is
        shrunk toward this history's overall rate, each later one toward the position before it,
        where it has little evidence: positions never drafted yet inherit the last known rate
        (copying comes in runs, so the conditional rate rarely falls with the position). Without
        that, a K chosen small would never learn that longer drafts pay."""
        rates: list[float] = []
        anchor = self.rate(prior, weight)
        for j in range(max(k_max, 1)):
            if j < len(self.reached):
                anchor = (self.kept[j] + anchor * 2.0) / (self.reached[j] + 2.0)
            rates.append(anchor)
        return rates


@dataclass
class _SeqState:
    by_method: dict[str, _Acceptance] = field(default_factory=dict)
    last_used: dict[str, int] = field(default_factory=dict)
    steps: int = 0


@dataclass(frozen=True)
class BatchRow:
    """One row of a batch, for `batch_width`: its fixed drafts (k, by `method`), or for a flexible
    row (`auto` with an n-gram proposal) how many n-gram drafts it has to offer."""

    request_id: str
    method: str = "none"
    k: int = 0
    flexible: int = 0  # n-gram drafts this row may verify if the pass is widened (0: not flexible)
    match_len: int | None = None
    sampled: bool = False  # temperature > 0: acceptance is kept apart from greedy requests


@dataclass(frozen=True)
class Choice:
    method: str  # "none" or a proposer's method
    k: int
    predicted_speedup: float


class AdaptivePolicy:
    """Per-sequence choice of proposer and K. Pure bookkeeping: the engine feeds it outcomes and
    timings and asks it before each step."""

    def __init__(
        self,
        methods: list[str],
        draft_token_cost: dict[str, float],
        cost: CostModel | None = None,
    ):
        """`draft_token_cost`: relative cost per draft token for proposers the cost model doesn't time
        (n-gram lookup: ~0). The draft model's is measured by `cost`."""
        self.methods = methods
        self.fixed_cost = draft_token_cost
        self.cost = cost or CostModel()
        self.global_rate: dict[str, _Acceptance] = {}  # engine-wide, per `_key`
        self.prior = {"ngram": 0.3, "draft": 0.6}  # before any evidence; replaced by engine-wide history
        self.prior.update({f"ngram@{b}": a for b, a in NGRAM_PRIOR.items()})
        self.seqs: dict[str, _SeqState] = {}

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def acceptance(
        self, request_id: str, method: str, k_max: int = 1, match_len: int | None = None, sampled: bool = False
    ) -> list[float]:
        """Per draft position, the expected acceptance of `method` for this sequence (for n-gram
        drafts, of those after a match of `match_len` tokens when given; `sampled`: not greedy)."""
        key = _key(method, match_len, sampled)
        prior = self.prior.get(_key(method, match_len), 0.5) * (SAMPLED_PRIOR_SCALE if sampled else 1.0)
        if key in self.global_rate:
            prior = self.global_rate[key].rate(prior, 4.0)
        state = self.seqs.get(request_id)
        seq = state.by_method.get(key) if state else None
        return seq.by_position(prior, PRIOR_WEIGHT, k_max) if seq else [prior] * max(k_max, 1)

    def method_cost(self, method: str, rows: int = 1) -> float:
        """c for `method`: verifying one more token plus producing one draft token."""
        own = self.fixed_cost.get(method)
        if own is None:
            own = self.cost.draft_cost(rows)
            if own is None:
                own = DEFAULT_DRAFT_COST
        return self.cost.token_cost(rows) + own

    def choose(
        self,
        request_id: str,
        k_max: int,
        rows: int = 1,
        has_match: bool = True,
        reproducible: bool = False,
        match_len: int | None = None,
        sampled: bool = False,
    ) -> Choice:
        """Pick (method, K) for one of `rows` sequences in the batch. `has_match`: the n-gram lookup
        found something to propose; `match_len`: how long its match is, when known. `reproducible`:
        seeded sampling, which only drafts with proposers that cannot change its text (n-gram).
        `sampled`: the request samples (temperature > 0) rather than decoding greedily."""
        state = self.seqs.setdefault(request_id, _SeqState())
        state.steps += 1
        best = Choice("none", 0, 1.0)
        for method in self.methods:
            if (method == "ngram" and not has_match) or (reproducible and method not in DETERMINISTIC):
                continue
            a = self.acceptance(request_id, method, k_max, match_len, sampled)
            k, gain = best_k(a, self.method_cost(method, rows), k_max)
            if k and gain > best.predicted_speedup * (MIN_GAIN if best.method == "none" else 1.0):
                best = Choice(method, k, gain)
        # In a batch, one row's lone probe widens the verify pass for every row (padding), which
        # costs far more than its share: there, rows draft only within the batch's width (`batch_width`).
        if best.method == "none" and k_max and rows == 1:
            allowed = [m for m in self.methods if not reproducible or m in DETERMINISTIC]
            costs = {m: self.method_cost(m, rows) for m in allowed}
            best = self._probe(state, request_id, has_match, costs, k_max) or best
        state.last_used[best.method] = state.steps
        return best

    def batch_width(self, rows: list[BatchRow]) -> tuple[int, float] | None:
        """The number of draft positions W to verify this step for a batch, and the expected tokens
        per second it gives (None: no timings yet).

        The verify pass computes every row padded to the widest one, so its cost depends on W, not
        on each row's own K, and a row's drafts up to W cost nothing extra. Flexible rows (`auto`
        rows with an n-gram proposal) therefore draft min(W, their proposal) each, and W maximises
        the batch's expected tokens per second: the sum of every row's expected tokens over the
        measured time of a pass over rows x (W + 1) tokens, plus the draft model's forwards when a
        row drafts with it. Rows with fixed drafts set the least W.
        """
        if not self.cost.fitted:
            return None
        fixed_w = max((r.k for r in rows), default=0)
        flexible = [r for r in rows if r.flexible]
        fixed_tokens = sum(
            expected_tokens_upto(self.acceptance(r.request_id, r.method, r.k, r.match_len, r.sampled), r.k)[-1]
            for r in rows if not r.flexible
        )
        draft_k = max((r.k for r in rows if r.method == "draft"), default=0)
        draft_s = draft_k * self._draft_forward_s(len(rows))
        expected = [  # per flexible row: expected tokens with 0..flexible drafts
            expected_tokens_upto(self.acceptance(r.request_id, "ngram", r.flexible, r.match_len, r.sampled), r.flexible)
            for r in flexible
        ]
        top = max([fixed_w, *(r.flexible for r in flexible)])

        def score(w: int) -> float:
            tokens = fixed_tokens + sum(e[min(w, len(e) - 1)] for e in expected)
            return tokens / (self.cost.verify_time(len(rows) * (w + 1)) + draft_s)

        best_w, best = fixed_w, score(fixed_w)
        floor = best * (MIN_GAIN if fixed_w == 0 else 1.0)
        for w in range(fixed_w + 1, top + 1):
            s = score(w)
            if s > max(best, floor):
                best_w, best = w, s
        return best_w, best

    def _draft_forward_s(self, rows: int) -> float:
        """Seconds of one draft-model forward for a batch of `rows` (a fixed relative cost, when one
        is configured, in units of a plain step of that batch)."""
        own = self.fixed_cost.get("draft")
        if own is not None:
            return own * (self.cost.verify_time(rows) or 0.0)
        return self.cost.draft_forward_time() or 0.0

    def _probe(
        self, state: _SeqState, request_id: str, has_match: bool, costs: dict[str, float], k_max: int
    ) -> Choice | None:
        """Now and then draft one token with an unused proposer, so a sequence whose text turns
        copy-heavy later is noticed. A probe costs c (one draft token); probing every c /
        PROBE_OVERHEAD steps keeps their total cost within PROBE_OVERHEAD: a cheap n-gram lookup is
        re-checked every few steps, a draft model rarely (every 64 steps at the least often). A
        proposer too costly to pay even if every draft were accepted is never probed."""
        for method in costs:
            if method == "ngram" and not has_match:
                continue
            if best_k(1.0, costs[method], k_max)[1] < MIN_GAIN:
                continue
            interval = min(max(math.ceil(costs[method] / PROBE_OVERHEAD), 2), 64)
            if state.steps - state.last_used.get(method, 0) >= interval:
                return Choice(method, 1, 1.0)
        return None

    def observe(
        self,
        request_id: str,
        method: str,
        drafted: int,
        accepted: int,
        match_len: int | None = None,
        sampled: bool = False,
    ) -> None:
        """What verification did to one sequence's drafts (`match_len`: the n-gram match they came
        from; `sampled`: the request samples rather than decoding greedily)."""
        if method == "none" or not drafted:
            return
        key = _key(method, match_len, sampled)
        state = self.seqs.setdefault(request_id, _SeqState())
        state.by_method.setdefault(key, _Acceptance()).update(drafted, accepted, DECAY)
        self.global_rate.setdefault(key, _Acceptance()).update(drafted, accepted, 0.99)
