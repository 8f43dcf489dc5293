"""One bad row never hurts its neighbours: a step that raises because of one row fails that row alone.

The bad row here is real, not simulated: `top_k = 2**63` overflows when the sampler packs the batch's
parameters (the API refuses it with a 400 since; the engine is called directly, so the edge's check is
bypassed, as a future bug would be). Its neighbours' text must equal a run without it, greedy and
seeded, with the bad row drafting through each kind of proposer (its failure then happens in the
draft model's or head's sampler, or in the target's).
"""

from __future__ import annotations

import pytest
import torch

from server.config import Settings
from server.draft_head.model import EagleHead
from server.engine.engine import Engine
from server.engine.isolation import FAULTY_STEPS, EngineFault
from server.model.runner import ModelRunner
from server.types import GenerationRequest
from tests.engine_helpers import request

GOOD_METHODS = ["none", "ngram", "draft", "eagle", "auto"]
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.9, "top_p": 0.95},
}


@pytest.fixture(scope="module")
def head_dir(tiny_target, tmp_path_factory):
    """An untrained draft head for the tiny target, so `eagle` rows are in the batch too."""
    vocab = tiny_target.model.config.vocab_size
    head = EagleHead.create(tiny_target.model, list(range(0, vocab, 2)), "tiny-target", seed=1)
    path = tmp_path_factory.mktemp("head")
    head.save_pretrained(path, dtype=torch.float32)
    return path


@pytest.fixture
def make_engine(tiny_target, tiny_draft, head_dir):
    return lambda: Engine(tiny_target, tiny_draft, Settings.load(draft_head=str(head_dir)))


def good_requests(prompt_ids: list[list[int]], mode: str) -> list[GenerationRequest]:
    reqs = []
    for i, (p, m) in enumerate(zip(prompt_ids, GOOD_METHODS, strict=True)):
        seed = {"seed": 100 + i} if mode == "seeded" else {}
        reqs.append(request(f"good{i}", p, m, 3, max_tokens=20, **SAMPLING[mode], **seed))
    return reqs


def drive(engine: Engine, first: list[GenerationRequest], later: dict[int, list[GenerationRequest]]):
    """Run to completion, joining `later[step]` before that step; (tokens per request, failures per
    request: (step, why))."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in first}
    failed: dict[str, tuple[int, str]] = {}
    engine.add_requests(first)
    step = 0
    while engine.has_unfinished() or any(s >= step for s in later):
        for r in later.get(step, []):
            tokens[r.request_id] = []
            engine.add_requests([r])
        result = engine.step()
        for out in result.outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        failed.update({rid: (step, why) for rid, why in result.failed.items()})
        step += 1
    return tokens, failed


def assert_no_trace(engine: Engine, rid: str) -> None:
    assert rid not in engine.running and rid not in engine.runner.rows
    for proposer in map(engine.proposer, engine.planner.members):
        runner = getattr(proposer, "runner", None)
        assert runner is None or rid not in runner.rows
        assert rid not in getattr(proposer, "pending", {})


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("bad_method", ["none", "draft", "eagle", "auto"])
def test_a_row_the_sampler_cannot_take_fails_alone(make_engine, prompt_ids, mode, bad_method):
    reference, none_failed = drive(make_engine(), good_requests(prompt_ids, mode), {})
    assert not none_failed

    bad = request("bad", prompt_ids[1], bad_method, 4, max_tokens=20, top_k=2**63, **SAMPLING[mode])
    engine = make_engine()
    got, failed = drive(engine, good_requests(prompt_ids, mode), {3: [bad]})  # joins mid-generation

    assert set(failed) == {"bad"}
    assert failed["bad"][0] == 3 and "Overflow" in failed["bad"][1]
    assert got.pop("bad") == []
    assert got == reference
    assert_no_trace(engine, "bad")


@pytest.mark.slow
def test_a_row_whose_commit_raises_fails_alone_after_its_earlier_tokens(make_engine, prompt_ids):
    reference, _ = drive(make_engine(), good_requests(prompt_ids, "greedy"), {})
    engine = make_engine()
    bad = request("bad", prompt_ids[2], "draft", 3, max_tokens=20)
    engine.add_requests([bad])
    detok = engine.running["bad"].detokenizer
    real_add, seen = detok.add, []

    def add(token: int) -> None:  # this one request's detokenizer breaks at its 5th token
        seen.append(token)
        if len(seen) == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        real_add(token)

    detok.add = add
    got, failed = drive(engine, good_requests(prompt_ids, "greedy"), {})
    assert set(failed) == {"bad"} and "injected" in failed["bad"][1]
    assert 0 < len(got.pop("bad")) < 5  # what it emitted before the failing step reached its client
    assert got == reference
    assert_no_trace(engine, "bad")


def break_target_steps(engine: Engine, monkeypatch) -> None:
    """From now on the target's step forwards raise (prefills of joining rows still work)."""
    real = ModelRunner.forward

    def forward(self, *args, **kwargs):
        if self is engine.runner:
            raise RuntimeError("device lost")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", forward)


def test_a_forward_that_fails_for_every_row_is_an_engine_fault(make_engine, prompt_ids, monkeypatch):
    engine = make_engine()
    engine.add_requests(good_requests(prompt_ids, "greedy")[:2])
    engine.step()

    break_target_steps(engine, monkeypatch)
    with pytest.raises(EngineFault, match="every row"):
        engine.step()


def test_a_lone_row_fails_alone_until_every_step_fails(make_engine, prompt_ids, monkeypatch):
    """One row alone cannot tell a bad request from a broken engine: it fails alone, but FAULTY_STEPS
    steps in a row that fail every row they run are the engine's fault."""
    engine = make_engine()

    break_target_steps(engine, monkeypatch)
    for i in range(FAULTY_STEPS - 1):
        engine.add_requests([request(f"r{i}", prompt_ids[0])])
        assert set(engine.step().failed) == {f"r{i}"}
        assert not engine.has_unfinished()
    engine.add_requests([request("last", prompt_ids[0])])
    with pytest.raises(EngineFault, match="in a row"):
        engine.step()


def test_a_good_step_resets_the_count_of_failing_steps(make_engine, prompt_ids):
    engine = make_engine()
    for i in range(FAULTY_STEPS + 1):
        engine.add_requests([request(f"bad{i}", prompt_ids[0], top_k=2**63)])
        assert set(engine.step().failed) == {f"bad{i}"}
        engine.add_requests([request(f"ok{i}", prompt_ids[0], max_tokens=1)])
        assert not engine.step().failed
