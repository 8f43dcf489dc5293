"""The 5-bit tiles (Q5_0, Q5_1, Q5_K on int8 activations) and the 6-bit ones (Q6_K): five eighths and three quarters
of a byte a weight where the Q8 tiles spend one, and the same products bit for bit, so a file's greedy text does not
change with the layout."""

import pytest
import torch

from server.model import cpu_kernels
from server.model.quantized import Q8Linear
from tests.kernel_marks import needs_kernels

lib = cpu_kernels.library()
pytestmark = needs_kernels


def _weights(n: int, k: int, minimum: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(n, k // 32, generator=g) * 0.05
    if minimum:
        return torch.randint(0, 32, (n, k), generator=g), s, -torch.rand(n, k // 32, generator=g) * 0.4
    return torch.randint(-16, 16, (n, k), generator=g), s, None


@pytest.mark.parametrize("minimum", [True, False], ids=["Q5_1-Q5_K", "Q5_0"])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (96, 896), (33, 128)])
def test_the_same_bits_as_the_q8_tiles_alone_and_in_any_batch(minimum, n, k):
    q, s, m = _weights(n, k, minimum, seed=n + k)
    five = cpu_kernels.Tiles.q5(q, s, lib, m=m)
    eight = cpu_kernels.Tiles.q8(q, s, lib, int8=True, m=m)
    assert five.kind == (cpu_kernels.KIND_Q5M_INT8 if minimum else cpu_kernels.KIND_Q5_INT8)
    assert five.q.numel() * 8 == eight.q.numel() * 5  # 5 bits a weight against 8
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(rows, k, generator=g) * 3
        y = five(x)
        assert torch.equal(y, eight(x)), rows
        assert torch.equal(torch.cat([five(x[i : i + 1]) for i in range(rows)]), y)  # a row alone: the same bits
        w = s.repeat_interleave(32, 1) * q + (m.repeat_interleave(32, 1) if m is not None else 0)
        exact = x.double() @ w.double().t()
        slack = cpu_kernels.activation_error(x) @ (s.repeat_interleave(32, 1) * q).double().abs().t()
        assert ((y.double() - exact).abs() <= slack + 1e-4 * float(exact.abs().max())).all()


@pytest.mark.parametrize("minimum", [True, False])
def test_values_read_back(minimum):
    q, s, m = _weights(50, 96, minimum, seed=3)
    five = cpu_kernels.Tiles.q5(q, s, lib, m=m)
    ids = torch.tensor([0, 7, 8, 15, 16, 31, 49])
    assert torch.equal(five.values(ids), q[ids].to(torch.int8))


def test_values_past_five_bits_are_refused():
    q, s, m = _weights(16, 64, True, seed=4)
    with pytest.raises(ValueError, match="5-bit"):
        cpu_kernels.Tiles.q5(q + 1, s, lib, m=m)  # 32 does not fit
    with pytest.raises(ValueError, match="5-bit"):
        cpu_kernels.Tiles.q5(q - 17, s, lib)  # -17 does not fit Q5_0's


def test_a_q5_layer_serves_from_five_bit_tiles_and_a_q8_layer_does_not(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "int8_activations", lambda: True)
    q, s, m = _weights(48, 128, True, seed=5)
    assert Q8Linear(q.to(torch.int8), s, mins=m).kernel().kind == cpu_kernels.KIND_Q5M_INT8
    q0, s0, _ = _weights(48, 128, False, seed=6)
    layer = Q8Linear(q0.to(torch.int8), s0)
    assert layer.kernel().kind == cpu_kernels.KIND_Q5_INT8
    x = torch.randn(3, 128)
    assert torch.equal(layer(x), cpu_kernels.Tiles.q8(q0, s0, lib, int8=True)(x))
    wide = Q8Linear.quantize(torch.randn(48, 128))  # Q8_0: values to +-127
    assert wide.kernel().kind == cpu_kernels.KIND_Q8_INT8


@pytest.mark.parametrize("scales", ["per-32", "per-32-with-minimum", "per-16"])
def test_the_q8_tiles_row_blocks_give_a_row_the_same_bits_alone_and_within_the_products_bound(scales):
    """The Q8 tiles (kinds 9-11: Q8_0, Q5_1/Q5_K as int8, Q6_K's scales per 16) multiply up to 4 rows a block: a row
    alone, in 2, 3, 4, 5 or 9 rows gives the same bits, and the products are the dequantized weights' within the
    int8 activations' rounding."""
    g = torch.Generator().manual_seed(3)
    n, k = 48, 256
    q = torch.randint(-127, 128, (n, k), generator=g)
    s = torch.rand(n, k // (16 if scales == "per-16" else 32), generator=g) * 0.02
    m = -torch.rand(n, k // 32, generator=g) * 0.3 if scales == "per-32-with-minimum" else None
    tiles = cpu_kernels.Tiles.q8(q, s, lib, int8=True, m=m)
    x = torch.randn(9, k, generator=g)
    together = tiles(x)
    for rows in (1, 2, 3, 4, 5):
        for start in range(0, 9 - rows + 1, 2):
            assert torch.equal(tiles(x[start:start + rows]), together[start:start + rows])
    w = q.double() * s.double().repeat_interleave(k // s.shape[1], dim=1)
    if m is not None:
        w = w + m.double().repeat_interleave(32, dim=1)
    exact = x.double() @ w.t()
    assert (together.double() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("two_level", ["1", "0"])
@pytest.mark.parametrize("n,k", [(16, 256), (40, 512), (7, 1024)])
def test_six_bit_tiles_give_the_q8_tiles_bits_alone_and_in_any_batch(n, k, two_level, monkeypatch):
    """Q6_K's values (in [-32, 31], a scale per 16 inputs) in 6-bit tiles: three quarters of the Q8 tiles' bytes, the
    same bits as the Q8 tiles of the same weights for every row count, a row's bits the same alone and in a batch,
    and the values read back (table lookups read them from the head's tiles)."""
    monkeypatch.setenv("SPECULA_TWO_LEVEL_SCALES", two_level)
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-32, 32, (n, k), generator=g)
    q[0, :3] = torch.tensor([-32, 31, 0])  # both ends of the range
    d = (torch.rand(n, k // 256, generator=g) * 0.01).half().float()
    s = d.repeat_interleave(16, 1) * torch.randint(-128, 128, (n, k // 16), generator=g)
    six = cpu_kernels.Tiles.q8(q, s, lib)
    eight = cpu_kernels.Tiles.q8(q, s, lib, six_bits=False)
    assert six.kind == cpu_kernels.KIND_Q6_INT8 and eight.kind == cpu_kernels.KIND_Q8G16_INT8
    assert six.q.numel() * 4 == eight.q.numel() * 3
    ids = torch.arange(n)
    assert torch.equal(six.values(ids), q.to(torch.int8)) and torch.equal(eight.values(ids), q.to(torch.int8))
    assert torch.equal(six.group_scales(ids), s)
    x = torch.randn(9, k, generator=g)
    alone = six(x[:1])
    for rows in (1, 2, 3, 4, 5, 9):
        got = six(x[:rows])
        assert torch.equal(got, eight(x[:rows])), rows
        assert torch.equal(got[:1], alone), rows


def test_values_past_six_bits_keep_the_q8_tiles():
    q = torch.full((16, 256), 40)
    assert cpu_kernels.Tiles.q8(q, torch.ones(16, 16), lib).kind == cpu_kernels.KIND_Q8G16_INT8
