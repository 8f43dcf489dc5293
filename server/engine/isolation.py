"""A row that fails takes no neighbour with it: a step's failures are pinned on the rows that cause them.

`Isolation.run(seqs, verify)` calls `verify(seqs, hold)` (plan, verify in one target pass, sample: what
changes only the caches' bookkeeping, the proposers and the rows' random streams) for every row. When it
raises, the step is undone (`Checkpoint`), each row's step is tried alone (undone again), and the step is
redone with the rows that fail alone held back: they feed nothing, draft nothing, sample nothing, and
leave with an error. A failure no row explains is the engine's own (`EngineFault`: the scheduler stops
serving), and so is a run of `FAULTY_STEPS` steps in which every row failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from server.engine.sequence import Sequence
from server.grammar import GrammarError
from server.model.kv_cache import BatchKV, KVCheckpoint
from server.speculation.planner import Planner

log = logging.getLogger(__name__)

FAULTY_STEPS = 3  # consecutive steps in which every row failed: the engine, not its requests, is broken

V = TypeVar("V")


class EngineFault(RuntimeError):
    """A step failed in a way no row explains: the engine's state cannot be trusted any more."""


@dataclass(frozen=True)
class Checkpoint:
    """What planning, verifying and sampling change, as it was before a step: the target cache, the
    proposers (their caches and pending tokens) and every row's random stream. Sequences themselves
    change only when committing, after the last restore."""

    kv: BatchKV
    kv_state: KVCheckpoint
    planner: Planner
    planner_state: dict[str, object]
    generators: list[tuple[torch.Generator, torch.Tensor]]

    @classmethod
    def take(cls, kv: BatchKV, planner: Planner, seqs: list[Sequence]) -> Checkpoint:
        return cls(kv, kv.checkpoint(), planner, planner.checkpoint(),
                   [(s.generator, s.generator.get_state()) for s in seqs])

    def restore(self) -> None:
        self.kv.restore(self.kv_state)
        self.planner.restore(self.planner_state)
        for gen, state in self.generators:
            gen.set_state(state)


def own_input(exc: BaseException) -> bool:
    """Whether a row failed on its own input (a grammar llguidance cannot follow): the client's 400,
    never a sign that the engine is broken."""
    return isinstance(exc, GrammarError)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class Isolation:
    """Runs a step's verification with failures pinned on rows, and counts steps that failed every row."""

    def __init__(self, kv: BatchKV, planner: Planner) -> None:
        self.kv, self.planner = kv, planner
        self._faulty_steps = 0  # consecutive steps in which every row failed

    def run(
        self, seqs: list[Sequence], verify: Callable[[list[Sequence], frozenset[str]], V]
    ) -> tuple[V | None, dict[str, Exception]]:
        """(`verify`'s result for the rows that do not fail alone, or None when every row does; request id ->
        exception for those). Raises `EngineFault` when a failure cannot be pinned on rows."""
        ckpt = Checkpoint.take(self.kv, self.planner, seqs)
        try:
            return verify(seqs, frozenset()), {}
        except Exception as exc:
            ckpt.restore()
            failed = self._culprits(seqs, verify, ckpt, exc)
        hold = frozenset(failed)
        try:
            return (verify(seqs, hold) if len(hold) < len(seqs) else None), failed
        except Exception as again:
            raise EngineFault(f"a step failed again without the rows that fail alone: {describe(again)}") from again

    def count(self, failed: dict[str, Exception], committed: bool) -> None:
        """The step's outcome: raises `EngineFault` after `FAULTY_STEPS` steps in a row in which every row
        failed (bad input never counts)."""
        own_fault = all(own_input(e) for e in failed.values())
        self._faulty_steps = self._faulty_steps + 1 if failed and not committed and not own_fault else 0
        if self._faulty_steps >= FAULTY_STEPS:
            last = describe(next(iter(failed.values())))
            raise EngineFault(f"{FAULTY_STEPS} steps in a row failed every row they ran; last: {last}")

    def _culprits(
        self, seqs: list[Sequence], verify: Callable[[list[Sequence], frozenset[str]], object], ckpt: Checkpoint,
        exc: Exception,
    ) -> dict[str, Exception]:
        """Request id -> its exception, for the rows whose step fails alone (the state restored after each
        try). Raises `EngineFault` when no row fails alone, or every row of a batch of several does."""
        if len(seqs) == 1:
            log.warning("step failed for request %s: %s", seqs[0].request_id, describe(exc), exc_info=exc)
            return {seqs[0].request_id: exc}
        ids = [s.request_id for s in seqs]
        bad: dict[str, Exception] = {}
        for rid in ids:
            try:
                verify(seqs, frozenset(ids) - {rid})
            except Exception as alone:
                log.warning("step failed for request %s alone: %s", rid, describe(alone), exc_info=alone)
                bad[rid] = alone
            finally:
                ckpt.restore()
        if not bad:
            raise EngineFault(f"a step failed but no row fails alone: {describe(exc)}") from exc
        if len(bad) == len(ids) and not all(own_input(e) for e in bad.values()):
            raise EngineFault(f"every row of a batch of {len(ids)} fails alone: {describe(exc)}") from exc
        return bad
