"""Static-shape passes (`compile=on`, server/model/static_step.py): the same logits and greedy text as eager passes.

On a CPU the static passes run eagerly on their buckets' buffers (a CUDA graph would replay the same function on
the same buffers), so these tests check what a GPU's replay relies on: rows padded up to their bucket, tokens padded
to the pass's width, the columns a pass writes given as a tensor, a pinned cache whose rows stay where they are, a
bucket run again after a row left or joined, and every method's text kept while the static passes did the work.
"""

from __future__ import annotations

import pytest
import torch

from server.config import Settings
from server.engine.engine import Engine
from server.model.attention import use_gqa_attention
from server.model.kv_cache import BatchKV
from server.model.kv_layers import KVBudgetExceeded
from server.model.runner import ModelRunner
from server.model.static_step import row_buckets, rows_bucket
from tests.engine_helpers import FixedCosts, request, run_with_stats
from tests.models import copying_head, write_tiny_gguf


def test_rows_pad_up_to_powers_of_two_up_to_the_batch_s_most():
    assert row_buckets(8) == (1, 2, 4, 8)
    assert row_buckets(5) == (1, 2, 4, 8)
    assert row_buckets(1) == (1,)
    assert [rows_bucket(n, row_buckets(8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError):
        row_buckets(257)


def _runners(model, fixed: bool = True, columns: int = 96) -> tuple[ModelRunner, ModelRunner]:
    """An eager runner and a static one (pinned columns, 4 rows at most: buckets 1, 2, 4) over the same model;
    `fixed`: its passes at a CUDA graph's fixed shapes (rows and tokens padded, every pinned column attended), else
    at their own (a CPU server's)."""
    use_gqa_attention(model)  # as the engine does: the lean forward's attention
    eager = ModelRunner(model)
    static = ModelRunner(model, kv_slots=4 * columns, kv_columns=columns)
    assert static.use_static(max_rows=4, max_width=5) is not None
    static.static.fixed = fixed
    return eager, static


def _same(a, b) -> None:
    logits_a, hidden_a = a.of_rows(range(len(a.index)))
    logits_b, hidden_b = b.of_rows(range(len(b.index)))
    assert torch.equal(logits_a.argmax(-1), logits_b.argmax(-1))
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=2e-5)
    if hidden_a is not None:
        torch.testing.assert_close(hidden_a, hidden_b, rtol=0, atol=2e-5)


def test_a_static_pass_gives_the_eager_pass_s_logits_through_padding_leaves_joins_and_rollback(tiny_target):
    eager, static = _runners(tiny_target.model)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    for runner in (eager, static):
        runner.join(["a", "b", "c"], prompts)

    def both(feed, **kwargs):
        outs = [runner.forward(feed, hidden=True, **kwargs) for runner in (eager, static)]
        _same(*outs)

    before = static.static.passes
    both([[20], [21], [22]])  # 3 rows: bucket 4, a padded row no request holds
    both([[23, 24, 25], [26], [27, 28, 29, 30, 31]])  # rows feeding 3, 1 and 5 tokens: padded to 5
    assert static.static.passes == before + 2 and any(key[:2] == (4, 5) for key in static.static.buckets)
    for runner in (eager, static):  # drafts rejected: their columns become holes
        runner.rollback(0, 2)
        runner.rollback(2, 3)
    both([[32, 33], [34, 35], [36]], scored=[1, 2, 1])
    for runner in (eager, static):  # the middle row leaves: the rows after it move down in the pinned storage
        runner.leave({"b"})
    both([[37], [38]])  # bucket 2, never run before
    both([[39, 40], [41]])
    for runner in (eager, static):  # a row joins at the end again
        runner.join(["d"], [[42, 43, 44, 45]])
    both([[46], [47], [48]])  # bucket 4 again, over other rows than its first pass's
    assert static.static.passes == before + 6
    assert static.kv.capacity == 96  # pinned: never moved


def test_on_a_cpu_a_static_pass_runs_at_its_own_shape_and_unequal_rows_stay_packed(tiny_target):
    """Not fixed (a CPU server: nothing replays, padding would only cost): 3 rows run as 3, over the columns they reach
    (more as they grow); rows feeding unequal numbers of tokens take the eager, packed pass."""
    eager, static = _runners(tiny_target.model, fixed=False)
    for runner in (eager, static):
        runner.join(["a", "b", "c"], [list(range(100, 158)), [5, 6], [7]])
    spans = set()
    for step in range(4):
        before = static.static.passes
        feed = [[160 + step, 170, 171], [180 + step, 181, 182], [190, 191, 192]]
        _same(eager.forward(feed), static.forward(feed))
        assert static.static.passes == before + 1
        spans.add(static.static.buckets[3, 3].span)  # 3 rows: no padded fourth
        assert static.static.buckets[3, 3].span == static.kv.length  # the columns this pass reached, after it
    assert len(spans) == 4 and (4, 3) not in static.static.buckets
    before = static.static.passes
    feed = [[200], [201, 202, 203], [204]]
    _same(eager.forward(feed), static.forward(feed))
    assert static.static.passes == before


def test_passes_a_static_shape_cannot_take_run_eagerly_over_the_same_cache(tiny_target):
    eager, static = _runners(tiny_target.model, fixed=False)
    for runner in (eager, static):
        runner.join(["a"], [[5, 6, 7]])
    before = static.static.passes
    wide = [list(range(30, 42))]  # 12 tokens: wider than the buckets' 5 (a prompt chunk)
    _same(eager.forward(wide), static.forward(wide))
    assert static.static.passes == before
    _same(eager.forward([[50]]), static.forward([[50]]))  # and a static one after it reads what it wrote
    assert static.static.passes == before + 1


def test_a_pinned_cache_never_moves_its_rows_and_refuses_what_exceeds_them(tiny_target):
    runner = ModelRunner(tiny_target.model, kv_slots=2 * 32, kv_columns=32)
    runner.join(["a", "b"], [[1, 2, 3], [4, 5]])
    stores = [layer.key_store.data_ptr() for layer in runner.kv.cache.layers]
    for _ in range(3):
        runner.forward([[6], [7]])
    runner.leave({"a"})
    runner.join(["c"], [[8, 9, 10, 11]])
    assert runner.kv.capacity == 32 and [layer.key_store.data_ptr() for layer in runner.kv.cache.layers] == stores
    with pytest.raises(KVBudgetExceeded):
        runner.join(["d"], [[1]])  # a third row: over the budget's 2 rows of 32 columns
    with pytest.raises(ValueError):
        BatchKV(2, torch.device("cpu"), slots=None, columns=32)


@pytest.fixture(scope="module")
def cycling(request, tmp_path_factory):
    """The dense cycling target (every proposer's drafts land on it), a copy-heavy prompt and its copying head."""
    target = request.getfixturevalue("cycling_target")
    cycle = target.tokenizer.encode(" Speculative decoding checks several guessed tokens in one pass of the model.")
    head = copying_head(target.model, tmp_path_factory.mktemp("static-head") / "head")
    return target, cycle[:6] + cycle[:3] + cycle[:4], head


@pytest.mark.parametrize("batch", [1, 3])
def test_compile_on_keeps_every_method_s_greedy_text_while_static_passes_run(cycling, batch):
    """Every method drafts and has drafts accepted under compile=on, alone and three at once (bucket 4, padded),
    with `none`'s text under compile=off, and its steps were static passes."""
    from server.model.loading import load_draft_like

    target, prompt, head = cycling
    draft = load_draft_like(target, "target", dtype="float32", cache_dir=None)
    texts = {}
    for mode in ("off", "on"):
        # fixed step costs: `auto` drafts whatever the host's load makes of its timings
        engine = Engine(target, draft, Settings.load(device="cpu", draft_head=str(head), compile=mode,
                                                     max_model_len=256),
                        cost=FixedCosts(draft={"draft": 0.05, "eagle": 0.05}))
        assert (engine.runner.static is not None) == (mode == "on")
        for method in ("none", "ngram", "suffix", "eagle", "draft", "auto"):
            reqs = [request(f"{method}-{i}", prompt, method, 4, max_tokens=20) for i in range(batch)]
            tokens, stats = run_with_stats(engine, reqs)
            for r in reqs:
                texts[mode, r.request_id] = tokens[r.request_id]
                if method != "none":
                    assert stats[r.request_id].draft_tokens > 0 and stats[r.request_id].accepted_tokens > 0, method
        if mode == "on":
            assert engine.runner.static.passes > 0
            assert "+static" in engine.runner.forward_kind
        assert engine.parts.report() == {}
    plain = texts["off", "none-0"]
    assert all(t == plain for t in texts.values())


def test_compile_on_keeps_the_c_decoder_where_it_serves_the_model(tmp_path):
    """A block-quantized model on the C decoder: every pass is one call already, so compile=on changes nothing."""
    from server.model.loading import load_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant="Q8_0", cycle=list(range(40, 60)))
    model = load_model(str(path), device="cpu", weights="as-file", cache_dir=tmp_path / "cache")
    texts = []
    for mode in ("off", "on"):
        engine = Engine(model, None, Settings.load(device="cpu", compile=mode, draft_head="none"))
        if engine.runner.call.decoder is None:
            pytest.skip("the C decoder does not build here")
        assert engine.runner.static is None and engine.runner.kv.columns is None
        texts.append(run_with_stats(engine, [request("r", list(range(40, 50)), "ngram", 4)])[0]["r"])
    assert texts[0] == texts[1]


