"""Start-up calibration of `auto`'s step costs (server/engine/calibration.py): what is timed, that it
reaches the cost model, that it is stored per key and read back without timing, that it leaves the
engine as it found it, and that the setting skips it. No assertion depends on how long anything took."""

from __future__ import annotations

import copy
import json
import statistics

import pytest
import torch

from server.config import Settings
from server.engine import calibration
from server.engine import engine as engine_module
from server.engine.calibration import Subject, batch_shapes, batch_sizes, cache_path, widths
from server.model import cpu_kernels
from server.model.lean_forward import packs_linears
from server.model.runner import ModelRunner
from server.speculation.acceptance import AcceptanceModel
from server.speculation.policy import AutoPolicy, StepCosts
from tests.engine_helpers import request, run

UNBOUNDED = 1e9  # seconds: every point is measured, whatever the machine's speed


def calibrate(engine, budget_s: float = UNBOUNDED) -> calibration.Calibration:
    """Calibrate the engine's cost model as `build_engine` does."""
    return calibration.calibrate(engine.target, engine.runner, engine.planner.proposers, engine.cost,
                                 engine.settings, budget_s)


def calibration_key(engine) -> dict[str, object]:
    return Subject(engine.target, engine.runner, engine.planner.proposers, engine.settings).key()


def test_widths_and_batch_sizes_cover_what_auto_may_choose():
    assert widths(8) == [1, 2, 4, 8, 9] and widths(1) == [1, 2]
    assert batch_sizes(8) == [1, 2, 4, 8] and batch_sizes(6) == [1, 2, 4, 6] and batch_sizes(1) == [1]
    assert batch_shapes(4, 16) == [[1] * 4, [2, 1, 1, 1], [2] * 4, [3] * 4, [17] * 4]
    assert batch_shapes(2, 1) == [[1, 1], [2, 1], [2, 2], [3, 3]]  # nothing timed twice


def test_calibration_times_every_width_and_batch_and_feeds_the_cost_model(tiny_engine_factory, tmp_path):
    # fixed methods draft K = 2; `auto` may verify up to 3 drafts: the widths go to the wider, 3 + 1
    engine = tiny_engine_factory(
        cache_dir=tmp_path, num_speculative_tokens=2, auto_max_speculative_tokens=3, max_batch_size=2
    )
    cost = engine.cost
    assert not cost.timed and cost.draft_time("draft") is None
    result = calibrate(engine, budget_s=UNBOUNDED)
    # one row at widths 1, 2, K+1; two rows plain (2 tokens), one of them drafting one (3), both drafting
    # one (4) and two (6), both at K+1 (8)
    # (each timed between two plain passes of its batch: one more plain pass than others per repeat)
    expected = ([(1, 1)] * 3 + [(1, 2), (1, 4)] + [(2, 2)] * 5 + [(2, 3), (2, 4), (2, 6), (2, 8)]) * calibration.REPEATS
    assert sorted((rows, n) for rows, n, _ in result.verify) == sorted(expected) and result.complete
    # two timed drafts of K at batch 1, two at batch 2
    assert [(r, k) for r, k, _ in result.draft["draft"]] == [(1, 2), (1, 2), (2, 2), (2, 2)]
    assert set(result.draft) == {n for n, p in engine.planner.proposers.items() if p.traits.draft_token_cost is None}
    assert cost.timed and cost.draft_time("draft") is not None

    assert not result.loaded
    stored = json.loads(cache_path(tmp_path, result.key).read_text())
    assert stored["key"] == calibration_key(engine) and len(stored["verify"]) == len(expected)


def test_passes_are_timed_against_the_plain_passes_around_them():
    """A machine slowing down by 10% a pass (or speeding up), with one pass in a burst three times slower:
    every width still comes out at its own cost relative to the plain pass."""
    cost = {1: 1.0, 2: 1.3, 4: 1.6, 17: 4.0}  # a pass's time at a steady speed, per tokens fed
    for drift in (1.1, 0.9):
        calls: list[list[int]] = []

        def timer(shape: list[int], drift: float = drift, calls: list[list[int]] = calls) -> float:
            calls.append(shape)  # a pass's place in the sequence: 7 passes a repeat (plain, 2, plain, 4, ...)
            burst = 3.0 if len(calls) == 11 else 1.0  # the second repeat's 4-token pass
            return cost[sum(shape)] * drift ** len(calls) * burst

        shapes = [[1], [2], [4], [17]]
        timed = calibration.sandwiched(timer, shapes, repeats=3)
        plain = statistics.median(t for shape, t in timed if shape == [1])
        for shape in shapes[1:]:
            got = [t for s, t in timed if s == shape]
            assert len(got) == 3
            assert statistics.median(got) / plain == pytest.approx(cost[sum(shape)], rel=0.01)
        assert [shape for shape, _ in timed].count([1]) == 3 * len(shapes)  # a plain pass before and after each


