"""`auto`'s cost model: what a target pass of each shape costs, and a model proposer's draft token.

One estimator (chosen against the others tried by how well each predicted the next pass: docs/bench.md,
"The cost model's estimator"). A verify pass of `rows` rows over `tokens` fed tokens costs

    verify_time(rows, tokens) = plain_time(rows) x ratio(rows, tokens)

* `ratio(rows, tokens)`, the shape: what a wider pass costs against the plain passes (every row feeding
  one token) of its own moment: each timing over the median of the batch size's plain passes when it was
  taken (while it has timed none, over its plain time as read from its passes, below), the median of those
  per width (calibration's ratio counted once per timing it took), non-decreasing in the width,
  linear between widths and beyond the widest. A batch size with no wider pass timed reads what the same
  drafts added at the nearest batch size that has (the next larger first: a draft costs more in a larger
  batch, so erring there drafts less); with none anywhere, the prior's share of a row per token.
* `plain_time(rows)`, the speed: the median of the batch size's recent passes as plain-pass times (a plain
  pass as it is, a wider one over its ratio: a row that drafts at every step times no plain pass, yet its
  passes say how fast the host runs); a batch size only calibration timed, calibration's scaled to today's
  speed (`scale`); any other, interpolated between the batch sizes that have one.

Why ratios: a shared host's speed drifts by 10-20% within seconds, and the plain width is timed almost every
step while wider ones come now and then: absolute medians of the two compare moments, not widths (a few
slow plain passes made every draft look cheap, and `auto` drafted exactly then). Why per batch size: a
pass's time depends on its rows, not only on its tokens (8 tokens cost less as one row drafting 7 than as
8 plain rows, and one row drafting one token in a batch of 8 costs far more than an eighth of a step: the
packed pass's gathers and per-row attention). Start-up calibration (server/engine/calibration.py) comes in
as prior timings: its ratios need no scaling, and its plain passes are scaled (it may have been taken while
several servers started at once, every pass several times too slow).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from server.speculation.tuning import AutoTuning


def elapsed_since(started: float, device: torch.device) -> float:
    """Seconds since `started` (perf_counter), counting the kernels on a GPU, not just their launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def non_decreasing(values: list[float], weights: list[float]) -> list[float]:
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


