"""The engine's optional parts fail safe (server/failsafe.py): injected faults cost speed, never answers.

Each optional part in turn raises at random calls while a batch of greedy, seeded and constrained
requests runs on the tiny models (every method, a second wave joining mid-run with the same prompts so
the prefix cache is read): every request completes with the text of a clean run, nothing fails, and the
part's failures are counted (and reported with the step, for the metrics). A part that keeps failing is
switched off. And the engine still dies cleanly when the target's own forward cannot run.
"""

from __future__ import annotations

import random

import pytest
import torch

from server.config import Settings
from server.draft_head.model import EagleHead
from server.engine import engine as engine_module
from server.engine.engine import Engine
from server.engine.isolation import EngineFault
from server.engine.threads import ThreadGovernor
from server.failsafe import SWITCH_OFF_AFTER, OptionalParts
from server.grammar import GrammarState
from server.model.prefix_cache import PrefixCache
from server.model.runner import ModelRunner
from server.speculation.acceptance import AcceptanceModel
from server.speculation.cost import CostModel
from server.speculation.draft_model import DraftModelProposer
from server.speculation.eagle import EagleProposer
from server.speculation.ngram import NgramProposer
from server.speculation.planner import Planner
from server.speculation.policy import AutoPolicy
from server.speculation.suffix import SuffixProposer
from server.types import Fallback, GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_helpers import request
from tests.test_constrained import SCHEMA, json_grammar

# part -> the methods that raise when it is injected (a class and a method name)
TARGETS: dict[str, list[tuple[type, str]]] = {
    "threads": [(ThreadGovernor, "before_step"), (ThreadGovernor, "observe")],
    "cost_model": [(CostModel, "verify_time"), (CostModel, "observe_verify"), (CostModel, "observe_draft")],
    "acceptance": [(AcceptanceModel, "observe"), (AcceptanceModel, "forget")],
    "planner": [(AutoPolicy, "choose"), (AutoPolicy, "due"), (AutoPolicy, "allot")],
    "proposer:ngram": [(NgramProposer, "propose"), (NgramProposer, "commit")],
    "proposer:suffix": [(SuffixProposer, "propose"), (SuffixProposer, "commit"), (SuffixProposer, "leave")],
    "proposer:draft": [(DraftModelProposer, "propose"), (DraftModelProposer, "commit"), (DraftModelProposer, "join")],
    "proposer:eagle": [(EagleProposer, "propose"), (EagleProposer, "commit"), (EagleProposer, "join")],
    "prefix_cache": [(PrefixCache, "match"), (PrefixCache, "store")],
    "grammar": [(Planner, "_constrain"), (GrammarState, "forced")],  # the fast path (masks are not optional)
}


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def head_dir(tiny_target, tmp_path_factory):
    """An untrained draft head for the tiny target, so `eagle` rows run too."""
    vocab = tiny_target.model.config.vocab_size
    head = EagleHead.create(tiny_target.model, list(range(0, vocab, 2)), "tiny-target", seed=1)
    path = tmp_path_factory.mktemp("head")
    head.save_pretrained(path, dtype=torch.float32)
    return path


@pytest.fixture
def two_threads():
    """torch at two threads, so the engine has a thread governor (CPU with more than one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_engine(tiny_target, tiny_draft, head_dir, two_threads):
    return lambda: Engine(tiny_target, tiny_draft, Settings.load(draft_head=str(head_dir)))


def inject(monkeypatch, part: str, rate: float, seed: int = 0) -> list[str]:
    """Make `part`'s methods raise at random calls (probability `rate`); returns the log of raises."""
    rng, raised = random.Random(seed), []
    for cls, name in TARGETS[part]:
        real = getattr(cls, name)

        def faulty(*args, __real=real, __name=name, **kwargs):
            if rng.random() < rate:
                raised.append(__name)
                raise Injected(f"injected into {part}.{__name}")
            return __real(*args, **kwargs)

        monkeypatch.setattr(cls, name, faulty)
    return raised


