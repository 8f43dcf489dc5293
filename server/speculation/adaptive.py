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

In a batch, what a verify pass costs depends on how the target runs it. Padded (every row computed
as wide as the widest), widening it costs the same whoever drafts: `batch_width` picks one width for
the whole batch (the sum of every row's expected tokens over the pass's measured time), and every
flexible row drafts up to it. Packed (only real tokens computed: server/model/attention.py), each
draft token costs its own share: `batch_drafts` gives the pass's draft tokens to the rows where they
are most likely accepted, as many as raise the batch's expected tokens per second.

The policy knows proposers only by their `Traits` (proposer.py): what a draft token costs (declared,
or timed by the planner), whether drafts are deterministic, and the acceptance to expect per
confidence level before any evidence. Acceptance is kept per proposer and confidence level (an
n-gram draft copied after a long match is usually accepted whole, one after a one-token match
rarely, and the same sequence sees both), and greedy apart from sampled requests.

A seeded sampling request must reproduce, whatever `auto` picks from measured timings. Deterministic
drafts cannot change its text (the sampler draws every token as plain decoding would and only compares
it with the draft: `rejection.py`). A model proposer would sample its drafts from the request's random
stream, so for these rows it drafts from a copy of that stream with q one-hot instead
(`Sequence.one_hot_drafts`), and then any proposer, K, batch and timing give the same text.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from server.speculation.proposer import Traits

PRIOR_WEIGHT = 4.0  # comparisons' worth, per draft position, of engine-wide history a sequence starts from
LEVEL_PRIOR_WEIGHT = 4.0  # comparisons' worth of a confidence level's shipped prior in the engine-wide figures
RUN_WEIGHT = 2.0  # comparisons' worth of the position before, for a draft position with little evidence
DECAY = 0.9  # per step: recent acceptance matters more (text alternates copy-heavy and free parts)
MIN_GAIN = 1.03  # speculate only when it is predicted to pay by a margin (estimates are noisy)
DEFAULT_DRAFT_COST = 0.75  # a timed proposer's cost per token before timings exist
PROBE_OVERHEAD = 0.02  # the probes of one unused proposer may cost this fraction of the steps, at most
IDLE_PLANNING = 0.005  # idle rows (plans gaining less than they cost) are planned within this fraction of a step
MAX_IDLE_GAP = 8  # ... and at least every this many steps (how late an idle row's copying is noticed, at most)
PLANNING_DECAY = 0.9  # per plan: planning's measured time per row, and a row's gain from it, follow recent ones
GLOBAL_DECAY = 0.99  # per row plan: every row's gain from planning (a new row's prior)


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


def best_k(a: float | list[float], c: float | list[float], k_max: int) -> tuple[int, float]:
    """The K in [0, k_max] with the highest predicted speedup, and that speedup.

    `a` is one per-token acceptance, or per draft position j the acceptance given that every
    earlier draft was accepted (copying comes in runs: once the first draft is right, the next
    ones usually are too, which a single rate underestimates). `c` is the cost of one draft token
    relative to a plain step, or per K (index K - 1) that cost per token when K are drafted (a
    measured pass time is not linear in its width).
    """
    rates = [a] if isinstance(a, float | int) else a
    costs = [c] * k_max if isinstance(c, float | int) else c
    best = (0, 1.0)
    run = expected = 1.0  # as `expected_tokens_upto`, without its list: asked for every row, proposer and step
    for k in range(1, k_max + 1):
        run *= rates[min(k - 1, len(rates) - 1)]
        expected += run
        s = expected / (costs[k - 1] * k + 1.0)
        if s > best[1]:
            best = (k, s)
    return best


POINT_WINDOW = 8  # timings kept per pass width: their median is that width's measured time
STALE_AFTER = 1024  # passes: a width not timed in this many is dropped from the curve (the machine's load moves)


def _interpolate(widths: list[int], times: list[float], tokens: int, slope: float) -> float:
    """A measured curve's time at `tokens`: between two widths, on the line joining them; past either
    end, continued with `slope` (seconds per token)."""
    i = bisect.bisect_left(widths, tokens)
    if i < len(widths) and widths[i] == tokens:
        return times[i]
    if i == 0:  # narrower than any measured pass
        return max(times[0] - slope * (widths[0] - tokens), 1e-6)
    if i == len(widths):  # wider than any measured pass
        return times[-1] + slope * (tokens - widths[-1])
    lo, hi = widths[i - 1], widths[i]
    return times[i - 1] + (times[i] - times[i - 1]) * (tokens - lo) / (hi - lo)


