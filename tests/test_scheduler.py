"""Scheduler logic on a deterministic fake engine: admission at step boundaries, limits, aborts, failures."""

from __future__ import annotations

import asyncio

import pytest

from server.scheduler import EngineError, QueueFull, RequestRejected, Scheduler, ShuttingDown
from server.types import GenerationRequest, SamplingParams, SpeculationParams
from tests.fake_engine import FakeEngine, fake_token


def req(rid: str, max_tokens: int, last: int = 10, prompt_len: int = 3) -> GenerationRequest:
    prompt = tuple([5] * (prompt_len - 1) + [last])
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), SpeculationParams("none"))


async def collect(stream) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for index, out in stream.events():
        tokens.setdefault(index, []).extend(out.token_ids)
    return tokens


@pytest.fixture
async def make_scheduler(tokenizer):
    made: list[Scheduler] = []

    def make(
        max_batch_size: int = 4, max_waiting: int = 8, metrics=None, idle_release_s: float = 1.0, **engine_kw
    ) -> tuple[Scheduler, FakeEngine]:
        engine = FakeEngine(tokenizer, **engine_kw)
        s = Scheduler(engine, max_batch_size=max_batch_size, max_waiting=max_waiting, metrics=metrics,
                      idle_release_s=idle_release_s)
        s.start()
        made.append(s)
        return s, engine

    yield make
    for s in made:
        await s.shutdown(0)


async def test_requests_join_and_leave_at_step_boundaries(make_scheduler):
    sched, engine = make_scheduler(max_batch_size=2, step_s=0.002)
    lengths = {"a": 3, "b": 9, "c": 4}
    streams = {rid: sched.submit([req(rid, n, last=i)]) for i, (rid, n) in enumerate(lengths.items())}
    results = {rid: await collect(s) for rid, s in streams.items()}
    for i, (rid, n) in enumerate(lengths.items()):
        assert results[rid][0] == [fake_token(req(rid, n, last=i), t) for t in range(n)]
    assert max(len(b) for b in engine.batches) == 2
    # c joined while b was mid-generation (continuous batching), right after a left
    first_c = next(i for i, b in enumerate(engine.batches) if "c" in b)
    assert "b" in engine.batches[first_c] and "a" in engine.batches[first_c - 1]
    assert sched.num_running == 0 and sched.num_waiting == 0


async def test_n_sequences_share_one_stream(make_scheduler):
    sched, _ = make_scheduler()
    stream = sched.submit([req("x-0", 2), req("x-1", 5, last=11)])
    tokens = await collect(stream)
    assert {i: len(t) for i, t in tokens.items()} == {0: 2, 1: 5}
    assert stream.finished


async def test_queue_full_beyond_max_waiting(make_scheduler):
    sched, _ = make_scheduler(max_batch_size=1, max_waiting=1, step_s=0.01)
    first = sched.submit([req("a", 50)])
    second = sched.submit([req("b", 2)])
    with pytest.raises(QueueFull):
        sched.submit([req("c", 2)])
    sched.abort(first)
    await collect(second)
    await collect(sched.submit([req("d", 2)]))  # room again


async def test_abort_frees_the_slot_within_a_step(make_scheduler):
    sched, engine = make_scheduler(max_batch_size=1, step_s=0.005)
    long = sched.submit([req("long", 10_000)])
    events = long.events()
    for _ in range(3):
        await anext(events)
    sched.abort(long)
    steps_at_abort = len(engine.batches)
    short = await collect(sched.submit([req("short", 3)]))
    assert len(short[0]) == 3
    assert engine.aborted == ["long"]
    # the aborted request took part in at most the step already running when it was aborted
    assert sum("long" in b for b in engine.batches[steps_at_abort:]) <= 1


async def test_abort_of_waiting_request_never_reaches_the_engine(make_scheduler):
    sched, engine = make_scheduler(max_batch_size=1, step_s=0.005)
    running = sched.submit([req("run", 20)])
    waiting = sched.submit([req("wait", 5)])
    sched.abort(waiting)
    await collect(running)
    assert all("wait" not in b for b in engine.batches)


async def test_engine_refusal_is_delivered_as_request_rejected(make_scheduler):
    sched, _ = make_scheduler(max_context=16)
    with pytest.raises(RequestRejected, match="too long"):
        await collect(sched.submit([req("big", 10, prompt_len=10)]))
    assert len((await collect(sched.submit([req("ok", 2)])))[0]) == 2


async def test_a_sequence_the_engine_fails_alone_fails_its_request_and_no_other(make_scheduler):
    sched, engine = make_scheduler(fail_on=666, step_s=0.002)
    good = sched.submit([req("good", 6)])
    bad = sched.submit([req("bad-0", 4, last=666), req("bad-1", 50)])  # n=2: the sibling goes too
    with pytest.raises(EngineError, match="boom"):
        await collect(bad)
    assert len((await collect(good))[0]) == 6
    assert len((await collect(sched.submit([req("after", 3)])))[0]) == 3
    assert "bad-1" in engine.aborted and sched.fatal is None