def _linear(xs: list[int], ys: list[float], x: float) -> float:
    """The piecewise-linear curve through (xs, ys) at x; past its last point, the line from its first point
    through its last (one noisy last segment must not set every wider pass's price); before its first
    point, its first segment."""
    if len(xs) == 1:
        return ys[0]
    if x > xs[-1]:
        return ys[-1] + (ys[-1] - ys[0]) * (x - xs[-1]) / (xs[-1] - xs[0])
    i = max(next(i for i, v in enumerate(xs) if v >= x), 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class _Batch:
    """The passes of one batch size: plain ones (one token a row) and wider ones as ratios to them."""

    plain: deque[float]  # traffic's passes as plain-pass seconds: plain ones, and wider ones over their ratio
    timed_plain: deque[float]  # traffic's plain passes alone
    ratios: dict[int, deque[float]] = field(default_factory=dict)  # width -> traffic's timings over plain's median
    prior: dict[int, list[float]] = field(default_factory=dict)  # width -> calibration's timings, seconds


class CostModel:
    """Verify and drafting times, learnt from timings (see the module docstring)."""

    def __init__(self, tuning: AutoTuning | None = None) -> None:
        self.tuning = tuning or AutoTuning()
        self._batches: dict[int, _Batch] = {}
        self._draft: dict[str, dict[int, deque[float]]] = {}  # proposer -> rows drafting -> seconds per draft token
        self._prior_draft: dict[str, dict[int, list[float]]] = {}  # the same, from calibration
        self._backlog: dict[str, deque[float]] = {}  # proposer -> seconds per backlog token

    # ---- what is learnt --------------------------------------------------------------------------
    def observe_verify(self, rows: int, tokens: int, seconds: float, prior: bool = False) -> None:
        """A pass of `rows` rows over `tokens` fed tokens took `seconds` (`prior`: timed by calibration)."""
        batch, kept = self._batch(rows), self.tuning.timings_kept
        if prior:
            batch.prior.setdefault(tokens, []).append(seconds)
            return
        if tokens <= rows:
            batch.timed_plain.append(seconds)
        else:  # its ratio to the plain passes of its moment (as timed, else as read from the batch's passes)
            if plain := batch.timed_plain or batch.plain:
                batch.ratios.setdefault(tokens, deque(maxlen=kept)).append(seconds / statistics.median(plain))
            shape = PassCosts(self, rows, 1.0)  # this width against a plain pass, as the model prices it now
            seconds *= shape.verify(rows) / shape.verify(tokens)
        batch.plain.append(seconds)  # how fast plain passes of this batch size run now

    def observe_draft(self, proposer: str, rows: int, forwards: int, seconds: float, prior: bool = False) -> None:
        """`proposer` drafted up to `forwards` tokens for each of `rows` rows at once in `seconds`."""
        if forwards:
            table = (self._prior_draft if prior else self._draft).setdefault(proposer, {})
            into = table.setdefault(rows, [] if prior else deque(maxlen=self.tuning.draft_timings_kept))
            into.append(seconds / forwards)

    def observe_backlog(self, proposer: str, tokens: int, seconds: float) -> None:
        """`proposer` took in `tokens` backlog tokens (a row entering its cache, or back after steps it did not
        draft) in `seconds` beyond its drafting forwards' time."""
        if tokens > 0:
            times = self._backlog.setdefault(proposer, deque(maxlen=self.tuning.draft_timings_kept))
            times.append(max(seconds, 0.0) / tokens)

    def _batch(self, rows: int) -> _Batch:
        if rows not in self._batches:
            kept = self.tuning.timings_kept
            self._batches[rows] = _Batch(deque(maxlen=kept), deque(maxlen=kept))
        return self._batches[rows]

    # ---- what is predicted -----------------------------------------------------------------------
    @property
    def timed(self) -> bool:
        """Whether any plain pass was timed (before that, times are in units of a one-row plain pass)."""
        return any(b.plain or b.prior.get(rows) for rows, b in self._batches.items())

    def scale(self) -> float:
        """How much slower (> 1) or faster the machine runs now than at calibration: the median, over the
        batch sizes both timed plainly, of traffic's median plain pass over calibration's; 1 while none."""
        ratios = [statistics.median(b.plain) / statistics.median(b.prior[rows])
                  for rows, b in self._batches.items() if b.plain and b.prior.get(rows)]
        return statistics.median(ratios) if ratios else 1.0

    def _own_plain(self, rows: int, scale: float) -> float | None:
        batch = self._batches.get(rows)
        if batch is None:
            return None
        if batch.plain:
            return statistics.median(batch.plain)
        prior = batch.prior.get(rows)
        return statistics.median(prior) * scale if prior else None

    def plain_time(self, rows: int) -> float | None:
        """Seconds of a plain pass of `rows` rows; None before any plain pass was timed."""
        scale = self.scale()
        known = {b: t for b in self._batches if (t := self._own_plain(b, scale)) is not None}
        if rows in known:
            return known[rows]
        if not known:
            return None
        sizes = sorted(known)
        if len(sizes) == 1:  # one batch size timed: each row more adds the prior's share of a row
            r = self.tuning.prior_token_ratio
            return known[sizes[0]] * (1 + r * (rows - 1)) / (1 + r * (sizes[0] - 1))
        return max(_linear(sizes, [known[b] for b in sizes], rows), 1e-6)

    def ratios(self, rows: int) -> tuple[list[int], list[float]] | None:
        """(widths, ratios to the plain pass) at `rows` rows, the plain width first, non-decreasing; None when no
        wider pass was timed at that batch size."""
        batch = self._batches.get(rows)
        if batch is None:
            return None
        prior_plain = statistics.median(batch.prior[rows]) if batch.prior.get(rows) else None
        points = []
        for width in sorted({*batch.ratios, *(batch.prior if prior_plain else ())}):
            if width <= rows:
                continue
            values = list(batch.ratios.get(width, ()))
            prior = batch.prior.get(width, []) if prior_plain else []
            if prior:  # calibration's ratio, once per timing it took
                values += [statistics.median(prior) / prior_plain] * len(prior)  # type: ignore[operator]
            points.append((width, statistics.median(values), len(values)))
        if not points:
            return None
        # the plain width's ratio is 1 by definition, weighed as the plain passes behind it: a wider width
        # timed below it (noise, or the host sped up) pulls both to their weighted mean rather than pricing
        # every wider pass above what it measured
        anchor = (rows, 1.0, len(batch.plain) + len(batch.prior.get(rows, ())))
        points = [anchor, *points]
        return [w for w, _, _ in points], non_decreasing([r for _, r, _ in points], [n for _, _, n in points])

    def verify_time(self, rows: int, tokens: int) -> float | None:
        """Seconds of a pass of `rows` rows over `tokens` fed tokens; None before any plain pass was timed."""
        plain = self.plain_time(rows)
        return None if plain is None else PassCosts(self, rows, plain).verify(tokens)

    def draft_time(self, proposer: str, rows: int = 1) -> float | None:
        """Seconds of one of `proposer`'s draft tokens (one batched forward) when `rows` rows draft: the
        median of its timings per number of rows (traffic's, else calibration's scaled), linear between the
        numbers timed, the nearest beyond them; None before any timing. A model's forward for one row costs
        a fraction of its forward for eight on a CPU: one figure for every batch size would price a lone
        row's draft too high and eight rows' too low."""
        scale = self.scale()
        known = {r: statistics.median(t) * scale for r, t in self._prior_draft.get(proposer, {}).items() if t}
        known.update({r: statistics.median(t) for r, t in self._draft.get(proposer, {}).items() if t})
        if not known:
            return None
        sizes = sorted(known)
        if rows <= sizes[0] or rows >= sizes[-1]:
            return known[sizes[0] if rows <= sizes[0] else sizes[-1]]
        return _linear(sizes, [known[r] for r in sizes], rows)

    def backlog_time(self, proposer: str, tokens: int) -> float:
        """Seconds `proposer` takes to take in `tokens` backlog tokens: the median of its timings per token;
        0 before any (a first draft is not refused for a cost nobody has measured)."""
        times = self._backlog.get(proposer)
        return statistics.median(times) * tokens if times and tokens else 0.0

    def costs(self, rows: int) -> PassCosts:
        """What passes of `rows` rows cost now: a snapshot for one step's decisions."""
        plain = self.plain_time(rows)
        return PassCosts(self, rows, plain if plain is not None else self._prior_plain(rows))

    def _prior_plain(self, rows: int) -> float:
        """A plain pass of `rows` rows before any timing, in one-row plain passes."""
        return 1.0 + self.tuning.prior_token_ratio * (rows - 1)


class PassCosts:
    """The passes of one batch size as the cost model prices them at one moment: made once per step and
    read many times (every row, proposer and width a step weighs)."""

    def __init__(self, cost: CostModel, rows: int, plain: float) -> None:
        self.rows, self.plain = rows, plain
        self._nearest = None
        curve = cost.ratios(rows)
        if curve is None:  # no wider pass timed here: what drafts added at the nearest batch size that has some
            others = [(b, c) for b in sorted(cost._batches) if b != rows and (c := cost.ratios(b)) is not None]
            above = [(b, c) for b, c in others if b > rows]
            near = above[0] if above else (others[-1] if others else None)
            if near is not None:
                self._nearest = (near[0], cost.plain_time(near[0]) or plain, near[1])
        self._curve = curve
        self._token_ratio = cost.tuning.prior_token_ratio

    def verify(self, tokens: int) -> float:
        """Seconds (or one-row plain passes, before any timing) of a pass over `tokens` fed tokens."""
        drafts = tokens - self.rows
        if self._curve is not None:
            return self.plain * _linear(*self._curve, max(tokens, self.rows))
        if drafts <= 0:
            return self.plain
        if self._nearest is not None:
            near, near_plain, curve = self._nearest
            return self.plain + near_plain * (_linear(*curve, near + drafts) - 1.0)
        r = self._token_ratio  # nothing wider timed anywhere: the prior's share of a row per token
        return self.plain * (1 + r * drafts / (1 + r * (self.rows - 1)))