def non_decreasing(values: list[float], weights: list[int]) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (isotonic regression, pool adjacent
    violators): runs that decrease are replaced by their weighted mean.

    >>> non_decreasing([1.0, 3.0, 2.0, 4.0], [1, 1, 3, 1])
    [1.0, 2.25, 2.25, 4.0]
    """
    blocks: list[list[float]] = []  # [weighted mean, weight, length]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, w, n = blocks.pop()
            last = blocks[-1]
            last[0] = (last[0] * last[1] + mean * w) / (last[1] + w)
            last[1] += w
            last[2] += n
    return [mean for mean, _, n in blocks for _ in range(int(n))]


@dataclass
class _Timings:
    """Verify timings by pass width (tokens fed), for every pass or for the passes of one batch size.

    A batch size's curve (`plain`: its plain pass's width) also keeps each wider pass's time over the
    median of the plain passes just before it: the plain width is timed almost every step and wider
    ones now and then, so their medians come from different moments of a machine whose speed drifts
    by 10-20% within seconds. Compared as they were, a few slow plain passes made every draft look
    cheap: `auto` drafted exactly then, and lost (4 open-chat rows: drafting steps predicted 5.2 tokens
    in 37.5 ms against a plain pass at 33.7, measured 4.9 tokens in 41.0 ms against plain passes of
    27.9). A wider pass's time is that ratio's median times the plain passes' median now."""

    plain: int | None = None  # the plain pass's width (a batch size's curve); None: the pooled curve
    points: dict[int, deque[float]] = field(default_factory=dict)  # width -> its last POINT_WINDOW timings
    ratios: dict[int, deque[float]] = field(default_factory=dict)  # width -> its last timings over plain's median
    last_seen: dict[int, int] = field(default_factory=dict)  # width -> the number of the pass that last timed it
    prior: dict[int, list[float]] = field(default_factory=dict)  # width -> calibration's timings
    curve: tuple[list[int], list[float]] | None = None  # `CostModel._measured`'s result until the next timing

    def add(self, tokens: int, seconds: float, prior: bool, passes: int) -> None:
        if prior:
            self.prior.setdefault(tokens, []).append(seconds)
        else:
            plain = self.points.get(self.plain) if self.plain is not None and tokens != self.plain else None
            if plain:
                self.ratios.setdefault(tokens, deque(maxlen=POINT_WINDOW)).append(seconds / statistics.median(plain))
            self.points.setdefault(tokens, deque(maxlen=POINT_WINDOW)).append(seconds)
            self.last_seen[tokens] = passes

    def medians(self) -> dict[int, tuple[float, int]]:
        """Each width's time now and the number of timings behind it. Where the plain passes are timed, a
        wider pass costs its ratio to them times their median now: the median of its own ratios with
        calibration's ratio for that width counted once per timing calibration took (start-up timed
        each width against the plain passes around it, `calibration.sandwiched`), so one slow pass
        cannot reprice a width `auto` drafts at rarely (4 chat rows: one pass of 12 tokens at 1.85x
        the plain pass, where calibration measured 1.27x three times and steps at 1.3x, kept every
        long draft out of that batch size until it was timed again); widths only calibration timed
        take its ratio alone. Elsewhere a width's time is the median of its own timings."""
        plain_points = self.points.get(self.plain) if self.plain is not None else None
        plain = statistics.median(plain_points) if plain_points else None
        prior_plain = self.prior.get(self.plain) if self.plain is not None else None
        prior_base = statistics.median(prior_plain) if prior_plain else None
        out = {}
        for width in self.points.keys() | (self.prior.keys() if plain is not None and prior_base else set()):
            timed, ratios = self.points.get(width, ()), list(self.ratios.get(width, ()))
            prior = self.prior.get(width, []) if width != self.plain and prior_base else []
            if prior:
                ratios += [statistics.median(prior) / prior_base] * len(prior)
            if ratios and plain is not None:
                out[width] = (statistics.median(ratios) * plain, len(timed) + len(prior))
            elif timed:
                out[width] = (statistics.median(timed), len(timed))
        return out