def test_the_cost_model_reads_each_batch_sizes_own_timings(tiny_engine_factory, tmp_path):
    """Three tokens as one row drafting two and as two rows, one drafting one, cost differently; fed
    to the cost model, each batch size's question gets its own answer."""
    engine = tiny_engine_factory(cache_dir=tmp_path)
    timed = [(1, 1, 0.10), (1, 3, 0.12), (1, 9, 0.20), (2, 2, 0.15), (2, 3, 0.24), (2, 18, 0.40)]
    calibration.Calibration({}, timed).feed(engine.cost)
    cost = engine.cost
    assert cost.verify_time(1, 3) == pytest.approx(0.12)
    assert cost.verify_time(2, 3) == pytest.approx(0.24)
    # one draft token in a 2-row packed pass: 0.09 s more than the plain pass, 60% of it
    step = StepCosts(AutoPolicy({}, cost, AcceptanceModel(), packed=True), 2)
    assert step.token_cost(1) == pytest.approx(2 * 0.09 / 0.15)


def test_a_restart_reads_the_stored_timings_without_running_the_model(tiny_engine_factory, tmp_path, monkeypatch):
    first = calibrate(tiny_engine_factory(cache_dir=tmp_path, max_batch_size=2), budget_s=UNBOUNDED)
    engine = tiny_engine_factory(cache_dir=tmp_path, max_batch_size=2)  # (its draft runs once: draft_model.check_runs)

    def no_forward(*args, **kwargs):
        raise AssertionError("a stored calibration must not run the model")

    monkeypatch.setattr(ModelRunner, "forward", no_forward)
    again = calibrate(engine, budget_s=UNBOUNDED)
    assert again.loaded and again.verify == first.verify and again.draft == first.draft
    assert engine.cost.timed


@pytest.mark.slow
def test_a_calibration_cut_short_by_its_budget_is_measured_again(tiny_engine_factory, tmp_path):
    engine = tiny_engine_factory(cache_dir=tmp_path, max_batch_size=2)
    path = cache_path(tmp_path, calibrate(engine, budget_s=UNBOUNDED).key)
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "complete": False}))  # as a busy machine would leave it
    again = calibrate(engine, budget_s=UNBOUNDED)
    assert not again.loaded and again.complete and json.loads(path.read_text())["complete"] is True


@pytest.mark.slow
def test_another_key_or_a_broken_file_is_measured_again(tiny_engine_factory, tmp_path):
    a = tiny_engine_factory(cache_dir=tmp_path, max_batch_size=2)
    b = tiny_engine_factory(cache_dir=tmp_path, max_batch_size=3)
    assert cache_path(tmp_path, calibration_key(a)) != cache_path(tmp_path, calibration_key(b))
    path = cache_path(tmp_path, calibrate(a, budget_s=UNBOUNDED).key)
    path.write_text("{not json")
    assert not calibrate(a, budget_s=UNBOUNDED).loaded
    assert calibrate(a, budget_s=UNBOUNDED).loaded  # the re-measured file replaced the broken one


def test_a_rebuilt_kernel_library_is_timed_again(tiny_engine_factory, tmp_path, monkeypatch):
    """Costs timed on one build of the CPU kernels are not planned with after they change (a new version's
    faster wide passes would otherwise be priced at the old ones' cost)."""
    engine = tiny_engine_factory(cache_dir=tmp_path, max_batch_size=2)
    monkeypatch.setattr(cpu_kernels, "build_id", lambda: "kernels-avx2-0000000000000000")
    assert calibration_key(engine)["kernels"] == cpu_kernels.build_id() == "kernels-avx2-0000000000000000"
    old = calibrate(engine, budget_s=UNBOUNDED)
    assert calibrate(engine, budget_s=UNBOUNDED).loaded
    monkeypatch.setattr(cpu_kernels, "build_id", lambda: "kernels-avx2-1111111111111111")
    assert cache_path(tmp_path, calibration_key(engine)) != cache_path(tmp_path, old.key)
    assert not calibrate(engine, budget_s=UNBOUNDED).loaded


