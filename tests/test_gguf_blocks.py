"""GGUF block types read as the kernels' blocks (server/model/gguf_blocks.py): the weights ggml's own
dequantization gives, bit for bit, for any bytes a file may hold; and the layers built from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.model import gguf_weights
from server.model.gguf_blocks import BLOCK_BYTES, BLOCK_SIZE, SERVED, decode

HALVES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}  # where each block keeps its float16 scales (and minimums)


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `kind`'s block layout, its float16 fields set to small finite values."""
    rng = np.random.default_rng(seed)
    count = rows * cols // BLOCK_SIZE[kind]
    raw = rng.integers(0, 256, (count, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = (rng.standard_normal(count) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = halves.view(np.uint8).reshape(count, 2)
    return raw


@pytest.mark.parametrize("kind", SERVED)
def test_blocks_are_ggmls_weights_bit_for_bit(kind):
    import gguf
    from gguf.quants import dequantize

    rows, cols = 6, 512
    raw = _random_blocks(kind, rows, cols)
    want = dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    blocks = decode(kind, raw, rows)
    assert np.array_equal(blocks.dequantize().numpy(), want)
    assert blocks.group == (16 if kind == "Q6_K" else 32)
    assert blocks.four_bit == kind.startswith("Q4")


@pytest.mark.parametrize("kind", SERVED)
def test_a_layer_of_any_block_type_holds_the_files_weights(kind):
    """What serving multiplies by: Q4Linear (4-bit types) or Q8Linear (5, 6 and 8 bits) over the same weights,
    within float32's rounding of Q4's stored zero (w = s (q - 8) + z)."""
    rows, cols = 32, 512
    blocks = decode(kind, _random_blocks(kind, rows, cols, seed=1), rows)
    layer = gguf_weights._layer(blocks)
    want = blocks.dequantize()
    tolerance = 4 * torch.finfo(torch.float32).eps * float(want.abs().max())
    assert (layer.dequantize() - want).abs().max() <= tolerance
