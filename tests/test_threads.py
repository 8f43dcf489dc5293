"""The engine's thread governor: torch's thread count follows measured step times (server/engine/threads.py)."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.threads import DECODE, FIRST_PROBE_S, MAX_PROBE_S, PROMPT, ThreadGovernor
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


def steps_until(gov: ThreadGovernor, clock: Clock, when: float) -> None:
    """Decode steps every 0.1 s of clock time, each as the current count predicts, until `when`."""
    while clock.now + 0.1 < when:
        assert gov.before_step() == gov.current
        gov.observe(0.05, 0.05)
        clock.now += 0.1
    clock.now = when


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


def test_steps_that_crawl_for_seconds_still_probe_and_move_to_one_thread():
    """On a busy host a step at two threads can take seconds: that is no idle spell between steps, and the
    probes still fall due."""
    gov, clock, _ = governor()
    for _ in range(40):
        n = gov.before_step()
        clock.now += {2: 1.7, 1: 0.07}[n]  # the step runs
        gov.observe({2: 1.7, 1: 0.07}[n], 0.05)
    assert gov.current == 1


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


def test_a_probe_before_the_current_count_has_a_score_never_compares_against_nothing():
    """The order that crashed fresh servers on busy hosts: the first step carries a riding prompt tail
    (no prediction), the probe falls due, and the probe's own timing was compared with a score the
    current count never had (KeyError, every later step probed and raised again)."""
    gov, clock, _ = governor()
    gov.before_step()
    gov.observe(2.5, None)  # a slow first step with nothing to compare
    clock.now = 2.5
    assert gov.before_step() == 2  # no probe: the current count has no score yet
    gov.observe(0.05, 0.04)  # scores the current count; never raises
    assert gov.current == 2 and 2 in gov.score and 1 not in gov.score
    steps_until(gov, clock, 2.5 + FIRST_PROBE_S)  # the probe is due a gap after the first score
    assert gov.before_step() == 1
    gov.observe(0.05, 0.04)
    assert set(gov.score) == {1, 2}


def test_a_probe_step_without_a_prediction_ends_the_probe_and_tries_again_later():
    gov, clock, calls = governor()
    gov.before_step()
    gov.observe(0.05, 0.05)
    steps_until(gov, clock, FIRST_PROBE_S)
    assert gov.before_step() == 1 and gov.probing
    gov.observe(0.05, None)  # the probe step also prefilled: nothing learnt
    assert not gov.probing and 1 not in gov.score
    assert gov.before_step() == 2  # back to the current count until the probe falls due again
    gov.observe(0.05, 0.05)
    steps_until(gov, clock, clock.now + FIRST_PROBE_S)
    assert gov.before_step() == 1
    assert calls == [1, 2, 1]


def test_after_an_idle_spell_the_first_step_is_never_the_probe():
    """After an idle spell the probes are long due, and the next step is a new prompt's: it runs at the prompt
    steps' count (a one-thread prefill took ~140 ms more on the built-in model); the decode probe waits for a
    decode step."""
    gov, clock, calls = governor()
    for kind in (PROMPT, DECODE, PROMPT, DECODE):  # both kinds scored
        gov.before_step(kind)
        gov.observe(0.05, 0.05 if kind == DECODE else 100)
        clock.now += 0.05
    clock.now = 30.0  # idle: both probes are long due
    assert gov.before_step(PROMPT) == 2 and not gov.probing
    gov.observe(0.4, 100)  # the prompt's step
    clock.now += 0.4
    assert gov.before_step(DECODE) == 1 and gov.probing  # the first decode step probes
    gov.observe(0.08, 0.05)
    assert not gov.probing and calls == [1]  # only the probe ran at one thread


def test_prompt_steps_between_decode_steps_move_to_one_thread_when_every_thread_crawls():
    """Under a busy core a short prompt's step, between decode steps, crawls at every thread too: the prompt
    steps probe one thread among the decode steps and move there."""
    gov, clock, _ = governor()
    for i in range(400):
        kind = PROMPT if i % 5 == 0 else DECODE
        n = gov.before_step(kind)
        gov.observe({2: 0.4, 1: 0.05}[n] if kind == PROMPT else {2: 0.2, 1: 0.05}[n], 40 if kind == PROMPT else 0.05)
        clock.now += 0.05
    assert gov.tracks[PROMPT].current == 1 and gov.current == 1


def test_prompt_steps_keep_every_thread_while_decode_steps_run_at_one():
    """Decode steps lost to one thread (short parallel regions beside a busy core), but a long prompt's chunks
    are long matrix products that two threads still run faster: each kind runs at its own count. With one
    count for both, a 2,000-token prompt ran all its chunks at one thread (0.43 s each instead of 0.23)."""
    gov, clock, _ = governor()
    run(gov, clock, {2: 9.0, 1: 1.1}, 10)
    assert gov.current == 1
    for _ in range(100):  # a long prompt: steps of 120 budget tokens, twice as fast at two threads
        n = gov.before_step(PROMPT)
        gov.observe({2: 0.23, 1: 0.43}[n], 120)
        clock.now += 0.23
    assert gov.tracks[PROMPT].current == 2 and 1 in gov.tracks[PROMPT].score  # probed one thread, kept two
    assert gov.current == 1  # decode steps stay where they were


def test_prompt_steps_move_to_one_thread_when_it_is_faster_for_them():
    gov, clock, _ = governor()
    run(gov, clock, {2: 0.7, 1: 1.1}, 10)
    for _ in range(50):
        n = gov.before_step(PROMPT)
        gov.observe({2: 0.6, 1: 0.3}[n], 120)
        clock.now += 0.3
    assert gov.tracks[PROMPT].current == 1 and gov.current == 2


def test_the_engine_scores_prompt_steps_apart_by_their_size_in_budget_tokens(tiny_engine_factory):
    """Each step tells the governor its kind (prompt tokens to compute, or not); a prompt step is measured
    by its budget tokens (its computed tokens, prompt tokens weighted by depth: at least its tokens), and a
    prompt's chunks run at the prompt steps' count while decode steps run at theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = tiny_engine_factory(speculation="none", draft=None, max_num_batched_tokens=8, num_speculative_tokens=1,
                                     auto_max_speculative_tokens=1, max_batch_size=2)
        gov = engine.threads
        gov.tracks[DECODE].current = 1  # as after decode steps lost to one thread
        kinds, sizes, ran = [], [], []
        before_step, observe = gov.before_step, gov.observe
        gov.before_step = lambda kind=DECODE: kinds.append(kind) or ran.append(before_step(kind)) or ran[-1]
        gov.observe = lambda seconds, size: sizes.append(size) or observe(seconds, size)
        prompt = tuple(range(5, 45))
        engine.add_requests([GenerationRequest("p", prompt, SamplingParams(max_tokens=3, temperature=0.0),
                                               SpeculationParams("none", 1))])
        prefilling = []
        while engine.has_unfinished():
            prefilling.append(any(s.prompt_left for s in engine.running.values()))
            engine.step()
    finally:
        torch.set_num_threads(before)
    assert prefilling[0] and not prefilling[-1]
    assert kinds == [PROMPT if p else DECODE for p in prefilling]
    assert ran == [2 if p else 1 for p in prefilling]
    prompt_sizes = [s for s, p in zip(sizes, prefilling, strict=True) if p]
    assert all(s >= 8 for s in prompt_sizes[:-1])  # full chunks of the budget, depth-weighted
    assert prompt_sizes[-1] > prompt_sizes[0]  # the deepest chunk weighs more than the first


