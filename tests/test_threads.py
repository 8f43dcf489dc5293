"""The engine's thread governor: torch's thread count follows measured step times (server/engine/threads.py)."""

from __future__ import annotations

import time

import torch

from server.engine.threads import FIRST_PROBE_S, MAX_PROBE_S, ThreadGovernor
from server.model.runner import ModelRunner
from server.types import GenerationRequest, SamplingParams, SpeculationParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def governor(threads: int = 2) -> tuple[ThreadGovernor, Clock, list[int]]:
    clock, calls = Clock(), []
    return ThreadGovernor(threads, set_threads=calls.append, clock=clock), clock, calls


def run(gov: ThreadGovernor, clock: Clock, cost: dict[int, float], seconds: float, step_s: float = 0.05) -> None:
    """Steps for `seconds` of clock time where a pass at n threads costs cost[n] x the prediction."""
    end = clock.now + seconds
    while clock.now < end:
        n = gov.before_step()
        gov.observe(cost[n] * 0.05, 0.05)
        clock.now += step_s


def test_an_idle_machine_keeps_every_thread_and_probes_one_thread_ever_less_often():
    gov, clock, calls = governor()
    probes = []
    end = 300.0
    while clock.now < end:
        n = gov.before_step()
        if n == 1:
            probes.append(clock.now)
        gov.observe({2: 0.7, 1: 1.1}[n] * 0.05, 0.05)
        clock.now += 0.05
    assert gov.current == 2 and gov.switches == 0
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert probes[0] >= FIRST_PROBE_S - 0.05
    assert gaps == sorted(gaps) and gaps[-1] <= MAX_PROBE_S + 0.05  # backing off, bounded
    assert len(probes) <= 8  # a probe step costs a little: few of them
    assert calls and all(c in (1, 2) for c in calls)


def test_contention_moves_the_steps_to_one_thread_and_back_when_it_ends():
    gov, clock, _ = governor()
    run(gov, clock, {2: 0.7, 1: 1.1}, 10)  # idle: two threads, one-thread probed once or twice
    assert gov.current == 2 and 1 in gov.score
    run(gov, clock, {2: 9.0, 1: 1.1}, 1)  # another process takes a core: two spinning threads crawl
    assert gov.current == 1
    run(gov, clock, {2: 9.0, 1: 1.1}, 60)
    assert gov.current == 1  # probes of two threads keep losing
    run(gov, clock, {2: 0.7, 1: 1.1}, MAX_PROBE_S + 1)  # the other process is gone
    assert gov.current == 2


def test_noise_within_the_margin_does_not_switch():
    gov, clock, _ = governor()
    run(gov, clock, {2: 1.0, 1: 0.95}, 60)
    assert gov.current == 2 and gov.switches == 0


def test_one_thread_or_no_prediction_changes_nothing():
    gov, clock, calls = governor(threads=1)
    run(gov, clock, {1: 1.0}, 30)
    assert gov.current == 1 and calls == []
    gov, clock, calls = governor()
    gov.observe(0.05, None)
    assert gov.score == {}


def test_the_engine_runs_its_steps_at_the_thread_count_that_is_faster(tiny_engine_factory, monkeypatch):
    """A target whose forward is slow whenever torch has two threads (as under contention): the engine
    moves its steps to one thread, and the text is the same as with no governor at all."""
    request = GenerationRequest(
        "r", (1, 2, 3, 4), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), SpeculationParams("none", 4)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = tiny_engine_factory(speculation="none", draft=None)
        assert engine.threads is not None and engine.threads.options == (2, 1)
        clock = Clock()
        engine.threads._clock = clock  # probes fall due by this clock, advanced per step below
        forward = ModelRunner.forward

        def slow_at_two_threads(self, *args, **kwargs):
            if torch.get_num_threads() == 2:
                time.sleep(0.05)  # far above the tiny model's whole forward on any machine
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "forward", slow_at_two_threads)
        ids = _generate(engine, request)
        assert engine.threads.current == 1 and engine.threads.switches >= 1
    finally:
        torch.set_num_threads(before)
    plain = tiny_engine_factory(speculation="none", draft=None)
    plain.threads = None
    assert ids == _generate(plain, request)


def test_probe_steps_do_not_teach_the_cost_model(tiny_engine_factory, monkeypatch):
    """A probe runs one step at the other thread count: the governor compares its time, but `auto`'s
    cost model, which predicts the steps run at the current count, never sees it (a probe of a wide
    pass once made every wider pass look as slow as one thread runs it, and `auto` drafted less)."""
    request = GenerationRequest(
        "r", (1, 2, 3, 4), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), SpeculationParams("auto", 4)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    probes = []
    try:
        engine = tiny_engine_factory(speculation="auto")
        assert engine.threads is not None
        engine.threads._clock = Clock()
        forward = ModelRunner.forward

        def slow_at_one_thread(self, *args, **kwargs):
            if torch.get_num_threads() == 1 and self is engine.runner:
                probes.append(1)
                time.sleep(0.3)  # far above any step of the tiny model
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "forward", slow_at_one_thread)
        cost = engine.planner.policy.cost
        learned: list[float] = []
        observe = cost.observe_verify
        monkeypatch.setattr(cost, "observe_verify",
                            lambda n, s, prior=False, rows=None: (learned.append(s), observe(n, s, prior, rows)))
        _generate(engine, request)
    finally:
        torch.set_num_threads(before)
    assert probes and engine.threads.current == 2  # probed, and lost every time
    assert learned and max(learned) < 0.3


def _generate(engine, request) -> list[int]:
    engine.add_request(request)
    ids: list[int] = []
    while engine.has_unfinished():
        if engine.threads is not None:
            engine.threads._clock.now += 0.5
        for out in engine.step().outputs:
            ids.extend(out.token_ids)
    return ids