class CostModel:
    """Step timings, measured online: the verify time T(n) of a pass over n fed tokens, and each timed
    proposer's time per draft token (one batched forward). Relative costs are what the policy needs.

    T(n) is the measured curve, not a line: the median of the last `POINT_WINDOW` timings of every
    width seen (made non-decreasing in n), interpolated between widths, and continued past the
    measured ones by a least-squares line's slope. A CPU matrix multiply's time per row changes with
    the row count (on 2 cores, fp32: 4 rows cost ~1.5x one row, 36 rows ~2.6x), so a line fitted over
    every width mispredicts the widths decoding uses most: one fitted to calibration plus traffic
    put the marginal token of a 4-row batch at about two thirds of its measured cost, and `auto`
    widened passes that lost.

    A pass's time depends on its rows, not only on its tokens: 8 tokens took 70 ms as one row drafting
    7, 82 ms as 4 rows of 2 and 86 ms as 8 plain rows (SmolLM2-135M, 2 cores, fp32), and one row
    drafting one token in a batch of 8 cost +20% (the packed pass's scatter, gathers and per-row
    attention), not the eighth of a step its token count suggests. So every batch size keeps a curve
    of its own, and a question about a pass of `rows` rows reads that batch size's curve wherever it has
    two widths or more (between and beyond them, the pooled curve's slope), else the curve pooled over
    every pass.

    Start-up calibration (server/engine/calibration.py) comes in as *prior* timings: they give the
    curve's shape where traffic has not timed a width yet, scaled by how fast the machine runs now (the
    median ratio of recent timings to prior ones at the widths both have). A calibration taken while
    another process held the cores (several servers starting at once) measured every pass several
    times too slow; unscaled, its wide passes looked so costly that `auto` never drafted, so it never
    timed them again and stayed plain for the whole run. Scaled, a wrong shape errs towards drafting,
    and the passes drafting runs correct it."""

    def __init__(self, window: int = 128, prior_token_ratio: float = 0.05) -> None:
        self._window = window
        self._verify: deque[tuple[int, float, bool]] = deque(maxlen=window)  # (tokens, seconds, prior)
        self._pooled = _Timings()  # every pass, whatever its batch size
        self._by_rows: dict[int, _Timings] = {}  # batch size -> its passes
        self._passes = 0
        # proposer -> rows drafting together -> recent seconds per draft token (one batched forward)
        self._draft_forward: dict[str, dict[int, deque[float]]] = {}
        self._prior_seen = 0  # `_passes` when the last prior timing came
        self._prior_draft: dict[str, dict[int, list[float]]] = {}  # the same, from calibration
        # proposer -> recent seconds per backlog token (a pair a row missed, taken in before it drafts)
        self._backlog: dict[str, deque[float]] = {}
        self._scale_cache: float | None = None  # `scale`'s result until the next timing
        self.prior_token_ratio = prior_token_ratio  # per-token slope as a fraction of T(1) before data
        self._fitted: tuple[float, float] | None = None  # `_fit`'s result until the next timing
        self._token_costs: dict[tuple[int, int, bool], float] = {}  # `token_cost`'s results until the next timing
        self.version = 0  # counts timings: what is derived from them holds until it changes

    def observe_verify(self, tokens: int, seconds: float, prior: bool = False, rows: int | None = None) -> None:
        """A pass of `rows` rows (None: not known) over `tokens` fed positions took `seconds` (`prior`:
        timed by start-up calibration)."""
        if prior:
            self._prior_seen = self._passes
        else:
            self._passes += 1
        self._pooled.add(tokens, seconds, prior, self._passes)
        if rows is not None:
            self._by_rows.setdefault(rows, _Timings(plain=rows)).add(tokens, seconds, prior, self._passes)
        self._verify.append((tokens, seconds, prior))
        self.version += 1
        self._fitted = None
        self._scale_cache = None
        self._token_costs.clear()
        for timings in (self._pooled, *self._by_rows.values()):  # every curve reads the scale and the pass count
            timings.curve = None

    def observe_draft(self, proposer: str, forwards: int, seconds: float, prior: bool = False, rows: int = 1) -> None:
        """`proposer` drafted up to `forwards` tokens per row for `rows` rows at once in `seconds`
        (`prior`: at calibration)."""
        if forwards:
            self.version += 1
            table = (self._prior_draft if prior else self._draft_forward).setdefault(proposer, {})
            into = table.setdefault(rows, [] if prior else deque(maxlen=self._window))
            into.append(seconds / forwards)

    def observe_backlog(self, proposer: str, tokens: int, seconds: float) -> None:
        """`proposer` took in `tokens` backlog tokens (rows entering its cache, or back after steps they did
        not draft) in `seconds` beyond its drafting forwards' time."""
        if tokens > 0:
            self._backlog.setdefault(proposer, deque(maxlen=self._window)).append(max(seconds, 0.0) / tokens)

    def backlog_time(self, proposer: str, tokens: int) -> float:
        """Seconds `proposer` takes to take in `tokens` backlog tokens: the median of its timings per
        token; 0 before any (a first draft is not refused for a cost nobody has measured)."""
        times = self._backlog.get(proposer)
        return statistics.median(times) * tokens if times and tokens else 0.0

    def scale(self) -> float:
        """How much slower (> 1) or faster the machine runs now than at calibration: the median, over the
        widths both timed, of recent timings over prior ones; 1 while they share none."""
        if self._scale_cache is None:
            pooled = self._pooled
            shared = [n for n in pooled.prior if n in pooled.points]
            ratios = [statistics.median(pooled.points[n]) / statistics.median(pooled.prior[n]) for n in shared]
            self._scale_cache = statistics.median(ratios) if ratios else 1.0
        return self._scale_cache

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
        scale = self.scale()
        n = [float(t) for t, _, _ in self._verify]
        y = [s * scale if prior else s for _, s, prior in self._verify]
        mean_n, mean_y = sum(n) / len(n), sum(y) / len(y)
        var = sum((x - mean_n) ** 2 for x in n)
        if var < 1e-9:
            r = self.prior_token_ratio
            a = mean_y / (1.0 + r * (mean_n - 1.0))
            return a * (1.0 - r), a * r
        slope = sum((x - mean_n) * (v - mean_y) for x, v in zip(n, y, strict=True)) / var
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_n, 1e-6), slope

    def _measured(self, timings: _Timings | None = None) -> tuple[list[int], list[float]]:
        """(widths, times) of `timings` (default: every pass): each measured width's median timing, made
        non-decreasing in the width (a wider pass never takes less time) by isotonic regression weighted
        by how many timings each width has: where noise says otherwise, neighbouring widths share their
        weighted mean, so a width timed once (slowly) cannot lift every wider width above what they
        measured many times. Widths traffic has not timed take calibration's ratio to the plain pass where
        the batch size's plain passes are timed (`_Timings.medians`), else its timing, scaled (`scale`).
        Widths not timed in the last `STALE_AFTER` passes (e.g. start-up calibration of batches that
        never came) are left out while two others remain: the line's slope extends the curve instead."""
        timings = timings or self._pooled
        if timings.curve is None:
            scale = self.scale()
            median = timings.medians()
            median.update(
                {n: (statistics.median(t) * scale, len(t)) for n, t in timings.prior.items() if n not in median}
            )
            recent = [n for n, seen in timings.last_seen.items() if self._passes - seen < STALE_AFTER]
            if self._passes - self._prior_seen < STALE_AFTER:
                recent += [n for n in timings.prior if n not in timings.points]
            widths = sorted(recent if len(recent) >= 2 else median)
            timings.curve = (widths, non_decreasing([median[n][0] for n in widths], [median[n][1] for n in widths]))
        return timings.curve

    @property
    def fitted(self) -> bool:
        """Enough timings (4) to predict a pass's time from its width."""
        return self._fit() is not None

    def verify_time(self, tokens: int, rows: int | None = None) -> float | None:
        """Predicted seconds of a pass over `tokens` fed positions, of `rows` rows when given (see the
        class doc: that batch size's own curve where it has two widths; else, when another batch size
        has one, the plain pass at `rows` plus what the same number of drafts added at the nearest such
        batch size, `_nearest_curve`)."""
        fit = self._fit()
        if fit is None:
            if not self._verify:
                return None
            scale = self.scale()
            return sum(s * scale if prior else s for _, s, prior in self._verify) / len(self._verify)
        slope = fit[1]
        own = self._by_rows.get(rows) if rows is not None else None
        own_curve = self._measured(own) if own is not None else None
        if own_curve is not None and len(own_curve[0]) >= 2:
            return _interpolate(*own_curve, tokens, slope)
        pooled = self._measured()
        nearest = self._nearest_curve(rows) if rows is not None else None
        if nearest is None:
            return _interpolate(*pooled, tokens, slope)
        near, (widths, times) = nearest
        base = own_curve if own_curve is not None and own.points else pooled  # its plain passes' times
        if tokens <= rows:
            return _interpolate(*base, tokens, slope)
        plain = _interpolate(*base, rows, slope)
        drafts = tokens - rows
        added = _interpolate(widths, times, near + drafts, slope) - _interpolate(widths, times, near, slope)
        return plain + max(added, 0.0)

    def _nearest_curve(self, rows: int) -> tuple[int, tuple[list[int], list[float]]] | None:
        """The smallest batch size above `rows` whose own curve has two widths (a draft costs more in a
        larger batch: erring there drafts less), else the largest below it, and that curve; None when
        no batch size has one."""
        sizes = [b for b, t in self._by_rows.items() if b != rows and len(self._measured(t)[0]) >= 2]
        above = [b for b in sizes if b > rows]
        if not sizes:
            return None
        near = min(above) if above else max(sizes)
        return near, self._measured(self._by_rows[near])

    def token_cost(self, rows: int, k: int = 1, packed: bool = False) -> float:
        """Relative cost, per draft token, for one of `rows` sequences, of verifying k more tokens.

        Padded, every row's pass widens with it: the time every row's k more tokens add to a step,
        over a plain-decoding step of the same batch, per row and token. Packed, only this row's k
        tokens are added: their time over the row's share of a plain step (rows x the added time over
        the step), which is what decides whether drafting raises the batch's tokens per second. Alone,
        verifying is nearly free; in a full batch on a CPU, each token costs about its share."""
        if self._fit() is None:
            r = self.prior_token_ratio
            return r * rows / (1 + r * (rows - 1)) if packed else r * rows
        cost = self._token_costs.get((rows, k, packed))
        if cost is None:  # asked for every row, proposer and K of a step: computed once per timing
            plain = self.verify_time(rows, rows)
            wider = self.verify_time(rows + k if packed else rows * (k + 1), rows)
            assert plain is not None and wider is not None
            added = max(wider - plain, 0.0)
            cost = self._token_costs[(rows, k, packed)] = (rows * added if packed else added) / (k * plain)
        return cost

    def draft_forward_time(self, proposer: str, rows: int = 1) -> float | None:
        """Seconds of one of `proposer`'s draft tokens (a batched forward) when `rows` rows draft, the median
        of its timings (as a pass's time is: the drafts and the passes they save are priced alike):
        per number of rows, timed by traffic, else calibration's timings scaled (`scale`); between the
        numbers of rows timed, linear; beyond them, the nearest; None before any timing. A model's
        forward for one row costs a fraction of its forward for eight on a CPU (2-core machine, eagle
        head: 3-4 ms against 9 ms a token), so one mean over batch sizes would price a lone row's draft
        at twice its cost, and eight rows' at half."""
        known = {r: statistics.median(t) * self.scale() for r, t in self._prior_draft.get(proposer, {}).items() if t}
        known.update({r: statistics.median(t) for r, t in self._draft_forward.get(proposer, {}).items() if t})
        if not known:
            return None
        if rows in known:
            return known[rows]
        below = max((r for r in known if r < rows), default=None)
        above = min((r for r in known if r > rows), default=None)
        if below is None or above is None:
            return known[above if below is None else below]
        share = (rows - below) / (above - below)
        return known[below] * (1 - share) + known[above] * share

    def draft_cost(self, proposer: str, rows: int) -> float | None:
        """Relative cost of one of `proposer`'s draft tokens (one batched forward) against a plain step of
        a batch of `rows`, the forward priced as if every row drafted (the planner's per-row choice
        cannot know how many will)."""
        forward = self.draft_forward_time(proposer, rows)
        step = self.verify_time(rows, rows) if forward is not None else None
        return forward / step if step else None


