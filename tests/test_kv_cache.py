"""ModelRunner over BatchKV: ragged batched forwards, rollback and join/leave give the logits (and hidden
states) of a clean forward."""

from __future__ import annotations

import pytest
import torch

from server.model.runner import ModelRunner


def clean_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of the last position of a fresh, single-row, cache-free forward."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -1].float()


def test_ragged_steps_with_rollback_match_clean_forward(tiny_target):
    model = tiny_target.model
    prompts = [[5, 17, 99, 4, 8], [7], [300, 301, 302, 303, 304, 305, 306, 307, 308], [11, 12]]
    target = ModelRunner(model)
    target.join(["a", "b", "c", "d"], [p[:-1] for p in prompts])  # row b prefills nothing
    # Row "b" had a one-token prompt: nothing prefilled. Feed the last prompt token plus "drafts".
    history = [list(p[:-1]) for p in prompts]
    pending = [p[-1] for p in prompts]
    gen = torch.Generator().manual_seed(0)
    for _step in range(6):
        drafts = [torch.randint(3, 1000, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in prompts]
        fed = [[pending[b]] + drafts[b] for b in range(len(prompts))]
        logits = target.forward(fed).logits
        for b in range(len(prompts)):
            accepted = int(torch.randint(0, len(drafts[b]) + 1, (1,), generator=gen))
            # The logits after each fed token equal a clean forward over the history so far.
            expect = clean_logits(model, history[b] + fed[b][: accepted + 1])
            torch.testing.assert_close(logits[b, accepted], expect, atol=1e-4, rtol=1e-4)
            target.rollback(b, len(drafts[b]) - accepted)
            history[b] += fed[b][: accepted + 1]
            pending[b] = 1000 + b + _step
        target.kv.maybe_compact()
    assert target.kv.positions == [len(h) for h in history]


def test_join_leave_and_compact_keep_rows_exact(tiny_target):
    model = tiny_target.model
    target = ModelRunner(model)
    target.join(["x", "y"], [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10]])
    target.forward([[11, 12, 13], [14]])
    target.rollback(0, 2)  # x keeps 11; y keeps 14
    target.join(["z"], [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]])
    target.leave({"y"})
    assert target.rows == ["x", "z"]
    target.kv.compact()
    logits = target.forward([[40], [41, 42]]).logits
    expect_x = clean_logits(model, [1, 2, 3, 4, 5, 6, 7, 8, 11, 40])
    torch.testing.assert_close(logits[0, 0], expect_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        logits[1, 1], clean_logits(model, list(range(20, 33)) + [41, 42]), atol=1e-4, rtol=1e-4
    )


def test_steps_write_in_place_without_copying_the_cache(tiny_target):
    """A step writes only its new columns: the buffers are not reallocated (no per-step full copy)."""
    target = ModelRunner(tiny_target.model)
    target.join(["a", "b"], [list(range(10, 40)), list(range(50, 60))])
    target.kv._resize(256)  # room for the steps below, so growth (amortised doubling) doesn't kick in
    buffers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in target.kv.cache.layers]
    for step in range(10):
        target.forward([[100 + step, 7, 8, 9], [200 + step]])
        target.rollback(0, 2)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in target.kv.cache.layers] == buffers