def workload(prompt_ids: list[list[int]], wave: str) -> list[GenerationRequest]:
    """Greedy rows of every method, seeded sampled rows, and constrained rows (greedy and seeded). The
    seeded rows use the methods whose text does not depend on what is drafted (one-hot drafts, or the
    model's drafts drawn with the sampler's uniforms under `auto`); a seeded row drafting from a model's
    q with `eagle` or `draft` is as likely, not the same text, when a step drafts differently."""
    reqs = [request(f"{wave}-greedy-{m}", prompt_ids[i % len(prompt_ids)], m, 4, max_tokens=24)
            for i, m in enumerate(["none", "ngram", "suffix", "draft", "eagle", "auto"])]
    reqs += [request(f"{wave}-seeded-{m}", prompt_ids[(i + 1) % len(prompt_ids)], m, 4, max_tokens=24,
                     temperature=0.9, top_p=0.95, seed=7 + i) for i, m in enumerate(["auto", "ngram", "suffix"])]
    grammar = json_grammar(SCHEMA)
    for i, m in enumerate(["auto", "suffix"]):
        sampling = SamplingParams(max_tokens=64, temperature=0.0 if i == 0 else 0.8, seed=3 if i else None)
        reqs.append(GenerationRequest(f"{wave}-json-{m}", tuple(prompt_ids[i]), sampling, SpeculationParams(m, 4),
                                      grammar))
    return reqs


def drive(engine: Engine, prompt_ids: list[list[int]], finals: dict | None = None
          ) -> tuple[dict[str, list[int]], list[str]]:
    """Run the first wave, join the second (the same prompts) at step 3; (tokens per request, the
    parts the steps reported as degraded). No request may fail. `finals`, when given, gets each request's
    final `RequestStats`, and "fallbacks" the (method, `Fallback`) pairs the steps reported."""
    first, second = workload(prompt_ids, "a"), workload(prompt_ids, "b")
    tokens: dict[str, list[int]] = {r.request_id: [] for r in first + second}
    finished: set[str] = set()
    degraded: list[str] = []
    reported: list = []
    engine.add_requests(first)
    step = 0
    while engine.has_unfinished() or step <= 3:
        if step == 3:
            engine.add_requests(second)
        result = engine.step()
        assert not result.failed and not result.rejected, (result.failed, result.rejected)
        degraded += result.degraded
        reported += result.fallbacks
        for out in result.outputs:
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finished.add(out.request_id)
                if finals is not None:
                    finals[out.request_id] = out.stats
        step += 1
    assert finished == set(tokens), "every request completes"
    if finals is not None:
        finals["fallbacks"] = reported
    return tokens, degraded


@pytest.fixture(scope="module")
def clean_run(tiny_target, tiny_draft, head_dir, prompt_ids):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(tiny_target, tiny_draft, Settings.load(draft_head=str(head_dir)))
        tokens, degraded = drive(engine, prompt_ids)
    finally:
        torch.set_num_threads(before)
    assert not degraded and engine.parts.report() == {}
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("part", list(TARGETS))
def test_an_optional_part_that_raises_at_random_costs_no_answer(make_engine, prompt_ids, clean_run, monkeypatch, part):
    engine = make_engine()
    assert engine.threads is not None or part != "threads"
    raised = inject(monkeypatch, part, rate=0.2, seed=sum(map(ord, part)))
    tokens, degraded = drive(engine, prompt_ids)
    assert raised, f"the injected faults in {part} were reached"
    assert tokens == clean_run  # greedy, seeded and constrained texts exactly those of the clean run
    assert engine.parts.failures.get(part, 0) >= 1
    assert set(degraded) == set(engine.parts.failures) and len(degraded) == sum(engine.parts.failures.values())
    for proposer in map(engine.proposer, engine.planner.members):  # nothing left behind in any proposer
        runner = getattr(proposer, "runner", None)
        assert runner is None or not runner.rows


@pytest.mark.slow
@pytest.mark.parametrize("part", ["planner", "prefix_cache", "cost_model", "threads"])
def test_a_part_that_always_raises_is_switched_off_and_answers_stay_the_same(
    make_engine, prompt_ids, clean_run, monkeypatch, part
):
    engine = make_engine()
    inject(monkeypatch, part, rate=1.0)
    tokens, _ = drive(engine, prompt_ids)
    assert tokens == clean_run
    assert engine.parts.failures[part] == SWITCH_OFF_AFTER and not engine.parts.on(part)
    assert engine.parts.report()[part] == {"failures": SWITCH_OFF_AFTER, "off": True, "error": "Injected"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "eagle", "draft"])
def test_a_proposer_that_always_raises_loses_its_rows_and_answers_stay_the_same(
    make_engine, prompt_ids, clean_run, monkeypatch, name
):
    engine = make_engine()
    inject(monkeypatch, f"proposer:{name}", rate=1.0)
    finals: dict = {}
    tokens, _ = drive(engine, prompt_ids, finals)
    assert tokens == clean_run
    assert engine.parts.failures[f"proposer:{name}"] >= 1 and not engine.planner.members[name]
    # every request that asked for it (or `auto`, which uses it) is told it went without it, and why
    reported = finals.pop("fallbacks")
    for rid, stats in finals.items():
        lost = [f for f in stats.fallbacks if f.proposer == name]
        if stats.method in (name, "auto"):
            assert len(lost) == 1 and lost[0].reason in ("error", "switched_off") and lost[0].error == "Injected", rid
        else:
            assert not lost, rid
    assert sorted(reported, key=str) == sorted(((s.method, f) for s in finals.values() for f in s.fallbacks), key=str)