async def test_a_step_that_raises_kills_the_worker_and_fails_everything_in_flight(tokenizer):
    died: list[BaseException] = []
    engine = FakeEngine(tokenizer, fatal_on=666, step_s=0.002)
    sched = Scheduler(engine, max_batch_size=1, max_waiting=8, on_fatal=died.append)
    sched.start()
    running = sched.submit([req("running", 1000)])
    await anext(running.events())
    sched.submit([req("fatal", 3, last=666)])  # batch full: both wait
    waiting = sched.submit([req("waiting", 3)])
    sched.abort(running)  # the fatal one joins at the next step boundary and the step raises
    with pytest.raises(EngineError, match="restarting"):
        await collect(waiting)
    await asyncio.sleep(0.05)
    assert [type(e) for e in died] == [RuntimeError] and isinstance(sched.fatal, RuntimeError)
    with pytest.raises(ShuttingDown, match="engine failed"):
        sched.submit([req("late", 2)])
    await sched.shutdown(0)


async def test_shutdown_finishes_work_within_grace_then_refuses(make_scheduler):
    sched, _ = make_scheduler(step_s=0.002)
    stream = sched.submit([req("a", 5)])
    task = asyncio.create_task(collect(stream))
    await sched.shutdown(grace_s=5)
    assert len((await task)[0]) == 5
    with pytest.raises(ShuttingDown):
        sched.submit([req("late", 2)])


async def test_shutdown_aborts_what_outlives_the_grace_period(make_scheduler):
    sched, engine = make_scheduler(step_s=0.005)
    stream = sched.submit([req("forever", 100_000)])
    await anext(stream.events())
    await sched.shutdown(grace_s=0.05)
    with pytest.raises(ShuttingDown):
        await collect(stream)
    assert engine.aborted == ["forever"]


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        def record(*args, **kwargs) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1

        return record


async def test_metrics_are_fed_per_step_and_per_request(make_scheduler):
    metrics = RecordingMetrics()
    sched, engine = make_scheduler(metrics=metrics)
    await collect(sched.submit([req("a", 4), req("b", 2)]))
    assert metrics.calls["observe_step"] == len(engine.batches)
    assert metrics.calls["observe_request"] == 2
    assert metrics.calls["observe_first_token"] == 2
    assert metrics.calls["set_load"] >= 1


async def test_aborted_requests_are_counted_as_abort(make_scheduler):
    finished: list[str] = []

    class Finishes(RecordingMetrics):
        def observe_request(self, done) -> None:
            finished.append(done.finish_reason)

    sched, _ = make_scheduler(max_batch_size=1, metrics=Finishes(), step_s=0.005)
    running = sched.submit([req("run", 10_000)])
    waiting = sched.submit([req("wait", 5)])
    await anext(running.events())
    sched.abort(waiting)
    sched.abort(running)
    assert finished == ["abort", "abort"]
    await collect(sched.submit([req("ok", 2)]))
    assert finished == ["abort", "abort", "length"]


async def test_a_choice_the_api_ends_leaves_the_batch_and_its_siblings_go_on(make_scheduler):
    """`finish` (a tool-call reply that repeats itself): that choice leaves the batch at the next step, its
    later outputs never reach the stream, it is counted as finished ("stop"), and the request's other choice
    runs to its end."""
    finished: list[str] = []

    class Finishes(RecordingMetrics):
        def observe_request(self, done) -> None:
            finished.append(done.finish_reason)

    sched, engine = make_scheduler(metrics=Finishes(), step_s=0.005)
    stream = sched.submit([req("x-0", 10_000), req("x-1", 30, last=11)])
    tokens: dict[int, int] = {0: 0, 1: 0}
    async for index, out in stream.events():
        tokens[index] += len(out.token_ids)
        if index == 0 and tokens[0] >= 3 and 0 in stream._open:
            sched.finish(stream, 0)
            kept = tokens[0]
    assert stream.finished and tokens == {0: kept, 1: 30}
    assert engine.aborted == ["x-0"] and finished == ["stop", "length"]


async def test_memory_is_released_once_the_worker_has_been_idle_not_between_requests(make_scheduler):
    """A client sending one request after another leaves the batch empty between them: the engine hands
    its freed buffers back (malloc_trim) only after the worker found nothing to run for `idle_release_s`,
    once per idle spell, never while rows run."""
    sched, engine = make_scheduler(step_s=0.001, idle_release_s=3600.0)
    for i in range(3):
        await collect(sched.submit([req(f"r{i}", 4)]))
    assert engine.releases == []  # an hour's idle wait has not passed
    sched, engine = make_scheduler(step_s=0.001, idle_release_s=0.01)
    await collect(sched.submit([req("a", 4)]))
    for _ in range(500):
        if engine.releases:
            break
        await asyncio.sleep(0.01)
    assert engine.releases[:1] == [0]  # released with no row running
    await asyncio.sleep(0.1)
    assert len(engine.releases) <= 2  # the start-up release and the one after "a": not once per wait


async def test_waiting_requests_are_admitted_by_priority_then_first_come(make_scheduler):
    """vLLM's `priority`: a lower value is admitted first; equal priorities keep their arrival order; the running
    request is not preempted."""
    sched, engine = make_scheduler(max_batch_size=1, step_s=0.002)

    def prio(rid: str, priority: int, last: int) -> GenerationRequest:
        return GenerationRequest(rid, (5, last), SamplingParams(max_tokens=2), SpeculationParams("none"),
                                 priority=priority)

    running = sched.submit([prio("first", 9, 1)])
    await anext(running.events())  # it runs before the others arrive
    order = [("low", 5), ("mid", 0), ("high", -3), ("mid2", 0)]
    streams = [sched.submit([prio(rid, p, i + 2)]) for i, (rid, p) in enumerate(order)]
    for s in [running, *streams]:
        await collect(s)
    firsts = []
    for batch in engine.batches:
        firsts += [rid for rid in batch if rid not in firsts]
    assert firsts == ["first", "high", "mid", "mid2", "low"]