SAMPLED_PRIOR_SCALE = 0.7  # sampling accepts a draft with probability p(x) <= 1: start lower than greedy


def _key(proposer: str, level: int, sampled: bool) -> str:
    """Where acceptance of `proposer`'s drafts at confidence `level` is recorded (greedy and sampled
    requests apart: a sampled request keeps a right draft only with probability p(x))."""
    return f"{proposer}@{level}{'~' if sampled else ''}"


@dataclass
class _Acceptance:
    """Decayed counts per draft position: how often it was reached (every earlier draft accepted: so
    it was compared with the target's token) and accepted.

    Acceptance is estimated per position, from the comparisons made there: a draft's tokens after its
    first rejected one are never compared, so they are neither accepted nor rejected, and the first
    position (often a guess) and later ones (usually a copy going on) accept at different rates. One
    rate over all drafted tokens (16 drafts of which the first 3 were kept: 3/16) made every longer
    draft look hopeless; one over the compared tokens (3/4) makes a first guess look as good as a run."""

    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def update(self, drafted: int, accepted: int, decay: float = 1.0) -> None:
        if len(self.reached) < drafted:
            self.reached += [0.0] * (drafted - len(self.reached))
            self.kept += [0.0] * (drafted - len(self.kept))
        for j in range(len(self.reached)):
            self.reached[j] = self.reached[j] * decay + (1.0 if j <= accepted and j < drafted else 0.0)
            self.kept[j] = self.kept[j] * decay + (1.0 if j < accepted else 0.0)

    def chained(self, first: float, weight: float, k_max: int) -> list[float]:
        """Acceptance at each draft position given the earlier ones were accepted, with one prior: `first`
        for position 0 (`weight` comparisons' worth), and for each later one the position before it
        (RUN_WEIGHT), so positions never drafted yet inherit the last known rate (copying comes in runs;
        without that, a K chosen small would never learn that longer drafts pay)."""
        rates: list[float] = []
        anchor, w = first, weight
        for j in range(max(k_max, 1)):
            if j < len(self.reached):
                anchor = (self.kept[j] + anchor * w) / (self.reached[j] + w)
            w = RUN_WEIGHT
            rates.append(anchor)
        return rates

    def by_position(self, prior: list[float], weight: float, k_max: int) -> list[float]:
        """Acceptance at each draft position given the earlier ones were accepted: this history's
        comparisons there with `weight` comparisons' worth of `prior[j]` (a wider history's estimate
        for the same position); positions this history never reached inherit its last known rate."""
        rates: list[float] = []
        for j in range(max(k_max, 1)):
            if j < len(self.reached) or not rates:
                p = prior[min(j, len(prior) - 1)]
                reached, kept = (self.reached[j], self.kept[j]) if j < len(self.reached) else (0.0, 0.0)
                rates.append((kept + p * weight) / (reached + weight))
            else:
                rates.append(rates[-1])
        return rates


