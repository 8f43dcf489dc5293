"""torch's CPU thread count for each engine step, chosen from the steps' own timings.

torch's CPU kernels run their parallel regions on an OpenMP team (libgomp in the PyPI wheels). Between
regions libgomp's workers spin for a while before they sleep (its default). A decode step of a small
model is a few hundred short regions, so on an idle machine spinning matters a great deal: measured on
the 2-core development machine, SmolLM2-135M, 128 greedy tokens, processes interleaved, median of 5 runs,
49.9 ms/token with the default spin against 65.9 with `OMP_WAIT_POLICY=PASSIVE` (a sleeping worker has to
be woken for every region). But when another process keeps one of the cores busy, a spinning worker
waits for a master that is not running: a step with 2 threads then took 650-780 ms/token, ~10x what one
thread takes (passive waiting suffered less, 76-100 ms, but pays its cost on every idle step).

No constant is right for a machine whose load comes and goes, so the engine measures. Each verify pass is
timed and divided by what the planner's step-cost model predicts for its width (so steps of different
sizes compare); the governor keeps a moving average of that ratio for the thread count steps run at, and
now and then runs a probe: `PROBE_STEPS` steps in a row at the other count, scored by their median
(after a probe that loses, it waits twice as long before the next, up to a bound; a probe step at least
`HOPELESS` times the current count's ends it, so a many-core host pays one slow step, not three). It
switches only on a probe that beats the current count by `MARGIN`; when the current count gets slower
than the other was when last probed, it probes at once rather than switch on a stale figure. A single
step decided both before, and on a 2-core VM whose steps vary by 15% from one to the next with no other
process running, that flapped: 14 switches in a minute, a third of some waves' steps at one thread, and
plain decoding at 8 rows ran 0.96x what it ran at a fixed two threads (in-process, 6 alternating waves).
Only on CPU, and only when torch has more than one thread to begin with.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

FIRST_PROBE_S = 2.0  # the first look at the other thread count, and the gap again after a switch
MAX_PROBE_S = 120.0  # the longest wait between probes (probes that keep losing double the wait)
ALPHA = 0.3  # weight of a new timing in the current thread count's moving average
MARGIN = 0.2  # switch only to a count at least this much cheaper (relative), so noise does not flap
PROBE_STEPS = 3  # steps a probe runs at the other count: their median scores it
HOPELESS = 2.0  # a probe step this many times the current count's score ends the probe (a many-core host's one thread)


class ThreadGovernor:
    """Chooses torch's intra-op thread count per step: `threads` (what torch had at start) or 1."""

    def __init__(
        self,
        threads: int,
        *,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = (threads, 1) if threads > 1 else (threads,)
        self.current = threads  # the count steps run at, unless probing
        self.score: dict[int, float] = {}  # count -> moving average of (seconds / predicted seconds)
        self.switches = 0
        self._set_threads = set_threads
        self._clock = clock
        self._applied = threads  # what torch is set to now
        self._gap = FIRST_PROBE_S
        self._next_probe: float | None = None
        self._probe: list[float] | None = None  # while probing: the probe's ratios so far

    def _other(self) -> int | None:
        return next((n for n in self.options if n != self.current), None)

    def before_step(self) -> int:
        """Set torch's thread count for the coming step (the current count, or the other one while probing)."""
        other = self._other()
        n = self.current
        if other is not None:
            now = self._clock()
            if self._next_probe is None:
                self._next_probe = now + self._gap
            elif self._probe is None and now >= self._next_probe:
                self._probe = []
            if self._probe is not None:
                n = other
        if n != self._applied:
            self._set_threads(n)
            self._applied = n
        return n

    @property
    def probing(self) -> bool:
        """Whether the coming (or current) step runs at the other thread count, as a probe: its timing
        is not what steps at the current count take, so it must not teach the step-cost model."""
        return self._probe is not None

    def observe(self, seconds: float, predicted: float | None) -> None:
        """A verify pass of this step took `seconds`; the cost model predicted `predicted` for its width
        (None before it has timings: nothing to compare with yet)."""
        if predicted is None or predicted <= 0 or seconds <= 0:
            return
        ratio = seconds / predicted
        other = self._other()
        if other is None:
            self.score[self.current] = ratio
            return
        if self._probe is not None:
            self._probe.append(ratio)
            current = self.score.get(self.current)
            hopeless = current is not None and ratio >= HOPELESS * current  # no need to run the rest of it
            if len(self._probe) < PROBE_STEPS and not hopeless:
                return
            # replaces what is known of the other count (maybe minutes old)
            self.score[other] = ratio if hopeless else statistics.median(self._probe)
            self._probe = None
            if self.current in self.score and self._cheaper(other, self.current):
                self._switch(other)
            else:
                self._gap = min(2 * self._gap, MAX_PROBE_S)
                self._next_probe = self._clock() + self._gap
            return
        old = self.score.get(self.current)
        self.score[self.current] = ratio if old is None else old + ALPHA * (ratio - old)
        if other in self.score and self._cheaper(other, self.current):
            self._next_probe = self._clock()  # slower than the other was when last seen: look again now

    def _cheaper(self, a: int, b: int) -> bool:
        return self.score[a] < (1 - MARGIN) * self.score[b]

    def _switch(self, n: int) -> None:
        log.info(
            "torch threads %d -> %d (step time / predicted: %s)", self.current, n,
            ", ".join(f"{k} threads {v:.2f}" for k, v in sorted(self.score.items())),
        )
        self.current = n
        self.score.pop(n, None)  # the count switched to is scored afresh by the steps it now runs
        self.switches += 1
        self._gap = FIRST_PROBE_S
        self._next_probe = self._clock() + self._gap