@pytest.mark.slow
def test_calibration_leaves_the_engine_as_it_found_it(tiny_engine_factory, tmp_path, prompt_ids, greedy_reference):
    engine = tiny_engine_factory(cache_dir=tmp_path, max_batch_size=2)
    calibrate(engine, budget_s=UNBOUNDED)
    assert engine.runner.rows == [] and not engine.running
    draft = engine.proposer("draft")
    assert draft.runner.rows == [] and not draft.pending
    methods = ["draft", "auto", "ngram", "none", "auto"]
    reqs = [request(f"r{i}", p, m, 4) for i, (p, m) in enumerate(zip(prompt_ids, methods, strict=True))]
    assert run(engine, reqs) == greedy_reference


def test_a_zero_budget_measures_and_stores_nothing(tiny_engine_factory, tmp_path):
    engine = tiny_engine_factory(cache_dir=tmp_path)
    result = calibrate(engine, budget_s=0.0)
    assert result.verify == [] and result.draft == {}
    assert not cache_path(tmp_path, result.key).exists() and not engine.cost.timed


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False])
def test_build_engine_calibrates_unless_the_setting_is_off(tiny_target, tiny_draft, tmp_path, monkeypatch, enabled):
    # copies: the engine build_engine makes owns its models (it drops their dense weights, see below)
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: copy.deepcopy(tiny_target))
    monkeypatch.setattr(engine_module, "load_draft_like", lambda *a, **k: copy.deepcopy(tiny_draft))
    calls = []
    monkeypatch.setattr(engine_module, "calibrate", lambda target, runner, proposers, cost, settings:
                        calls.append((runner, cost)))
    built = engine_module.build_engine(Settings.load(cache_dir=tmp_path, calibrate=enabled))
    assert calls == ([(built.runner, built.cost)] if enabled else [])


@pytest.mark.slow
@pytest.mark.skipif(not packs_linears(torch.nn.Linear(2, 2)), reason="no oneDNN: nothing is packed")
def test_build_engine_drops_the_dense_weights_unless_asked_to_keep_them(tiny_target, tiny_draft, monkeypatch,
                                                                        prompt_ids):
    """The server's engine runs its target and draft only through packed kernels (CPU): their dense copies
    are dropped after calibration, and the engine still decodes the same text. `keep_dense` keeps them
    for a caller that runs transformers' forward on the same model (bench.overhead's peer)."""
    def built(**kwargs):
        monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: copy.deepcopy(tiny_target))
        monkeypatch.setattr(engine_module, "load_draft_like", lambda *a, **k: copy.deepcopy(tiny_draft))
        return engine_module.build_engine(Settings.load(calibrate=False, draft="target"), **kwargs)

    def dense(model) -> int:
        mlps = [layer.mlp for layer in model.model.layers]
        return sum(p.weight.numel() for mlp in mlps for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))

    kept, dropped = built(keep_dense=True), built()
    assert dense(kept.target.model) > 0 and dense(kept.proposer("draft").draft.model) > 0
    assert dense(dropped.target.model) == 0 and dense(dropped.proposer("draft").draft.model) == 0
    requests = [request(f"r{i}", p, "draft", 4) for i, p in enumerate(prompt_ids)]
    assert run(dropped, requests) == run(kept, requests)


@pytest.mark.slow
def test_a_proposer_reading_hidden_states_is_timed_and_left_clean(tiny_target, tiny_draft, tmp_path, prompt_ids,
                                                                  greedy_reference):

    from server.draft_head.model import EagleHead
    from server.engine.engine import Engine

    vocab = tiny_target.model.config.vocab_size
    head = EagleHead.create(tiny_target.model, list(range(0, vocab, 2)), "tiny-target", seed=0)
    head.save_pretrained(tmp_path / "head", dtype=torch.float32)
    settings = Settings.load(draft_head=str(tmp_path / "head"), cache_dir=tmp_path, max_batch_size=2)
    engine = Engine(tiny_target, tiny_draft, settings)
    result = calibrate(engine, budget_s=UNBOUNDED)
    assert set(result.draft) == {"draft", "eagle"} and len(result.draft["eagle"]) == 4
    eagle = engine.proposer("eagle")
    assert eagle.runner.rows == [] and not eagle.pending
    reqs = [request(f"r{i}", p, "eagle", 4) for i, p in enumerate(prompt_ids)]
    assert run(engine, reqs) == greedy_reference