def test_rows_joining_one_at_a_time_regrow_the_cache_a_logarithmic_number_of_times(tiny_target):
    """Without a budget the cache grows as rows join; a server joins requests one at a time, and a new
    buffer copies every row already there, so buffers grow at least twofold (32 joins: a few copies, not
    32), and the rows stay exact."""
    target = ModelRunner(tiny_target.model)
    layer = target.kv.cache.layers[0]
    buffers, last = 0, None
    for i in range(32):
        target.join([f"r{i}"], [[3 + i, 5, 7, 11]])
        buffers += layer.key_store.data_ptr() != last  # the old buffer is alive while copied: a new one differs
        last = layer.key_store.data_ptr()
    assert buffers <= 7  # 1, 2, 4, ... 32 rows' worth
    logits = target.forward([[13]] * 32).logits
    torch.testing.assert_close(logits[31, 0], clean_logits(tiny_target.model, [34, 5, 7, 11, 13]), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_equals_one_forward(tiny_target):
    model = tiny_target.model
    prompts = [list(range(100, 140)), list(range(300, 307)), []]
    target = ModelRunner(model)
    target.join(["a", "b", "c"], prompts, chunk=16)
    logits = target.forward([[5], [6], [7]]).logits
    for b, (p, last) in enumerate(zip(prompts, [5, 6, 7], strict=True)):
        torch.testing.assert_close(logits[b, 0], clean_logits(model, p + [last]), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_holes_from_rollbacks_stay_bounded(tiny_target):
    """Every step rolls back most of what it fed (as a draft cache does): compaction keeps the
    column space within about twice the live tokens instead of growing with the steps."""
    target = ModelRunner(tiny_target.model)
    target.join(["a"], [list(range(10, 20))])
    for step in range(200):
        target.forward([[100 + step % 50, 1, 2, 3, 4, 5, 6, 7]])
        target.rollback(0, 7)
    assert target.kv.positions == [210]
    assert target.kv.length <= 2 * 210 + 64 + 8


def test_hidden_states_of_fed_tokens_match_a_clean_forward(tiny_target):
    """The runner hands out, per fed position, the base model's output after the final norm (what the
    LM head reads), for prefills and for ragged steps with rollback alike."""
    model = tiny_target.model
    target = ModelRunner(model)
    prompts = [[5, 17, 99, 4, 8], [7, 9]]
    joined = target.join(["a", "b"], prompts, hidden=True)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(joined[b], clean_hidden(model, p), atol=1e-4, rtol=1e-4)
    out = target.forward([[11, 12, 13], [14]], hidden=True)
    target.rollback(0, 1)  # row a keeps 11, 12
    expect = clean_hidden(model, prompts[0] + [11, 12])[-2:]
    torch.testing.assert_close(out.hidden[0, :2], expect, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[1, :1], clean_hidden(model, prompts[1] + [14])[-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.lm_head(out.hidden), out.logits, atol=1e-4, rtol=1e-4)
    after = target.forward([[20], [21]], hidden=True)
    expect = clean_hidden(model, prompts[0] + [11, 12, 20])[-1]
    torch.testing.assert_close(after.hidden[0, 0], expect, atol=1e-4, rtol=1e-4)


def clean_hidden(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), hidden]: the base model's final-norm output of a fresh, cache-free forward."""
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([tokens], device=model.device)).last_hidden_state[0].float()


def test_restoring_a_checkpoint_undoes_forwards_rollbacks_joins_growth_and_compaction(tiny_target):
    """What a failed engine step did to a cache is undone exactly, even when the step compacted it."""
    model = tiny_target.model
    target = ModelRunner(model)
    target.join(["a", "b"], [[5, 17, 99, 4], [300, 301]])
    target.forward([[8, 9, 10], [302]])
    target.rollback(0, 2)
    before = target.forward([[11], [12]]).logits
    target.rollback(0, 1)
    target.rollback(1, 1)  # back to where `before` was computed from
    kv = target.kv
    ckpt = kv.checkpoint()
    capacity = kv.capacity
    for _ in range(40):  # enough holes that compaction runs, and the buffers grow
        target.forward([[7] * 4, [6] * 3])
        target.rollback(0, 4)
        target.rollback(1, 3)
    target.join(["c"], [[1, 2, 3]])
    assert kv.capacity > capacity and len(kv) == 3 and kv._compactions > ckpt.compactions
    kv.restore(ckpt)
    assert kv.rows == ["a", "b"] and kv.positions == ckpt.positions
    torch.testing.assert_close(target.forward([[11], [12]]).logits, before)
    target.rollback(0, 1)
    target.rollback(1, 1)
    kv.restore(ckpt)  # again, without a compaction in between
    torch.testing.assert_close(target.forward([[11], [12]]).logits, before)


@pytest.mark.slow
def test_a_budgeted_cache_is_allocated_once_and_stays_exact_through_joins_leaves_and_compaction(tiny_target):
    """With a budget (token slots), storage is allocated up front and never reallocated: joins, leaves,
    capacity changes and compaction move rows and columns inside it, and logits stay exact."""
    from server.model.kv_cache import KVBudgetExceeded

    model = tiny_target.model
    target = ModelRunner(model, kv_slots=600)
    stores = [(layer.key_store.data_ptr(), layer.value_store.data_ptr()) for layer in target.kv.cache.layers]
    history = {"a": [5, 17, 99, 4], "b": [300, 301]}
    target.join(["a", "b"], [history["a"], history["b"]])
    gen = torch.Generator().manual_seed(1)
    for step in range(30):
        if step == 5:
            history["c"] = list(range(20, 60))
            target.join(["c"], [history["c"]])
        if step == 12:
            target.leave({"a"})
            del history["a"]
        if step == 18:
            history["d"] = list(range(400, 470))
            target.join(["d"], [history["d"]])
        rows = target.rows
        fed = [[1000 + step + b] + [7, 8, 9][: int(torch.randint(0, 4, (1,), generator=gen))] for b in range(len(rows))]
        logits = target.forward(fed).logits
        for b, rid in enumerate(rows):
            expect = clean_logits(model, history[rid] + fed[b][:1])
            torch.testing.assert_close(logits[b, 0], expect, atol=1e-4, rtol=1e-4)
            target.rollback(b, len(fed[b]) - 1)
            history[rid] += fed[b][:1]
    assert len(target.rows) * target.kv.capacity <= 600
    assert [(layer.key_store.data_ptr(), layer.value_store.data_ptr()) for layer in target.kv.cache.layers] == stores
    with pytest.raises(KVBudgetExceeded):
        target.join(["e", "f"], [list(range(200)), list(range(200))])  # 5 rows x 200 columns > 600 slots


def test_short_rows_beside_a_long_prompt_move_their_live_tokens_alone_and_stay_exact(tiny_target, monkeypatch):
    """While a long prompt is computed every row gets its columns, so a short row beside it is mostly holes.
    Growth and a leave move each short row's live tokens alone (a long, mostly live row whole), into buffers
    mapped from the kernel's zero pages (forced here: the tiny model's are small): every row's logits stay
    those of a clean forward, and nothing a forward reads is NaN."""
    from server.model import kv_layers

    monkeypatch.setattr(kv_layers, "LAZY_BYTES", 0)
    moves: list[tuple[int, torch.Tensor | None]] = []
    move = kv_layers._move
    monkeypatch.setattr(kv_layers, "_move", lambda dst, src, cols, columns, copy=False: (
        moves.append((cols, columns)), move(dst, src, cols, columns, copy))[1])
    model = tiny_target.model
    target = ModelRunner(model)
    short = {"a": [5, 6, 7], "b": [8, 9]}
    long_prompt = [(37 * i) % 900 + 20 for i in range(150)]
    target.join(["a", "b", "L"], [short["a"], short["b"], long_prompt[:1]])
    history = {"a": list(short["a"]), "b": list(short["b"]), "L": long_prompt[:1]}
    for start in range(1, 150, 30):  # the long prompt in chunks beside one token of each short row per step
        chunk = long_prompt[start : start + 30]
        fed = {"a": [100 + start], "b": [200 + start], "L": chunk}
        target.forward([fed[r] for r in target.rows])
        for r in target.rows:
            history[r] += fed[r]
    assert target.kv.capacity >= 150 and target.kv.length > 150
    moves.clear()
    target.leave({"a"})  # the rows after it move down
    assert target.rows == ["b", "L"]
    short_moves = [columns for _, columns in moves if columns is not None]
    assert short_moves and all(len(c) == len(history["b"]) for c in short_moves)  # b's live tokens alone
    assert any(columns is None for _, columns in moves)  # L, mostly live, in one copy
    for layer in target.kv.cache.layers:
        assert torch.isfinite(layer.keys[:, :, : target.kv.length]).all()
        assert torch.isfinite(layer.values[:, :, : target.kv.length]).all()
    logits = target.forward([[41], [42]]).logits
    torch.testing.assert_close(logits[0, 0], clean_logits(model, history["b"] + [41]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, 0], clean_logits(model, history["L"] + [42]), atol=1e-4, rtol=1e-4)


def test_a_mapped_buffer_reads_zeros_and_keeps_what_is_written(monkeypatch):
    from server.model import kv_layers

    monkeypatch.setattr(kv_layers, "LAZY_BYTES", 0)
    buffer = kv_layers.zeroed(1 << 18, torch.empty(0))
    assert buffer.shape == (1 << 18,) and buffer.dtype == torch.float32 and not buffer.any()
    buffer[::4096] = 1.5
    assert buffer.sum().item() == 1.5 * 64
    resident = kv_layers.zeroed(1 << 18, torch.empty(0), resident=True)
    assert not resident.any() and resident.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


# ---- the cache's precision (kv_cache_dtype) -------------------------------------------------------------


def test_the_caches_precision_follows_the_weights_unless_asked():
    from server.config import Settings
    from server.model.kv_shape import QUANTIZED_WEIGHTS, kv_name, kv_precision
    from server.model.loading import QUANTIZED_FORMATS

    assert set(QUANTIZED_WEIGHTS) == set(QUANTIZED_FORMATS)  # kv_shape.py stays a leaf: its own copy of the list

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert kv_precision("auto", "as-file", f32) == f16  # llama.cpp's f16 cache, for the file's quantized weights
    assert kv_precision("auto", "int8", f32) == f16
    assert kv_precision("auto", "fp32", f32) is None  # a dense model served as it computes
    assert kv_precision("auto", "bf16", bf16) is None
    assert kv_precision("float16", "fp32", f32) == f16 and kv_precision("bfloat16", "fp32", f32) == bf16
    assert kv_precision("float32", "as-file", f32) is None
    assert kv_precision("float32", "bf16", bf16) is None and kv_precision("bfloat16", "bf16", bf16) is None
    with pytest.raises(ValueError, match="cannot round"):
        kv_precision("float16", "bf16", bf16)
    assert (kv_name(f16, f32), kv_name(None, f32), kv_name(None, bf16)) == ("float16", "float32", "bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Settings.load(kv_cache_dtype="float8")


@pytest.mark.parametrize("lean", [True, False])
def test_a_float16_cache_holds_what_a_pass_attended_over_and_the_prefix_reader_gives_it(tiny_target, lean):
    """Keys and values rounded to float16 when written, whichever forward writes them (the lean one,
    transformers'), and read back widened, so a pass attends over the same values a later step reads; the
    reader the prefix cache stores from gives them as kept; a row loaded back from them continues as the row it
    was read from; the cache holds half the bytes."""
    model = tiny_target.model
    runner = ModelRunner(model, lean=lean, kv_dtype=torch.float16)
    plain = ModelRunner(model, lean=lean)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    for r in (runner, plain):
        r.join(["a"], [prompt])
    before = runner.forward([[5, 6]]).logits
    assert not torch.equal(plain.forward([[5, 6]]).logits, before)  # the rounding is there to see
    torch.testing.assert_close(plain.forward([[7]]).logits, runner.forward([[7]]).logits, atol=2e-2, rtol=2e-2)
    layer = runner.kv.cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.float16
    assert runner.kv.nbytes * 2 == plain.kv.nbytes
    keys, values = runner.live("a")(0, 32)
    assert keys.dtype == values.dtype == torch.float16
    assert torch.equal(keys[0], layer.keys[0, :, :32])

    loaded = ModelRunner(model, lean=lean, kv_dtype=torch.float16)
    loaded.join(["b"], [prompt], prefixes=[(keys, values)])
    assert loaded.kv.cache.layers[0].keys.dtype == torch.float16
    again = ModelRunner(model, lean=lean, kv_dtype=torch.float16)
    again.join(["a"], [prompt])
    expected = again.forward([[5, 6]]).logits
    assert torch.equal(expected, before)
    torch.testing.assert_close(loaded.forward([[5, 6]]).logits, expected, atol=1e-5, rtol=1e-5)