@dataclass
class _SeqState:
    by_method: dict[str, _Acceptance] = field(default_factory=dict)
    last_used: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    wait: int = 0  # steps this row sits out of planning before the next (`AdaptivePolicy.due`)
    planned_in: int = 0  # the batch size this step's plan was made in (0: not planned this step)
    gain: float | None = None  # accepted draft tokens per planned step (decayed)


@dataclass(frozen=True)
class Offer:
    """What a lookahead proposer has ready for one row before planning: drafts and their confidence."""

    drafts: int
    level: int = 0


@dataclass(frozen=True)
class BatchRow:
    """One row of a batch, for `batch_width`: the drafts it verifies whatever the width (`k` by
    `proposer`), or for a flexible row (`auto` with a lookahead proposal) how many of `proposer`'s
    drafts it may verify if the pass is widened."""

    request_id: str
    proposer: str | None = None  # None: plain decoding
    k: int = 0
    level: int = 0
    flexible: int = 0  # lookahead drafts this row may verify if the pass is widened (0: not flexible)
    sampled: bool = False  # temperature > 0: acceptance is kept apart from greedy requests
    backlog: int = 0  # tokens a model `proposer` must take in for this row before it drafts (`Proposer.backlog`)


@dataclass(frozen=True)
class Choice:
    proposer: str | None  # None: decode plainly this step
    k: int
    predicted_speedup: float


