"""BatchKV: ragged batched forwards, rollback and join/leave give the logits of a clean forward."""

from __future__ import annotations

import torch

from server.model.kv_cache import BatchKV


def clean_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of the last position of a fresh, single-row, cache-free forward."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_ragged_steps_with_rollback_match_clean_forward(tiny_target):
    model = tiny_target.model
    prompts = [[5, 17, 99, 4, 8], [7], [300, 301, 302, 303, 304, 305, 306, 307, 308], [11, 12]]
    kv = BatchKV(model)
    fresh = kv.new_rows(["a", "b", "c", "d"])
    fresh.forward([p[:-1] for p in prompts], want_logits=False)  # row b prefills nothing
    kv.add_rows(fresh)
    # Row "b" had a one-token prompt: nothing prefilled. Feed the last prompt token plus "drafts".
    history = [list(p[:-1]) for p in prompts]
    pending = [p[-1] for p in prompts]
    gen = torch.Generator().manual_seed(0)
    for _step in range(6):
        drafts = [torch.randint(3, 1000, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in prompts]
        fed = [[pending[b]] + drafts[b] for b in range(len(prompts))]
        logits = kv.forward(fed)
        for b in range(len(prompts)):
            accepted = int(torch.randint(0, len(drafts[b]) + 1, (1,), generator=gen))
            # The logits after each fed token equal a clean forward over the history so far.
            expect = clean_logits(model, history[b] + fed[b][: accepted + 1])
            torch.testing.assert_close(logits[b, accepted], expect, atol=1e-4, rtol=1e-4)
            kv.rollback(b, len(drafts[b]) - accepted)
            history[b] += fed[b][: accepted + 1]
            pending[b] = 1000 + b + _step
        kv.maybe_compact()
    assert kv.positions == [len(h) for h in history]


def test_join_leave_and_compact_keep_rows_exact(tiny_target):
    model = tiny_target.model
    kv = BatchKV(model)
    first = kv.new_rows(["x", "y"])
    first.forward([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10]], want_logits=False)
    kv.add_rows(first)
    kv.forward([[11, 12, 13], [14]])
    kv.rollback(0, 2)  # x keeps 11; y keeps 14
    late = kv.new_rows(["z"])
    late.forward([[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]], want_logits=False)
    kv.add_rows(late)
    kv.remove_rows({"y"})
    assert kv.rows == ["x", "z"]
    kv.compact()
    logits = kv.forward([[40], [41, 42]])
    expect_x = clean_logits(model, [1, 2, 3, 4, 5, 6, 7, 8, 11, 40])
    torch.testing.assert_close(logits[0, 0], expect_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        logits[1, 1], clean_logits(model, list(range(20, 33)) + [41, 42]), atol=1e-4, rtol=1e-4
    )


def test_steps_write_in_place_without_copying_the_cache(tiny_target):
    """A step writes only its new columns: the buffers are not reallocated (no per-step full copy)."""
    kv = BatchKV(tiny_target.model)
    fresh = kv.new_rows(["a", "b"])
    fresh.forward([list(range(10, 40)), list(range(50, 60))], want_logits=False)
    kv.add_rows(fresh)
    kv._resize(256)  # room for the steps below, so growth (amortised doubling) doesn't kick in
    buffers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.cache.layers]
    for step in range(10):
        kv.forward([[100 + step, 7, 8, 9], [200 + step]])
        kv.rollback(0, 2)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.cache.layers] == buffers


def test_chunked_prefill_equals_one_forward(tiny_target):
    model = tiny_target.model
    prompts = [list(range(100, 140)), list(range(300, 307)), []]
    kv = BatchKV(model)
    fresh = kv.new_rows(["a", "b", "c"])
    fresh.prefill(prompts, chunk=16)
    kv.add_rows(fresh)
    logits = kv.forward([[5], [6], [7]])
    for b, (p, last) in enumerate(zip(prompts, [5, 6, 7], strict=True)):
        torch.testing.assert_close(logits[b, 0], clean_logits(model, p + [last]), atol=1e-4, rtol=1e-4)


def test_holes_from_rollbacks_stay_bounded(tiny_target):
    """Every step rolls back most of what it fed (as a draft cache does): compaction keeps the
    column space within about twice the live tokens instead of growing with the steps."""
    kv = BatchKV(tiny_target.model)
    fresh = kv.new_rows(["a"])
    fresh.forward([list(range(10, 20))], want_logits=False)
    kv.add_rows(fresh)
    for step in range(200):
        kv.forward([[100 + step % 50, 1, 2, 3, 4, 5, 6, 7]])
        kv.rollback(0, 7)
    assert kv.positions == [210]
    assert kv.length <= 2 * 210 + 64 + 8