def test_the_compile_setting_reads_its_environment_variable_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv("SPECULA_COMPILE", "on")
    assert Settings.load().compile == "on"
    monkeypatch.setenv("SPECULA_COMPILE", "sometimes")
    with pytest.raises(ValueError):
        Settings.load()


def test_compile_on_limits_a_row_s_context_to_its_pinned_columns(tiny_target):
    engine = Engine(tiny_target, None, Settings.load(device="cpu", compile="on", max_model_len=128,
                                                     draft_head="none"))
    columns = engine.runner.kv.columns
    assert columns is not None and engine.limits.max_context <= columns - 16
    assert engine.kv_slots == 8 * columns  # the default 8 rows, each with its columns


def test_calibration_times_the_static_passes_the_engine_runs(tiny_engine_factory, tmp_path):
    """Under compile=on the passes calibration prices are the engine's own static ones (on a GPU their replays cost
    what eager passes do not), timed over its empty cache, which it leaves empty."""
    from server.engine import calibration

    engine = tiny_engine_factory(cache_dir=tmp_path, compile="on", max_model_len=128, num_speculative_tokens=2,
                                 auto_max_speculative_tokens=3, max_batch_size=2)
    static = engine.runner.static
    assert static is not None and static.passes == 0
    static.fixed = True  # a GPU's shapes: every pass calibration times is one of them
    result = calibration.calibrate(engine.target, engine.runner, engine.planner.proposers, engine.cost,
                                   engine.settings, 1e9)
    assert result.complete and static.passes >= len(result.verify)
    assert engine.runner.rows == [] and not engine.runner.kv.keep.any()


def test_compile_auto_is_on_where_a_gpu_runs_the_model_only(tiny_target):
    engine = Engine(tiny_target, None, Settings.load(compile="auto", max_model_len=128, draft_head="none"))
    on_gpu = tiny_target.model.device.type == "cuda"
    assert (engine.runner.static is not None) == on_gpu and (engine.runner.kv.columns is not None) == on_gpu