class AdaptivePolicy:
    """Per-sequence choice of proposer and K. Pure bookkeeping: the planner feeds it outcomes and
    timings and asks it before each step."""

    def __init__(self, traits: dict[str, Traits], cost: CostModel | None = None, packed: bool = False) -> None:
        """`traits`: every proposer `auto` may choose, in order of preference on ties. `packed`: the
        target's verify passes compute only real tokens (else every row padded to the widest)."""
        self.traits = traits
        self.cost = cost or CostModel()
        self.packed = packed
        self.global_rate: dict[str, _Acceptance] = {}  # engine-wide, per `_key`
        self.seqs: dict[str, _SeqState] = {}
        # (proposer, rows, K) -> c per K: asked for every row of a step, derived from timings only
        self._costs: dict[tuple[str, int, int], list[float]] = {}
        self._ceilings: dict[tuple[str, int, int], float] = {}  # `ceiling`'s, alike
        self._costs_version = -1
        self._plan_row_s: float | None = None  # seconds of planning per row planned (decayed mean)
        self._shares: dict[int, float] = {}  # `planning_share` per batch size, until the next plan
        self._gain = 1.0  # accepted draft tokens per planned step, every row's (decayed): a new row's prior

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    # ---- how often an idle row is planned ------------------------------------------------------------
    # Planning a row (its lookups, its choice, its share of the batch's) costs the same whether or not it
    # ends in drafts. In a full batch on a CPU that is ~3% of a step (8 rows, 2 cores: 0.85 ms of a 30 ms
    # step), and open text rarely offers a draft that pays there. Planning a row pays when the tokens its
    # drafts gain per planned step (each saves the row's share of a step) outweigh what planning it costs
    # (`planning_share`). A row whose recent plans gained less (`_SeqState.gain`) sits out the next steps:
    # as many as keep idle rows' planning within IDLE_PLANNING of a step, at most MAX_IDLE_GAP. Alone,
    # planning is ~0.4% of a step and a row is planned every step; a copying row always is.

    def observe_planning(self, seconds: float, rows: int) -> None:
        """Planning `rows` rows (lookups, choices, the batch's drafts; not model drafting) took `seconds`."""
        if rows:
            per_row = seconds / rows
            last = self._plan_row_s
            self._plan_row_s = per_row if last is None else PLANNING_DECAY * last + (1 - PLANNING_DECAY) * per_row
            self._shares.clear()

    def planning_share(self, rows: int) -> float:
        """What planning one row of a batch of `rows` costs, over the row's share of a plain step (0
        before timings; computed once per plan: every row of the step asks)."""
        share = self._shares.get(rows)
        if share is None:
            step = self.cost.verify_time(rows, rows) if self._plan_row_s is not None else None
            share = self._shares[rows] = self._plan_row_s * rows / step if step else 0.0
        return share

    def idle_gap(self, rows: int) -> int:
        """Every how many steps an idle row of a batch of `rows` is planned: the gap that keeps planning
        every row of the batch, all idle, within IDLE_PLANNING of a plain step."""
        return max(1, min(MAX_IDLE_GAP, math.ceil(self.planning_share(rows) / IDLE_PLANNING)))

    def due(self, request_id: str) -> bool:
        """Whether an `auto` row is planned this step (asked once per step: an idle row counts down)."""
        state = self.seqs.get(request_id)
        if state is None or state.wait <= 0:
            return True
        state.wait -= 1
        return False

    def planned(self, request_id: str, rows: int) -> None:
        """An `auto` row is planned this step in a batch of `rows` (`observe` then scores the plan)."""
        state = self.seqs.setdefault(request_id, _SeqState())
        state.planned_in = rows

    def _score_plan(self, state: _SeqState, accepted: int) -> None:
        """A planned row's drafts gained `accepted` tokens: when its plans gain less than planning costs,
        it sits out the idle gap."""
        rows, state.planned_in = state.planned_in, 0
        last = self._gain if state.gain is None else state.gain  # a new row starts from every row's
        state.gain = PLANNING_DECAY * last + (1 - PLANNING_DECAY) * accepted
        self._gain = GLOBAL_DECAY * self._gain + (1 - GLOBAL_DECAY) * accepted
        share = self.planning_share(rows)
        state.wait = 0 if state.gain >= share else self.idle_gap(rows) - 1

    def acceptance(
        self, request_id: str, proposer: str, k_max: int = 1, level: int = 0, sampled: bool = False
    ) -> list[float]:
        """Per draft position, the expected acceptance of `proposer`'s drafts at confidence `level` for
        this sequence (`sampled`: the request samples rather than decoding greedily)."""
        key = _key(proposer, level, sampled)
        priors = self.traits[proposer].confidence_priors
        prior = priors[min(level, len(priors) - 1)] * (SAMPLED_PRIOR_SCALE if sampled else 1.0)
        engine_wide = self.global_rate.get(key)
        rates = engine_wide.chained(prior, LEVEL_PRIOR_WEIGHT, k_max) if engine_wide else [prior] * max(k_max, 1)
        state = self.seqs.get(request_id)
        seq = state.by_method.get(key) if state else None
        return seq.by_position(rates, PRIOR_WEIGHT, k_max) if seq else rates

    def own_cost(self, proposer: str, rows: int = 1) -> float:
        """One of `proposer`'s draft tokens against a plain step: declared, else timed, else a default."""
        own = self.traits[proposer].draft_token_cost
        if own is None:
            own = self.cost.draft_cost(proposer, rows)
        return DEFAULT_DRAFT_COST if own is None else own

    def method_cost(self, proposer: str, rows: int = 1, k: int = 1) -> float:
        """c for `proposer` when it drafts k tokens: verifying them plus producing them, per token."""
        return self.method_costs(proposer, rows, k)[k - 1]

    def method_costs(self, proposer: str, rows: int, k_max: int) -> list[float]:
        """`method_cost` for K = 1..k_max (index K - 1), computed once per timing: every row of a
        step asks for the same lists."""
        self._follow_timings()
        key = (proposer, rows, k_max)
        costs = self._costs.get(key)
        if costs is None:
            own = self.own_cost(proposer, rows)
            costs = self._costs[key] = [self.cost.token_cost(rows, k, self.packed) + own for k in range(1, k_max + 1)]
        return costs

    def ceiling(self, proposer: str, rows: int, k_max: int) -> float:
        """The speedup `proposer` would give one of `rows` rows drafting up to k_max tokens if every draft
        were accepted: an upper bound on what any acceptance can make of it (computed once per timing)."""
        self._follow_timings()
        key = (proposer, rows, k_max)
        ceiling = self._ceilings.get(key)
        if ceiling is None:
            ceiling = self._ceilings[key] = best_k(1.0, self.method_costs(proposer, rows, k_max), k_max)[1]
        return ceiling

    def _follow_timings(self) -> None:
        """Drop what was derived from the cost model's timings once it has a new one."""
        if self._costs_version != self.cost.version:
            self._costs.clear()
            self._ceilings.clear()
            self._costs_version = self.cost.version

    def usable(self, proposer: str, offers: dict[str, Offer]) -> bool:
        """Whether `proposer` may draft for a row this step: a lookahead proposer only with something
        to offer (seeded rows may use any: model proposers draft one-hot for them, see the module doc)."""
        traits = self.traits[proposer]
        return not traits.lookahead or bool(offers.get(proposer, Offer(0)).drafts)

    def choose(
        self,
        request_id: str,
        k_max: int,
        rows: int = 1,
        offers: dict[str, Offer] | None = None,
        sampled: bool = False,
        exclude: frozenset[str] = frozenset(),
    ) -> Choice:
        """Pick (proposer, K) for one of `rows` sequences in the batch. `offers`: what each lookahead
        proposer has ready for this row. `sampled`: the request samples (temperature > 0) rather than
        decoding greedily. `exclude`: proposers that cannot draft for the row this step."""
        offers = offers or {}
        state = self.seqs.setdefault(request_id, _SeqState())
        state.steps += 1
        best = Choice(None, 0, 1.0)
        for name in self.traits:
            if name in exclude or not self.usable(name, offers):
                continue
            offer = offers.get(name, Offer(k_max))
            limit = min(k_max, offer.drafts)
            if self.ceiling(name, rows, limit) <= MIN_GAIN:  # cannot pay even if every draft were kept
                continue
            a = self.acceptance(request_id, name, limit, offer.level, sampled)
            k, gain = best_k(a, self.method_costs(name, rows, limit), limit)
            if k and gain > best.predicted_speedup * (MIN_GAIN if best.proposer is None else 1.0):
                best = Choice(name, k, gain)
        # In a padded batch, one row's lone probe widens the verify pass for every row, which costs
        # far more than its share: there, rows draft only within the batch's width (`batch_width`).
        if best.proposer is None and k_max and (rows == 1 or self.packed):
            costs = {m: self.method_costs(m, rows, 1)[0] for m in self.traits
                     if m not in exclude and self.usable(m, offers)}
            best = self._probe(state, costs, k_max) or best
        if best.proposer is not None:
            state.last_used[best.proposer] = state.steps
        return best

    def batch_drafts(self, rows: list[BatchRow]) -> tuple[list[int], float] | None:
        """How many drafts each row verifies this step (a flexible row's share of its proposal; other
        rows keep their `k`) and the expected tokens per second that gives (None: no timings yet):
        one width for all when passes are padded (`batch_width`), else `packed_drafts`."""
        if not self.packed:
            best = self.batch_width(rows)
            return None if best is None else ([min(best[0], r.flexible) if r.flexible else r.k for r in rows], best[1])
        return self.packed_drafts(rows)

    def _fixed(self, rows: list[BatchRow]) -> tuple[float, float, list[list[float]]]:
        """For `batch_width`/`packed_drafts`: the expected tokens of the rows whose drafts are fixed, the
        seconds their model proposers draft for, and per flexible row its expected tokens with 0..flexible
        drafts."""
        fixed_tokens = sum(
            expected_tokens_upto(self.acceptance(r.request_id, r.proposer, r.k, r.level, r.sampled), r.k)[-1]
            for r in rows if not r.flexible and r.proposer is not None
        ) + sum(1.0 for r in rows if not r.flexible and r.proposer is None)
        drafting_s = 0.0  # forwards and backlogs of proposers whose rows' drafts are fixed (lookahead ones: ~free)
        for name in {r.proposer for r in rows if r.k and not r.flexible and r.proposer is not None}:
            mine = [r for r in rows if r.proposer == name and r.k and not r.flexible]
            most = max(r.k for r in mine)
            drafting_s += most * self.own_cost(name, len(rows)) * (self.cost.verify_time(len(rows), len(rows)) or 0.0)
            # what its rows missed, taken in first: a row's whole context when it first drafts with a model
            drafting_s += self.cost.backlog_time(name, sum(r.backlog for r in mine))
        expected = [  # per flexible row: expected tokens with 0..flexible drafts
            expected_tokens_upto(self.acceptance(r.request_id, r.proposer, r.flexible, r.level, r.sampled), r.flexible)
            for r in rows if r.flexible
        ]
        return fixed_tokens, drafting_s, expected

    def packed_drafts(self, rows: list[BatchRow]) -> tuple[list[int], float] | None:
        """Drafts per row when a pass costs the tokens it computes. Each flexible row's j-th draft adds
        its chance of being accepted (every earlier one accepted too: non-increasing in j) to the
        expected tokens and one token to the pass; taking the likeliest drafts first, the pass gets as
        many as maximise expected tokens over the pass's measured time (no wider pass is timed once
        even every draft left, all accepted, could not beat the best so far: a step asks this for
        every batch, with up to K drafts offered per row)."""
        if not self.cost.fitted:
            return None
        fixed_tokens, drafting_s, expected = self._fixed(rows)
        flexible = [b for b, r in enumerate(rows) if r.flexible]
        fed = sum(1 + (0 if r.flexible else r.k) for r in rows)
        gains = sorted(
            ((e[j] - e[j - 1], b) for b, e in zip(flexible, expected, strict=True) for j in range(1, len(e))),
            key=lambda g: -g[0],
        )
        tokens = fixed_tokens + len(flexible)
        best_n, best = 0, tokens / (self.cost.verify_time(fed, len(rows)) + drafting_s)
        floor = best * (MIN_GAIN if fed == len(rows) else 1.0)
        rest = sum(gain for gain, _ in gains)  # what the drafts not taken yet could add, at most
        for n, (gain, _) in enumerate(gains, start=1):
            seconds = self.cost.verify_time(fed + n, len(rows)) + drafting_s
            if (tokens + rest) / seconds <= max(best, floor):
                break  # wider passes take at least as long, and the gains left only shrink
            tokens += gain
            rest -= gain
            if tokens / seconds > max(best, floor):
                best_n, best = n, tokens / seconds
        ks = [0 if r.flexible else r.k for r in rows]
        for _, b in gains[:best_n]:
            ks[b] += 1
        return ks, best

    def batch_width(self, rows: list[BatchRow]) -> tuple[int, float] | None:
        """The number of draft positions W to verify this step for a batch, and the expected tokens
        per second it gives (None: no timings yet).

        The verify pass computes every row padded to the widest one, so its cost depends on W, not
        on each row's own K, and a row's drafts up to W cost nothing extra. Flexible rows (`auto`
        rows with a lookahead proposal) therefore draft min(W, their proposal) each, and W maximises
        the batch's expected tokens per second: the sum of every row's expected tokens over the
        measured time of a pass over rows x (W + 1) tokens, plus the forwards of every proposer that
        drafts for some row. Rows with fixed drafts set the least W.
        """
        if not self.cost.fitted:
            return None
        fixed_w = max((r.k for r in rows), default=0)
        fixed_tokens, drafting_s, expected = self._fixed(rows)
        top = max([fixed_w, *(r.flexible for r in rows if r.flexible)])

        def score(w: int) -> float:
            tokens = fixed_tokens + sum(e[min(w, len(e) - 1)] for e in expected)
            return tokens / (self.cost.verify_time(len(rows) * (w + 1), len(rows)) + drafting_s)

        best_w, best = fixed_w, score(fixed_w)
        floor = best * (MIN_GAIN if fixed_w == 0 else 1.0)
        for w in range(fixed_w + 1, top + 1):
            s = score(w)
            if s > max(best, floor):
                best_w, best = w, s
        return best_w, best

    def _probe(self, state: _SeqState, costs: dict[str, float], k_max: int) -> Choice | None:
        """Now and then draft one token with an unused proposer, so a sequence whose text turns
        predictable later is noticed. A probe costs c (one draft token); probing every c /
        PROBE_OVERHEAD steps keeps their total cost within PROBE_OVERHEAD: a cheap lookup is
        re-checked every few steps, a model rarely (every 64 steps at the least often). A proposer
        too costly to pay even if every draft were accepted is never probed."""
        for name, cost in costs.items():
            if best_k(1.0, cost, k_max)[1] < MIN_GAIN:
                continue
            interval = min(max(math.ceil(cost / PROBE_OVERHEAD), 2), 64)
            if state.steps - state.last_used.get(name, 0) >= interval:
                return Choice(name, 1, 1.0)
        return None

    def observe(
        self, request_id: str, proposer: str | None, drafted: int, accepted: int, level: int = 0, sampled: bool = False
    ) -> None:
        """What verification did to one sequence's drafts (`level`: their confidence level; `sampled`:
        the request samples rather than decoding greedily)."""
        state = self.seqs.setdefault(request_id, _SeqState())
        if state.planned_in:
            self._score_plan(state, accepted if proposer is not None and drafted else 0)
        if proposer is None or not drafted:
            return
        key = _key(proposer, level, sampled)
        state.by_method.setdefault(key, _Acceptance()).update(drafted, accepted, DECAY)
        self.global_rate.setdefault(key, _Acceptance()).update(drafted, accepted, 0.99)