def test_a_failing_proposer_is_dropped_for_its_rows_only(make_engine, prompt_ids, monkeypatch):
    """n-gram lookups raise for one request: that row leaves the proposer and decodes plain, the others
    keep drafting with it."""
    engine = make_engine()
    propose = NgramProposer.propose

    def picky(self, seqs, ks):  # noqa: ANN001
        if any(s.request_id == "bad" and k for s, k in zip(seqs, ks, strict=True)):
            raise Injected("this row breaks the lookup")
        return propose(self, seqs, ks)

    monkeypatch.setattr(NgramProposer, "propose", picky)
    cycle = prompt_ids[1] * 3  # repetitive: n-gram drafts exist
    engine.add_requests([request("bad", cycle, "ngram", 4, max_tokens=30),
                         request("good", cycle, "ngram", 4, max_tokens=30)])
    stats = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            stats[out.request_id] = out.stats
    assert engine.parts.failures == {"proposer:ngram": 1}
    assert stats["bad"].draft_tokens == 0 and stats["good"].draft_tokens > 0
    assert stats["bad"].fallbacks == [Fallback("ngram", "error", "Injected")] and stats["good"].fallbacks == []


@pytest.mark.slow
def test_a_calibration_that_raises_leaves_a_serving_engine(tiny_target, monkeypatch, tmp_path):
    """build_engine goes on without calibration (auto learns step costs from traffic)."""

    def broken(engine, *args, **kwargs):  # noqa: ANN001
        raise Injected("calibration cannot time passes here")

    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: tiny_target)
    monkeypatch.setattr(engine_module, "calibrate", broken)
    engine = engine_module.build_engine(Settings.load(calibrate=True, cache_dir=str(tmp_path)), keep_dense=True)
    assert engine.parts.report() == {"calibration": {"failures": 1, "off": False, "error": "Injected"}}
    engine.add_requests([request("r", [1, 2, 3, 4], "auto", 4, max_tokens=8)])
    result = engine.step()
    assert result.degraded == ["calibration"]  # reported with the first step, for the metrics
    while engine.has_unfinished():
        assert not engine.step().failed


def test_the_engine_still_dies_when_the_target_forward_cannot_run(make_engine, prompt_ids, monkeypatch):
    engine = make_engine()
    engine.add_requests(workload(prompt_ids, "a")[:3])
    engine.step()
    real = ModelRunner.forward

    def forward(self, *args, **kwargs):
        if self is engine.runner:
            raise RuntimeError("device lost")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    with pytest.raises(EngineFault):
        engine.step()
    assert engine.parts.report() == {}  # the target is not optional: nothing was blamed on a part


def test_optional_parts_count_log_once_and_switch_off(caplog):
    parts = OptionalParts(switch_off_after=3)
    for _ in range(4):
        assert parts.call("planner", lambda: 1 / 0, default="plain") == "plain"
    assert parts.failures == {"planner": 3}  # the fourth call never ran: the part was off
    assert not parts.on("planner") and parts.on("threads")
    assert parts.take_new() == ["planner"] * 3 and parts.take_new() == []
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1  # the traceback once; the switch-off said once
    assert sum("switched off" in r.getMessage() for r in caplog.records) == 1


def test_a_request_asking_for_a_switched_off_proposer_is_told_at_once(make_engine, prompt_ids):
    """A proposer switched off before a request comes: the request decodes plain and its stats say so from its
    first output, with the part's last error (an `auto` request names it too: it goes without it)."""
    engine = make_engine()
    for _ in range(SWITCH_OFF_AFTER):
        engine.parts.failed("proposer:draft", Injected("it broke earlier"))
    engine.add_requests([request("fixed", prompt_ids[1], "draft", 4, max_tokens=6),
                         request("auto", prompt_ids[1], "auto", 4, max_tokens=6),
                         request("other", prompt_ids[1], "ngram", 4, max_tokens=6)])
    first = {o.request_id: o.stats for o in engine.step().outputs}
    assert first["fixed"].fallbacks == first["auto"].fallbacks == [Fallback("draft", "switched_off", "Injected")]
    assert first["other"].fallbacks == [] and first["fixed"].draft_tokens == 0
