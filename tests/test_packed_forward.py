"""Packed forwards (server/model/attention.py): rows feeding different numbers of tokens compute only
their real tokens, and every output and the cache are those of the padded forward."""

from __future__ import annotations

import copy

import pytest
import torch

from server.model.attention import Packing, use_gqa_attention
from server.model.runner import ModelRunner


@pytest.fixture
def model(tiny_target):
    model = copy.deepcopy(tiny_target.model)
    use_gqa_attention(model)
    return model


def _pair(model, prompts):
    packed, padded = ModelRunner(model), ModelRunner(model)
    assert packed.packs
    padded.packs = False
    for runner in (packed, padded):
        runner.join([f"r{b}" for b in range(len(prompts))], prompts)
    return packed, padded


@pytest.mark.parametrize(
    "counts",
    [
        [1, 6, 1, 1],  # one row drafts: each row's first query batched, the rest row by row
        [5, 4, 6, 3],  # every row drafts: padded attention
        [0, 3, 1, 7],  # a held row feeds nothing
    ],
)
def test_packed_forward_equals_the_padded_one(model, counts):
    prompts = [[5, 17, 99, 4], [7, 8], [300, 301, 302, 303, 304, 305], [11, 12, 13]]
    packed, padded = _pair(model, prompts)
    layout = Packing.of(counts, packed.device)
    assert layout.tokens == sum(counts)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):  # a second and third step read what the packed one wrote into the cache
        fed = [torch.randint(3, 1000, (n if step == 0 else 1 + (b + step) % 3,), generator=gen).tolist()
               for b, n in enumerate(counts)]
        a, b = packed.forward(fed, hidden=True), padded.forward(fed, hidden=True)
        if len(set(map(len, fed))) > 1:
            assert a.computed == sum(map(len, fed)) < b.computed == len(fed) * max(map(len, fed))
        for row, x in enumerate(fed):
            torch.testing.assert_close(a.logits[row, : len(x)], b.logits[row, : len(x)], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a.hidden[row, : len(x)], b.hidden[row, : len(x)], atol=1e-4, rtol=1e-4)
        # what the verify step reads: the chosen rows' fed positions, row after row, one per computed token
        live = [row for row, x in enumerate(fed) if x]
        for out in (a, b):
            logits, hidden = out.of_rows(live)
            expect = torch.cat([b.logits[row, : len(fed[row])] for row in live])
            torch.testing.assert_close(logits, expect, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden, torch.cat([b.hidden[row, : len(fed[row])] for row in live]),
                                       atol=1e-4, rtol=1e-4)
        assert packed.kv.positions == padded.kv.positions


def test_split_attention_only_where_padding_dominates():
    cpu = torch.device("cpu")
    assert Packing.of([1, 17, 1, 1, 1, 1, 1, 1], cpu).split
    assert not Packing.of([17, 16, 17, 15], cpu).split
