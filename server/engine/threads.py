"""torch's CPU thread count for each engine step, chosen from the steps' own timings.

torch's CPU kernels run their parallel regions on an OpenMP team (libgomp in the PyPI wheels). Between
regions libgomp's workers spin for a while before they sleep (its default). A decode step of a small
model is a few hundred short regions, so on an idle machine spinning makes steps markedly faster (a
sleeping worker has to be woken for every region). But when another process keeps one of the cores busy, a
spinning worker waits for a master that is not running, and a step with 2 threads takes several times
what one thread takes (passive waiting suffers less, but pays its cost on every idle step). The figures:
docs/bench.md, "Figures behind the code".

No constant is right for a machine whose load comes and goes, so the engine measures. Each verify pass is
timed and divided by what the planner's step-cost model predicts for its width (so steps of different
sizes compare); the governor keeps a moving average of that ratio per thread count, runs the steps at
the count with the lower one, and now and then runs one step at the other count to see whether the
machine has changed (after a probe that loses, it waits twice as long before the next, up to a bound).
Only on CPU, and only when torch has more than one thread to begin with.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from server.failsafe import OptionalParts

log = logging.getLogger(__name__)

FIRST_PROBE_S = 2.0  # the first look at the other thread count, and the gap again after a switch
MAX_PROBE_S = 120.0  # the longest wait between probes (probes that keep losing double the wait)
ALPHA = 0.3  # weight of a new timing in a thread count's moving average
MARGIN = 0.1  # switch only to a count at least this much cheaper (relative), so noise does not flap


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
        self._probing = False

    def _other(self) -> int | None:
        return next((n for n in self.options if n != self.current), None)

    def before_step(self, probe: bool = True) -> int:
        """Set torch's thread count for the coming step (the current count, or the other one as a probe).

        `probe=False`: this step may not be the probe (it computes prompt tokens: its time is compared with
        nothing, and at one thread a prefill takes about twice as long; after an idle spell the first step, a
        prompt's, would otherwise be the one probed). A probe that is due waits for the next step that may be."""
        other = self._other()
        n = self.current
        if other is not None and probe:
            # a probe is due a gap after the current count's first score (`observe`): before it, a probe
            # would have nothing to be compared with
            due = self.current in self.score and self._next_probe is not None
            if due and self._clock() >= self._next_probe:
                n, self._probing = other, True
        if n != self._applied:
            self._set_threads(n)
            self._applied = n
        return n

    @property
    def probing(self) -> bool:
        """Whether the coming (or current) step runs at the other thread count, as a probe: its timing
        is not what steps at the current count take, so it must not teach the step-cost model."""
        return self._probing

    def observe(self, seconds: float, predicted: float | None) -> None:
        """A verify pass of this step took `seconds`; the cost model predicted `predicted` for its width
        (None before it has timings: nothing to compare with yet)."""
        ratio = seconds / predicted if predicted and seconds > 0 else math.nan  # NaN: nothing to learn
        if not 0 < ratio < math.inf:
            if self._probing:  # a probe step nothing can be learnt from: the probe is tried again later
                self._probing = False
                self._next_probe = self._clock() + self._gap
            return
        n = self._applied
        old = self.score.get(n)
        # A probe's timing replaces what is known of its count (that may be minutes old); the current
        # count's timings are averaged.
        self.score[n] = ratio if old is None or self._probing else old + ALPHA * (ratio - old)
        other = self._other()
        if other is None:
            return
        if self._next_probe is None:
            self._next_probe = self._clock() + self._gap
        if self._probing:
            self._probing = False
            if self._cheaper(other, self.current):
                self._switch(other)
            else:
                self._gap = min(2 * self._gap, MAX_PROBE_S)
            self._next_probe = self._clock() + self._gap
        elif other in self.score and self._cheaper(other, self.current):
            self._switch(other)  # the current count got slower than the other was when last seen

    def _cheaper(self, a: int, b: int) -> bool:
        """Whether count `a` is cheaper than `b` by the margin; a count with no score is never compared."""
        if a not in self.score or b not in self.score:
            return False
        return self.score[a] < (1 - MARGIN) * self.score[b]

    def _switch(self, n: int) -> None:
        log.info(
            "torch threads %d -> %d (step time / predicted: %s)", self.current, n,
            ", ".join(f"{k} threads {v:.2f}" for k, v in sorted(self.score.items())),
        )
        self.current = n
        self.switches += 1
        self._gap = FIRST_PROBE_S
        self._next_probe = self._clock() + self._gap


def governed(threads: ThreadGovernor, parts: OptionalParts, call: Callable[..., object], *args: object) -> None:
    """A call of the thread governor (an optional part: server/failsafe.py); when it raises, or once it is
    switched off, the steps run at the thread count it chose last."""
    if parts.on("threads"):
        try:
            call(*args)
            return
        except Exception as exc:
            parts.failed("threads", exc)
    if torch.get_num_threads() != threads.current:
        torch.set_num_threads(threads.current)