_timing = st.one_of(
    st.none(), st.just(0.0), st.just(-1.0), st.just(float("inf")), st.just(float("nan")), st.just(1e308),
    st.just(1e-300), st.floats(min_value=1e-9, max_value=1e6),
)


@settings(max_examples=500, deadline=None)
@given(
    threads=st.integers(min_value=1, max_value=4),
    events=st.lists(
        st.tuples(st.sampled_from(["step", "observe", "both"]), st.sampled_from([DECODE, PROMPT]), _timing, _timing,
                  st.floats(min_value=0, max_value=500)),
        max_size=80,
    ),
)
@pytest.mark.slow
def test_any_order_of_timings_and_probes_never_raises(threads, events):
    """Random sequences of steps of either kind, timings (None, zero, negative, infinite, NaN and huge),
    observations with or without a step before them, and clock jumps: the governor never raises, and always
    runs each kind at one of its counts."""
    gov, clock, calls = governor(threads)
    for event, kind, seconds, predicted, dt in events:
        clock.now += dt
        if event in ("step", "both"):
            n = gov.before_step(kind)
            assert n in gov.options
        if event in ("observe", "both"):
            gov.observe(seconds if seconds is not None else 0.0, predicted)
        for track in gov.tracks.values():
            assert track.current in gov.options
            assert all(v == v and 0 < v < float("inf") for v in track.score.values())
    assert all(c in gov.options for c in calls)


@pytest.mark.slow
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


@pytest.mark.slow
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
        cost = engine.cost
        learned: list[float] = []
        observe = cost.observe_verify
        monkeypatch.setattr(cost, "observe_verify",
                            lambda rows, n, s, prior=False: (learned.append(s), observe(rows, n, s, prior)))
        _generate(engine, request)
    finally:
        torch.set_num_threads(before)
    assert probes and engine.threads.current == 2  # probed, and lost every time
    assert learned and max(learned) < 0.3


def _generate(engine, request) -> list[int]:
    engine.add_requests([request])
    ids: list[int] = []
    while engine.has_unfinished():
        if engine.threads is not None:
            engine.threads._clock.now += 0.5
        for out in engine.step().outputs:
            ids.extend(out.token_ids)
    return ids
