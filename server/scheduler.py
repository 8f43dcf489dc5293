"""Continuous batching between the asyncio HTTP side and the single-threaded engine.

The event loop calls `submit`/`abort`/`shutdown`; one dedicated worker thread owns the engine and
runs `admit -> step -> deliver` forever:

* **admit** (at a step boundary): apply pending aborts, then move waiting sequences into the engine
  while fewer than `max_batch_size` are running and the engine `fits` them (its KV budget). The waiting
  queue is ordered by each request's `priority` (lower first, as vLLM's), first come first served within
  one priority; a running sequence is never preempted for a waiting one.
  Sequences join and leave while others are mid-generation.
* **step**: one `engine.step()` for everything running.
* **deliver**: each `RequestOutput` goes to its request's `RequestStream` through
  `loop.call_soon_threadsafe`, so the event loop never blocks on model work.

The scheduler is the one owner of the waiting queue, the running set and pending aborts; the engine
only holds the batch it is given. Admission control happens in `submit`: a request the engine
cannot run (`ServingLimits.check`) is `RequestRejected` at once, as is one with more sequences than
an idle server admits (`NeverFits`, a 400: retrying cannot help); at most `max_waiting` sequences may
wait beyond the free batch slots, otherwise `QueueFull` (the API answers 429).
An aborted request (client gone) leaves the batch at the next step boundary, as does a choice the API
ends itself (`finish`: its answer is complete though the engine would go on). A sequence the engine
fails alone (`StepResult.failed`: its part of a step raised) gets `EngineError`, with its API
request's other sequences; the others carry on. Anything that escapes the engine's isolation (a step
that raises, a BaseException, a bug in this loop) kills the worker: every waiting and running
request gets `EngineError`, new ones `ShuttingDown`, and `on_fatal` tells the server, which answers
503 on /health and exits non-zero for its supervisor to restart it (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from server.request_stream import (
    EngineError,
    NeverFits,
    QueueFull,
    RequestRejected,
    RequestStream,
    ShuttingDown,
)
from server.types import (
    FinishedSequence,
    GenerationRequest,
    RequestOutput,
    RequestStats,
    ServingLimits,
    StepResult,
)

log = logging.getLogger(__name__)


# The worker hands a burst's freed buffers back to the OS (`release_idle_memory`) once it has had
# nothing to run for this long. Not at every request's end: a client sending one request after another
# leaves the batch empty between them, and a trim there costs each request its time and makes the next
# request's steps fault their buffers in again (docs/bench.md, "Figures behind the code").
IDLE_RELEASE_S = 1.0


class SchedulerEngine(Protocol):
    """The part of `server.engine.engine.Engine` the scheduler uses (single-threaded)."""

    def add_requests(self, reqs: list[GenerationRequest]) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> StepResult: ...
    def has_unfinished(self) -> bool: ...
    def kv_cache_usage(self) -> float: ...
    def fits(self, requests: list[GenerationRequest]) -> bool: ...  # room in the KV budget to join now
    def release_idle_memory(self) -> None: ...  # the batch stayed empty: hand freed buffers back to the OS


class SchedulerMetrics(Protocol):
    """The part of `server.metrics.Metrics` the scheduler feeds (called from the worker thread)."""

    def observe_step(self, result: StepResult) -> None: ...
    def observe_first_token(self, ttft_s: float) -> None: ...
    def observe_tokens(self, n_tokens: int, gap_s: float) -> None: ...
    def observe_request(self, done: FinishedSequence) -> None: ...
    def set_load(self, running: int, waiting: int, kv_cache_usage: float) -> None: ...


@dataclass
class _Group:
    """The sequences of one API request, for the figures metrics read per request (not per sequence)."""

    remaining: int  # sequences not finished yet
    most_generated: int = 0  # the most tokens one of its finished sequences generated


@dataclass
class _Seq:
    """One sequence the scheduler tracks, with the timestamps metrics need."""

    request: GenerationRequest
    stream: RequestStream
    index: int  # choice index within its API request
    arrival: float
    order: int  # submission order: first come, first served within one priority
    group: _Group
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    stats: RequestStats | None = None  # from its latest output


def _queue_key(seq: _Seq) -> tuple[int, int]:
    """Where a waiting sequence stands: by priority (lower first), then by submission."""
    return seq.request.priority, seq.order


class Scheduler:
    """Waiting queue, admission into the engine at step boundaries, and the worker thread.

    `metrics` (optional, usually `server.metrics.Metrics`) is fed per step, per token batch and per
    finished sequence from the worker thread.
    """

    def __init__(
        self,
        engine: SchedulerEngine,
        *,
        max_batch_size: int,
        max_waiting: int,
        limits: ServingLimits | None = None,
        metrics: SchedulerMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        idle_release_s: float = IDLE_RELEASE_S,
    ) -> None:
        """`limits`: what the engine can run; requests are checked against them in `submit`.
        `on_fatal(exc)`: called on the event loop once the worker has died (see the module docstring).
        `idle_release_s`: how long the worker waits with nothing to run before the engine releases
        memory (`IDLE_RELEASE_S`)."""
        self._idle_release_s = idle_release_s
        self._engine = engine
        self._limits = limits
        self._max_batch_size = max_batch_size
        self._max_waiting = max_waiting
        self._metrics = metrics
        self._on_fatal = on_fatal
        self.fatal: BaseException | None = None  # what killed the worker, once it has died
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: list[_Seq] = []  # ascending (priority, order): the head is admitted first
        self._order = itertools.count()
        self._running: dict[str, _Seq] = {}
        self._aborts: list[str] = []
        self._accepting = True
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specula-worker", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def capacity(self) -> int:
        """The most sequences one request may hold: every batch slot plus the waiting room."""
        return self._max_batch_size + self._max_waiting

    def check_fits(self, num_sequences: int) -> None:
        """Raise `NeverFits` when a request of `num_sequences` (n x prompts) could not be admitted even by
        an idle server; the one place this limit is checked (`submit` calls it too)."""
        if num_sequences > self.capacity:
            raise NeverFits(
                f"this request holds {num_sequences} sequences (n x prompts) but this server admits at most "
                f"{self.capacity} at once (max_batch_size {self._max_batch_size} + max_waiting "
                f"{self._max_waiting}); send fewer choices or prompts per request"
            )

    def submit(self, requests: Sequence[GenerationRequest]) -> RequestStream:
        """Queue the sequences of one API request (all or none). Raises `RequestRejected` (`NeverFits` when
        it is larger than an idle server admits), `QueueFull`, `ShuttingDown`."""
        self.check_fits(len(requests))
        if self._limits is not None:
            for r in requests:
                try:
                    self._limits.check(r)
                except ValueError as exc:
                    raise RequestRejected(str(exc)) from exc
        stream = RequestStream([r.request_id for r in requests])
        now = time.monotonic()
        with self._lock:
            if self.fatal is not None:
                raise ShuttingDown("the engine failed; the server is restarting")
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            free = max(0, self._max_batch_size - len(self._running))
            if len(self._waiting) + len(requests) > self._max_waiting + free:
                raise QueueFull(
                    f"server busy: {len(self._running)} running and {len(self._waiting)} waiting "
                    f"(max_waiting={self._max_waiting}); retry later"
                )
            group = _Group(remaining=len(requests))
            for i, r in enumerate(requests):
                seq = _Seq(r, stream, i, now, next(self._order), group)
                bisect.insort(self._waiting, seq, key=_queue_key)
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Drop a request whose client went away: waiting sequences at once, running ones next step.

        Safe to call from any thread, and more than once.
        """
        self._drop_sequences(set(stream.request_ids), "abort")

    def finish(self, stream: RequestStream, index: int) -> None:
        """End choice `index` of `stream` before the engine would: the API saw its answer end (a tool-call
        reply that repeats a call it made, server/api/tool_calls.py). It leaves the batch at the next step
        boundary as an aborted sequence does, but is counted as finished ("stop"), and the stream stops
        waiting for it. Call from the event loop."""
        stream.close(index)
        self._drop_sequences({stream.request_ids[index]}, "stop")

    def _drop_sequences(self, ids: set[str], finish_reason: str) -> None:
        """Take the sequences `ids` out of the waiting queue and the batch (the engine drops running ones at
        the next step boundary), counted as finished with `finish_reason`."""
        with self._lock:
            dropped = [s for s in self._waiting if s.request.request_id in ids]
            self._waiting = [s for s in self._waiting if s.request.request_id not in ids]
            for rid in ids:
                seq = self._running.pop(rid, None)
                if seq is not None:
                    self._aborts.append(rid)
                    dropped.append(seq)
        self._wake.set()
        now = time.monotonic()
        for seq in dropped:
            self._observe_finish(seq, seq.stats or RequestStats(seq.request.speculation.method), finish_reason, now)

    def begin_drain(self) -> None:
        """Stop admitting new requests (they get `ShuttingDown`); what was accepted keeps running."""
        with self._lock:
            self._accepting = False

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let accepted work finish for up to `grace_s`, abort the rest, stop the thread."""
        self.begin_drain()
        deadline = time.monotonic() + grace_s
        while (self._waiting or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._lock:
            left = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._aborts.extend(self._running)
            self._running.clear()
            self._stop = True
        for seq in left:
            seq.stream._put(ShuttingDown("the server shut down before this request finished"))
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    # ---- worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the worker is gone: say so
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """The worker cannot go on: fail everything in flight, refuse what comes, tell the server."""
        log.critical("the engine worker died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        with self._lock:
            self.fatal = exc
            self._accepting = False
            lost = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        error = EngineError(f"the engine failed and the server is restarting: {type(exc).__name__}: {exc}"[:500])
        for seq in {id(s.stream): s for s in lost}.values():
            self._send(seq.stream, error)
        if self._on_fatal is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_fatal, exc)
            except RuntimeError:
                pass  # the event loop is closed: the server is going away anyway

    def _loop_forever(self) -> None:
        released = False  # whether the engine released memory since it last ran a step
        while True:
            with self._lock:
                aborts, self._aborts = self._aborts, []
                admitted: list[_Seq] = []
                while self._waiting and len(self._running) < self._max_batch_size:
                    if not self._engine.fits([s.request for s in admitted] + [self._waiting[0].request]):
                        break  # the KV budget is full: it waits (first come, first served)
                    seq = self._waiting.pop(0)
                    self._running[seq.request.request_id] = seq
                    admitted.append(seq)
                stop = self._stop
            for rid in aborts:
                self._call_engine(self._engine.abort_request, rid)
            if stop:
                return
            self._admit(admitted)
            if not self._engine.has_unfinished():
                self._publish_load()
                if not self._wake.wait(None if released else self._idle_release_s):
                    self._engine.release_idle_memory()
                    released = True
                    continue
                self._wake.clear()
                continue
            released = False
            self._deliver(self._engine.step())  # raising here is fatal: the engine isolates row failures

    def _call_engine(self, fn: Callable[[str], None], request_id: str) -> None:
        try:
            fn(request_id)
        except Exception:
            log.exception("engine call %s(%s) failed", getattr(fn, "__name__", fn), request_id)

    def _admit(self, seqs: list[_Seq]) -> None:
        """Join admitted sequences to the engine's batch: together (one prefill), or one by one when
        that fails, so one bad request fails alone."""
        if not seqs:
            return
        now = time.monotonic()
        for seq in seqs:
            seq.scheduled = now
        try:
            self._engine.add_requests([s.request for s in seqs])
            return
        except Exception as exc:
            if len(seqs) == 1:
                self._refuse(seqs[0], exc)
                return
        for seq in seqs:
            try:
                self._engine.add_requests([seq.request])
            except Exception as exc:
                self._refuse(seq, exc)

    def _refuse(self, seq: _Seq, exc: Exception) -> None:
        """The engine would not take `seq`: bad input (ValueError) or a bug."""
        if isinstance(exc, ValueError):
            self._drop(seq, RequestRejected(str(exc)))
            return
        log.error("engine.add_requests failed", exc_info=exc)
        self._drop(seq, EngineError(f"the engine failed to add the request: {exc}"))

    def _drop(self, seq: _Seq, exc: BaseException) -> None:
        """Remove a running sequence and fail its whole API request (its siblings are aborted)."""
        with self._lock:
            self._running.pop(seq.request.request_id, None)
        self._send(seq.stream, exc)
        self.abort(seq.stream)

    def _deliver(self, result: StepResult) -> None:
        now = time.monotonic()
        metrics = self._metrics
        if metrics is not None:
            metrics.observe_step(result)
        dropped = [(rid, EngineError(f"generation failed for this request: {why}"))  # failed alone
                   for rid, why in result.failed.items()]
        dropped += [(rid, RequestRejected(why)) for rid, why in result.rejected.items()]  # their own input
        for rid, exc in dropped:  # these rows left the engine's batch
            with self._lock:
                seq = self._running.get(rid)
            if seq is not None:
                self._drop(seq, exc)
        for out in result.outputs:
            with self._lock:
                seq = self._running.get(out.request_id)
                if seq is not None and out.finished:
                    del self._running[out.request_id]
            if seq is None:
                continue  # aborted: its client is gone
            self._observe_tokens(seq, out, now)
            self._send(seq.stream, (seq.index, out))
        self._publish_load()

    def _observe_tokens(self, seq: _Seq, out: RequestOutput, now: float) -> None:
        n = len(out.token_ids)
        metrics = self._metrics
        if n and metrics is not None:
            if seq.first_token is None:
                metrics.observe_first_token(now - seq.arrival)
            elif seq.last_token is not None:
                metrics.observe_tokens(n, now - seq.last_token)
        if n:
            seq.first_token = seq.first_token or now
            seq.last_token = now
        seq.stats = out.stats
        if out.finished:
            self._observe_finish(seq, out.stats, out.finish_reason or "abort", now)

    def _observe_finish(self, seq: _Seq, stats: RequestStats, finish_reason: str, now: float) -> None:
        if self._metrics is None:
            return
        with self._lock:  # the worker and the event loop (aborts) both finish sequences
            group = seq.group
            group.remaining -= 1
            group.most_generated = max(group.most_generated, stats.completion_tokens)
            most = group.most_generated if group.remaining == 0 else None
        self._metrics.observe_request(FinishedSequence(
            stats, finish_reason, seq.request.sampling.max_tokens, seq.arrival, seq.scheduled, seq.first_token,
            seq.last_token, now, most,
        ))

    def _publish_load(self) -> None:
        if self._metrics is not None:
            try:
                usage = self._engine.kv_cache_usage()
            except Exception:
                usage = 0.0
            self._metrics.set_load(len(self._running), len(self._waiting), usage)

    def _send(self, stream: RequestStream, item: tuple[int, RequestOutput] | BaseException) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(stream._put, item)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more
