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

Steps that compute prompt tokens are a second kind with a decision of its own. Their passes are long
matrix products, whose parallel regions suffer far less from a busy core than a decode step's hundreds of
short ones, and the cost model predicts no chunk; so they are scored by seconds per budget token (a prompt
token weighted by its depth: server/speculation/budget.py) and probed on their own steps. With one decision
for both, a 2,000-token prompt that arrived while the decode steps ran at one thread (the HTTP server's own
work had made two threads lose a probe) ran all its 24 chunks at one thread: 0.43 s each instead of 0.23,
and no probe could move it (a prompt step was compared with nothing).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from server.failsafe import OptionalParts

log = logging.getLogger(__name__)

FIRST_PROBE_S = 2.0  # the first look at the other thread count, and the gap again after a switch
MAX_PROBE_S = 120.0  # the longest wait between probes (probes that keep losing double the wait)
ALPHA = 0.3  # weight of a new timing in a thread count's moving average
MARGIN = 0.1  # switch only to a count at least this much cheaper (relative), so noise does not flap
IDLE_S = 1.0  # a step that starts this long after the last pass ended follows an idle spell: never a probe


DECODE = "decode"  # steps that compute no prompt tokens: scored against the cost model's prediction
PROMPT = "prompt"  # steps that compute prompt tokens: scored per budget token (budget.py's weights)


@dataclass
class _Track:
    """The thread count for one kind of step, and what the governor knows of each count for that kind."""

    current: int  # the count these steps run at, unless probing
    score: dict[int, float] = field(default_factory=dict)  # count -> moving average of seconds / predicted
    gap: float = FIRST_PROBE_S
    next_probe: float | None = None


class ThreadGovernor:
    """Chooses torch's intra-op thread count per step: `threads` (what torch had at start) or 1, for decoding
    steps and for steps that compute prompt tokens separately (module doc)."""

    def __init__(
        self,
        threads: int,
        *,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = (threads, 1) if threads > 1 else (threads,)
        self.tracks = {DECODE: _Track(threads), PROMPT: _Track(threads)}
        self.switches = 0
        self._set_threads = set_threads
        self._clock = clock
        self._applied = threads  # what torch is set to now
        self._kind = DECODE  # the kind of the coming (or current) step
        self._last_pass: float | None = None  # when the last observed pass ended
        self._probing = False

    @property
    def current(self) -> int:
        """The count decoding steps run at (what the steps keep when the governor fails: `governed`)."""
        return self.tracks[DECODE].current

    @property
    def score(self) -> dict[int, float]:
        """What is known of each count for decoding steps."""
        return self.tracks[DECODE].score

    def _other(self, track: _Track) -> int | None:
        return next((n for n in self.options if n != track.current), None)

    def before_step(self, kind: str = DECODE) -> int:
        """Set torch's thread count for a coming step of `kind` (DECODE or PROMPT): the count that kind runs
        at, or the other one as a probe.

        A probe falls due a gap after the kind's first score, and never on the first step after an idle spell
        (`IDLE_S`): that step is a new request's prompt, whose first token the probe would delay. Prompt steps
        between decode steps do probe: under a busy core they may crawl at every thread as decode steps do."""
        track = self.tracks[kind]
        now = self._clock()
        busy = self._last_pass is not None and now - self._last_pass < IDLE_S  # however long the steps take
        self._kind = kind
        n = track.current
        other = self._other(track)
        if other is not None and busy and track.current in track.score \
                and track.next_probe is not None and now >= track.next_probe:
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
        """This step's pass took `seconds`; `predicted`: for a decoding step the cost model's prediction for
        its width, for a prompt step its size in budget tokens (None: nothing to compare with)."""
        track = self.tracks[self._kind]
        self._last_pass = self._clock()
        ratio = seconds / predicted if predicted and seconds > 0 else math.nan  # NaN: nothing to learn
        if not 0 < ratio < math.inf:
            if self._probing:  # a probe step nothing can be learnt from: the probe is tried again later
                self._probing = False
                track.next_probe = self._clock() + track.gap
            return
        n = self._applied
        old = track.score.get(n)
        # A probe's timing replaces what is known of its count (that may be minutes old); the current
        # count's timings are averaged.
        track.score[n] = ratio if old is None or self._probing else old + ALPHA * (ratio - old)
        other = self._other(track)
        if other is None:
            return
        if track.next_probe is None:
            track.next_probe = self._clock() + track.gap
        if self._probing:
            self._probing = False
            if _cheaper(track, other, track.current):
                self._switch(track, other)
            else:
                track.gap = min(2 * track.gap, MAX_PROBE_S)
            track.next_probe = self._clock() + track.gap
        elif other in track.score and _cheaper(track, other, track.current):
            self._switch(track, other)  # the current count got slower than the other was when last seen

    def _switch(self, track: _Track, n: int) -> None:
        log.info(
            "torch threads %d -> %d for %s steps (step time / predicted: %s)", track.current, n, self._kind,
            ", ".join(f"{k} threads {v:.3g}" for k, v in sorted(track.score.items())),
        )
        track.current = n
        self.switches += 1
        track.gap = FIRST_PROBE_S
        track.next_probe = self._clock() + track.gap


def _cheaper(track: _Track, a: int, b: int) -> bool:
    """Whether count `a` is cheaper than `b` by the margin; a count with no score is never compared."""
    if a not in track.score or b not in track.score:
        return False
    return track.score[a] < (1 - MARGIN) * track.score[b]


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
