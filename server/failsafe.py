"""The engine's optional parts fail safe: an exception in one costs speed, never an answer.

The thread governor, calibration, the step-cost model, the acceptance estimates, the planner, each
proposer, the prefix cache and the grammar's fast path (forced tokens, drafts cut at the grammar) exist
to make steps cheaper; none is needed for a correct answer, because the target's verify pass and the
rejection sampler decide every token. So each is called through `OptionalParts` at its boundary: an
exception there is logged (with its traceback the first time), counted per part (the scheduler feeds
`specula_engine_degraded_total{part}`, `/health` lists the parts that failed), and the step goes on
without the part: the caller's fallback is what a server without that part would do (plain decoding for
the step, a full prefill, the current thread count, calibrating from traffic). A part that keeps failing
(`SWITCH_OFF_AFTER` failures) is switched off until restart. A request whose speculation loses a proposer
this way is told so (the planner's `fallbacks`: `usage.speculation.fallbacks`, and
`specula_spec_decode_fallbacks_total` counts them), so a method that fails safe never looks like one that ran.

Part names: `threads`, `calibration`, `cost_model`, `acceptance`, `planner`, `prefix_cache`, `grammar`,
`kernels` (the CPU block kernels could not be built or loaded: recorded once at start, the blocks then multiply
through torch's kernel) and `proposer:<name>` per proposer. Single-threaded like the engine; other threads only
read `report()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

SWITCH_OFF_AFTER = 5  # failures of one part before it is switched off until restart

T = TypeVar("T")


class OptionalParts:
    """Failure counts and switches of the engine's optional parts (see the module docstring)."""

    def __init__(self, switch_off_after: int = SWITCH_OFF_AFTER) -> None:
        self.switch_off_after = switch_off_after
        self.failures: dict[str, int] = {}  # part -> failures since start
        self.off: set[str] = set()  # parts switched off until restart
        self.errors: dict[str, str] = {}  # part -> its last failure's exception type (the message goes to the log)
        self._unreported: list[str] = []  # one entry per failure not yet handed to the metrics (`take_new`)

    def on(self, part: str) -> bool:
        """Whether `part` is still in use."""
        return part not in self.off

    def failed(self, part: str, exc: BaseException) -> None:
        """`part` raised `exc`; the caller goes on without it."""
        self.errors[part] = type(exc).__name__  # first: `report` reads it for every part `failures` holds
        n = self.failures[part] = self.failures.get(part, 0) + 1
        self._unreported.append(part)
        if n == 1:
            log.error("optional part %s failed; the engine goes on without it for now: %s: %s",
                      part, type(exc).__name__, exc, exc_info=exc)
        else:
            log.debug("optional part %s failed again (%d): %s: %s", part, n, type(exc).__name__, exc)
        if n >= self.switch_off_after and part not in self.off:
            self.off.add(part)
            log.error("optional part %s failed %d times: switched off until restart", part, n)

    def call(self, part: str, fn: Callable[..., T], *args: object, default: T, **kwargs: object) -> T:
        """`fn(*args, **kwargs)`, or `default` when `part` is off or the call raises (counted)."""
        if part in self.off:
            return default
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.failed(part, exc)
            return default

    def take_new(self) -> list[str]:
        """The parts that failed since the last call, one entry per failure (for the step's report)."""
        new, self._unreported = self._unreported, []
        return new

    def report(self) -> dict[str, dict[str, int | bool | str]]:
        """Per part that has failed: {"failures": n, "off": switched off, "error": its last exception's type}."""
        return {part: {"failures": n, "off": part in self.off, "error": self.errors.get(part, "")}
                for part, n in sorted(self.failures.items())}
