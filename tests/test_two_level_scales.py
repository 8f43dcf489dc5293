"""A K-quant's scales kept as the file keeps them, in two levels (a float32 d per 256 inputs times an int8 per group:
cpu_kernels.two_level, csrc/specula.h's SCALES_TWO_LEVEL): the same bits as float32 scales per group, for a row
alone and in any batch, on the products and on the C decoder, in 2.7x fewer bytes; scales with no such form stay
float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.model import cpu_kernels, tile_scales
from server.model.gguf_blocks import decode
from server.model.gguf_weights import _layer
from tests import kquants
from tests.gguf_fixtures import hf_model, write_gguf
from tests.kernel_marks import needs_kernels


def _tiles(kind: str, rows: int, k: int, seed: int, two_level: bool, monkeypatch) -> cpu_kernels.Tiles:
    monkeypatch.setenv("SPECULA_TWO_LEVEL_SCALES", "1" if two_level else "0")
    values = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 0.05
    layer = _layer(decode(kind, kquants.quantize(values, kind), rows))
    tiles = layer.kernel()
    assert isinstance(tiles, cpu_kernels.Tiles)
    return tiles


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tiles_hold_two_level_scales_with_the_same_bits_in_any_batch(kind, monkeypatch):
    monkeypatch.setenv("SPECULA_INT8_ACTIVATIONS", "1")  # Q4_K on int8 activations (Q5_K and Q6_K always are)
    two = _tiles(kind, 40, 512, 0, True, monkeypatch)
    flat = _tiles(kind, 40, 512, 0, False, monkeypatch)
    assert two.scales == cpu_kernels.SCALES_TWO_LEVEL and flat.scales == cpu_kernels.SCALES_F32
    held = lambda t: sum(x.numel() * x.element_size() for x in (t.s, t.m) if x.numel() > 1)  # noqa: E731
    assert held(two) * 2.5 < held(flat)
    ids = torch.arange(40)
    assert torch.equal(two.group_scales(ids), flat.group_scales(ids))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    for rows in (1, 2, 3, 4, 5, 9):
        got = two(x[:rows])
        assert torch.equal(got, flat(x[:rows])), rows
        assert torch.equal(got[:1], two(x[:1])), rows  # the first row's bits beside any others


def test_scales_with_no_two_level_form_stay_float32():
    s = torch.rand(2, 8, 16) * 0.1  # arbitrary float32 scales: no one d of which all are small integer multiples
    assert tile_scales.two_level(s, 8) is None
    assert tile_scales.two_level(torch.rand(2, 12, 16), 8) is None  # not whole super-blocks (K = 384)
    d = torch.rand(2, 1, 16).half().float()
    exact = tile_scales.two_level(d * torch.randint(-128, 128, (2, 8, 16)).float(), 8)
    assert exact is not None
    too_wide = d * torch.randint(-128, 128, (2, 8, 16)).float()
    too_wide[0, 0, 0] = d[0, 0, 0] * 1000  # a multiple past int8
    assert tile_scales.two_level(too_wide, 8) is None


@needs_kernels
def test_the_c_decoder_gives_the_same_logits_on_two_level_scales(tmp_path, monkeypatch):
    from server.model.loading import load_model
    from server.model.runner import ModelRunner

    path = write_gguf(tmp_path / "llama.gguf", hf_model("llama"), "llama", "Q4_K_M")
    ids = list(range(5, 25))
    logits = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("SPECULA_TWO_LEVEL_SCALES", setting)
        served = load_model(str(path), device="cpu", weights="as-file").model
        runner = ModelRunner(served)
        assert runner.call.decoder is not None
        forms = {t.scales for t in _all_tiles(served)}
        assert forms == ({cpu_kernels.SCALES_TWO_LEVEL} if setting == "1" else {cpu_kernels.SCALES_F32}), forms
        runner.join(["a"], [ids[:8]], chunk=5)
        out = [runner.forward([ids[8:12]]).logits[0]] + [runner.forward([[t]]).logits[0] for t in ids[12:]]
        logits[setting] = torch.cat(out)
    assert torch.equal(logits["1"], logits["0"])


def _all_tiles(model: torch.nn.Module) -> list[cpu_kernels.Tiles]:
    from server.model.quantized import QuantLinear

    return [m.kernel() for m in model.modules() if isinstance(m, QuantLinear) and m.runs_kernel()]
