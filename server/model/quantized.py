"""Weight-only quantized linear layers: a GGUF file's blocks served as they are (gguf_blocks.py reads them).

On an x86 CPU with a C compiler the blocks multiply through the CPU block kernels (cpu_kernels.py): float32 outputs,
the file's w = s q + m summed as s (sum x q) + m (sum x) per group, a row's result the same bits in any batch. On
hosts without AVX-512 (and always for the K-quants' per-16 scales and minimums: `Q8Linear`) the activations are
rounded to int8 per row and group of 32 (`QuantLinear.int8_activations`), still a row's own arithmetic: no scale is
ever computed over the rows of a call (dynamic int8 quantization does that, and a row's logits would depend on its
neighbours, so greedy text would change with the proposer).

A one-token step of a small model reads every weight once, so on a CPU its cost is mostly bytes (SmolLM2-135M: 540 MB
a step in fp32, 80 MB as its Q4_1 file): these modules keep the file's blocks, never an fp32 copy of the weights.

* `Q4Linear`: 4-bit values q in [0, 15] with a scale and a zero per 32 inputs (Q4_0: w = d (q - 8); Q4_1: d q + m;
  Q4_K: its super-block scale times each sub-block's, minus dmin times its minimum).
* `Q8Linear`: int8 values with a scale per group (Q8_0, Q5_0 as q - 16; Q6_K per 16 inputs), optionally a minimum
  per 32 (Q5_1, Q5_K: q in [0, 31]).
* `Int8Linear`: per-output-channel int8 (the `int8` setting, any checkpoint): torch's `_weight_int8pack_mm`.

Without the block kernels (no compiler, `SPECULA_CPU_KERNELS=0`) Q4 and Q8_0 run through torch's int4 kernel
`_weight_int4pack_mm_for_cpu` (w = s (q - 8) + z per group of 32 from bf16 s and z; Q8_0 as two 4-bit halves,
q + 128 = 16 hi + lo, along a doubled input): its vectorised path takes bf16 activations and gives bf16 outputs,
three bf16 roundings of unit roundoff 2^-8 (s and z, activations, outputs) that `weight_error_bound` and
`output_error_bound` state and the tests hold it to; a model with such a layer attends in float64 (attention.py).
The other block types, and any device but a CPU, multiply by the dequantized weights (`QuantLinear.dense`).

The embedding table and the LM head over it: tables.py. Quantizing a dense model's layers: quantize.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from server.model import cpu_kernels
from server.model.memory import drop_file_pages

GROUP = 32  # weights per ggml block (Q4_0, Q4_1, Q8_0)
BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits, round to nearest)

Kernel = Callable[[torch.Tensor], torch.Tensor]


def has_int4_kernel() -> bool:
    """Whether this torch has the CPU int4 weight-only kernel the Q4/Q8 modules multiply through."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 (low nibble = even input index) -> [N, K] int32 values in [0, 15]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 15] -> [N, K/2] uint8 (low nibble = even input index): half a byte a weight."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _int4_pack(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int32 values in [0, 15] -> the CPU kernel's blocked layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def _packed_from(*modules: nn.Module) -> None:
    """The modules' buffers were copied into a kernel's layout: pages of them mapped from the weights cache's
    file leave the RSS (read back from the file if anything reads them again; memory.py)."""
    drop_file_pages([b for m in modules for b in m.buffers()])


class QuantLinear(nn.Module):
    """`x @ W.T (+ b)` with W held quantized. Subclasses say how (`dequantize`) and build the kernel (`kernel`).

    `forward` serves transformers' own forward (activations in and out in their dtype); the lean forward
    calls `kernel()` once and keeps what it returns (lean_forward.py)."""

    in_features: int
    out_features: int
    kind: str  # "q4" | "q8" | "int8": also the weights-cache's record of each layer's format
    blocks = False  # ggml blocks the float32 block kernels (cpu_kernels.py) multiply

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None else None
        self._kernel: Kernel | None = None
        self._int8: bool | None = None  # whether the kernel built for it (its own or a fused one) takes int8 inputs

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out, in]: the file's values (the reference the kernels are tested against)."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (fp32, made on every read): for code that borrows a model's matrices, such as
        a draft head reading the LM head's rows. Never what serving multiplies by."""
        return self.dequantize()

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The product by the dequantized weights in x's dtype (devices without the kernel, references)."""
        return F.linear(x, self.dequantize().to(x.dtype), self.bias.to(x.dtype) if self.bias is not None else None)

    def _build(self) -> Kernel:
        raise NotImplementedError

    def kernel(self) -> Kernel:
        """`x [..., in] -> y [..., out]` (y in x's dtype) through the quantized kernel on CPU, else `dense`."""
        if self._kernel is None:
            if self.runs_kernel():
                self._kernel = self._build()
                _packed_from(self)
            else:
                self._kernel = self.dense
        return self._kernel

    def runs_kernel(self) -> bool:
        """Whether `kernel` is a quantized kernel (on CPU, where one runs), not `dense`."""
        return all(t.device.type == "cpu" for t in self.buffers()) and (self._supported() or self._floats())

    def rounds_inputs(self) -> bool:
        """Whether its kernel rounds activations (and outputs) to bf16: torch's int4 / int8 kernels do, the
        float32 block kernels (cpu_kernels.py) do not. A model with such a layer attends in float64
        (attention.py)."""
        return self.runs_kernel() and not self._floats()

    def _floats(self) -> bool:
        """Whether this layer multiplies through the float32 block kernels (GGUF blocks, where they built)."""
        return self.blocks and cpu_kernels.library() is not None

    def int8_activations(self) -> bool:
        """Whether its kernel rounds each row's activations to int8 per group of 32 (Q4 and Q8 blocks on the block
        kernels, where `cpu_kernels.int8_activations` says so): per row, so a row's result still does not depend
        on the rows beside it."""
        if self._int8 is not None:
            return self._int8
        return self._floats() and cpu_kernels.int8_activations()

    def scaled_values(self) -> torch.Tensor:
        """Per weight |d q|: the terms int8 activations multiply (`output_error_bound`)."""
        return self.block_magnitude()

    def release(self) -> list[torch.Tensor]:
        """Drop this layer's own buffers once the kernels that serve it hold their copies (a server's model:
        `LeanForward.release_dense`); afterwards only kernels built before can run it. The dropped tensors."""
        dropped = []
        for name, buffer in list(self._buffers.items()):
            if buffer is not None and buffer.numel():
                dropped.append(buffer)
                self._buffers[name] = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
        return dropped

    def _supported(self) -> bool:
        return has_int4_kernel()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantLinear:  # type: ignore[override]
        self._kernel = None  # moved or converted: built again on the next call
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel()(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def _int4_call(packed: torch.Tensor, scales_zeros: torch.Tensor, out: int, bias: torch.Tensor | None,
               doubled: bool = False) -> Kernel:
    """The int4 kernel as `x -> y` ([..., in] -> [..., out]): x cast to bf16 (fed twice along the input for
    Q8's two halves), y cast back to x's dtype."""
    sz = scales_zeros.to(torch.bfloat16).contiguous()

    def call(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if doubled:
            flat = torch.cat([flat, flat], dim=-1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), packed, GROUP, sz)
        y = y.view(*shape[:-1], out).to(x.dtype)
        return y + bias.to(y.dtype) if bias is not None else y

    call.tensors = (packed, sz)  # type: ignore[attr-defined]  # what it holds (memory accounting)
    return call


class Q4Linear(QuantLinear):
    """Q4_0 / Q4_1 weights: per group of 32 inputs a scale s and a zero z, w = s (q - 8) + z (see the module doc).

    Buffers: `qweight` [out, in/2] uint8 (two 4-bit values a byte, the low nibble first), `scales_zeros`
    [in/32, out, 2] fp32 (the kernel's own layout)."""

    kind = "q4"
    blocks = True

    def __init__(self, qweight: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, half = qweight.shape
        super().__init__(2 * half, out_features, bias)
        assert scales_zeros.shape == (2 * half // GROUP, out_features, 2), scales_zeros.shape
        self.register_buffer("qweight", qweight.to(torch.uint8).contiguous())
        self.register_buffer("scales_zeros", scales_zeros.float().contiguous())

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Q4Linear:
        """From ggml's fields: q [out, in] in [0, 15], d (and m for Q4_1; None for Q4_0) [out, in/32]."""
        d = d.float()
        zero = torch.zeros_like(d) if m is None else m.float() + 8 * d
        return cls(pack_nibbles(q), torch.stack([d.t(), zero.t()], dim=-1))

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Q4Linear:
        """Q4_1-style quantization of dense weights (tests, tiny files): min/max per group of 32."""
        groups = w.float().reshape(w.shape[0], -1, GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        d = ((hi - lo) / 15).clamp_min(1e-8).half().float()
        m = lo.half().float()
        q = ((groups - m[..., None]) / d[..., None]).round().clamp(0, 15).reshape(w.shape)
        return cls.from_blocks(q.to(torch.int32), d, m)

    def dequantize(self) -> torch.Tensor:
        s, z = self.scales_zeros[..., 0].t(), self.scales_zeros[..., 1].t()  # [out, in/32]
        q = unpack_nibbles(self.qweight).float().view(self.out_features, -1, GROUP)
        return (s[..., None] * (q - 8) + z[..., None]).reshape(self.out_features, self.in_features)

    def _build(self) -> Kernel:
        q = unpack_nibbles(self.qweight)
        lib = cpu_kernels.library()
        if lib is not None:  # float32 in and out, w = s q + m with m = z - 8 s (the file's d q + m)
            s, z = self.scales_zeros[..., 0].t(), self.scales_zeros[..., 1].t()
            tiles = cpu_kernels.Tiles.q4(q, s, z - 8 * s, lib).with_bias(self.bias)
            self._int8 = tiles.kind == cpu_kernels.KIND_Q4_INT8
            return tiles
        return _int4_call(_int4_pack(q), self.scales_zeros, self.out_features, self.bias)

    def block_magnitude(self) -> torch.Tensor:
        """Per weight, |s| q + |z| + 8 |s| >= |s q| + |m| (m = z - 8s): the size of the terms the float32 block
        kernel sums for it (`output_error_bound`)."""
        s, z = self.scales_zeros[..., 0].t().abs(), self.scales_zeros[..., 1].t().abs()
        q = unpack_nibbles(self.qweight).float().view(self.out_features, -1, GROUP)
        return (s[..., None] * q + (z + 8 * s)[..., None]).reshape(self.out_features, self.in_features)

    def scaled_values(self) -> torch.Tensor:
        """Per weight |s| q: the terms int8 activations multiply (`output_error_bound`)."""
        s = self.scales_zeros[..., 0].t().abs()
        q = unpack_nibbles(self.qweight).float().view(self.out_features, -1, GROUP)
        return (s[..., None] * q).reshape(self.out_features, self.in_features)

    def weight_error_bound(self) -> torch.Tensor:
        """Per weight, the most the kernel's weight (bf16 s and z) can differ from the file's: u(|s||q-8| + |z|)."""
        s, z = self.scales_zeros[..., 0].t(), self.scales_zeros[..., 1].t()
        q = unpack_nibbles(self.qweight).float().view(self.out_features, -1, GROUP)
        bound = BF16_U * (s.abs()[..., None] * (q - 8).abs() + z.abs()[..., None])
        return bound.reshape(self.out_features, self.in_features)


class Q8Linear(QuantLinear):
    """Weights as int8 values with a scale per group of inputs, w = d q (Q8_0, Q5_0 as q - 16), optionally plus a
    minimum per group of 32, w = d q + m (Q5_1, Q5_K: q in [0, 31]), and with groups of 16 inputs where the file's
    scales are per 16 (Q6_K: d is the super-block's scale times the sub-block's 8-bit one). See the module doc for
    the kernels; the groups of 16 and the minimum run on int8 activations only (llama.cpp's K-quants do too).

    Buffers: `qweight` [out, in] int8, `scales` [out, in/32] or [out, in/16] fp32, `mins` [out, in/32] fp32 or
    absent."""

    kind = "q8"
    blocks = True

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 mins: torch.Tensor | None = None) -> None:
        out_features, in_features = qweight.shape
        super().__init__(in_features, out_features, bias)
        assert scales.shape in ((out_features, in_features // GROUP), (out_features, in_features // 16)), scales.shape
        self.group = in_features // scales.shape[1]
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        if mins is not None:
            assert mins.shape == (out_features, in_features // GROUP), mins.shape
            self.register_buffer("mins", mins.float().contiguous())
        else:
            self.mins = None

    @property
    def plain(self) -> bool:
        """Q8_0's form (groups of 32, no minimum): the only one torch's int4 kernel can run."""
        return self.mins is None and self.group == GROUP

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Q8Linear:
        """Q8_0 quantization of dense weights (tests, tiny files): d = max |w| / 127 per group of 32."""
        groups = w.float().reshape(w.shape[0], -1, GROUP)
        d = (groups.abs().amax(-1) / 127).clamp_min(1e-8).half().float()
        q = (groups / d[..., None]).round().clamp(-127, 127).reshape(w.shape)
        return cls(q.to(torch.int8), d)

    def _scaled(self) -> torch.Tensor:
        """d q per weight [out, in] (fp32)."""
        q = self.qweight.float().view(self.out_features, -1, self.group)
        return (q * self.scales[..., None]).reshape(self.out_features, self.in_features)

    def _mins(self) -> torch.Tensor:
        return self.mins.repeat_interleave(GROUP, dim=1) if self.mins is not None else torch.zeros(())

    def dequantize(self) -> torch.Tensor:
        return self._scaled() + self._mins() if self.mins is not None else self._scaled()

    def _supported(self) -> bool:
        return has_int4_kernel() and self.plain

    def five_bits(self) -> bool:
        """Whether its values fit the 5-bit tiles on int8 activations (`cpu_kernels.Tiles.q5`: Q5_1 and Q5_K, which
        run on int8 activations everywhere, and Q5_0 where the host takes int8 activations): groups of 32 and
        values in [0, 31] beside a minimum, in [-16, 15] without."""
        if self.group != GROUP or not self.qweight.numel():
            return False
        if self.mins is None and not cpu_kernels.int8_activations():
            return False
        low, high = int(self.qweight.min()), int(self.qweight.max())
        return 0 <= low and high <= 31 if self.mins is not None else -16 <= low and high <= 15

    def _build(self) -> Kernel:
        lib = cpu_kernels.library()
        if lib is not None:  # float32 in and out, w = d q (+ m); 5-bit values in 5-bit tiles (the same products)
            maker = cpu_kernels.Tiles.q5 if self.five_bits() else cpu_kernels.Tiles.q8
            tiles = maker(self.qweight, self.scales, lib, m=self.mins).with_bias(self.bias)
            self._int8 = tiles.kind in cpu_kernels.INT8_KINDS
            return tiles
        u = self.qweight.to(torch.int32) + 128  # [out, in] in [0, 255]
        hi, lo = u >> 4, u & 15
        packed = _int4_pack(torch.cat([hi, lo], dim=1))  # [out, 2 in]: the high halves' groups, then the low
        d = self.scales.t()  # [in/32, out]
        sz = torch.cat([torch.stack([16 * d, torch.zeros_like(d)], -1), torch.stack([d, 8 * d], -1)], dim=0)
        return _int4_call(packed, sz, self.out_features, self.bias, doubled=True)

    def block_magnitude(self) -> torch.Tensor:
        """Per weight |d q| + |m| (`Q4Linear.block_magnitude`)."""
        return self._scaled().abs() + self._mins().abs()

    def scaled_values(self) -> torch.Tensor:
        """Per weight |d q|: the terms int8 activations multiply (`output_error_bound`)."""
        return self._scaled().abs()

    def weight_error_bound(self) -> torch.Tensor:
        """Per weight: u |d q| (bf16 d; 16d and 8d are exact multiples of it)."""
        return BF16_U * self.dequantize().abs()


class Int8Linear(QuantLinear):
    """Per-output-channel symmetric int8 weights (the `int8` setting): w = s q, s = max |w_row| / 127.

    Buffers: `qweight` [out, in] int8, `scales` [out] fp32."""

    kind = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = qweight.shape
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        s = (w.float().abs().amax(1) / 127).clamp_min(1e-12)
        q = (w.float() / s[:, None]).round().clamp(-127, 127)
        return cls(q.to(torch.int8), s, bias)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def _supported(self) -> bool:
        return hasattr(torch.ops.aten, "_weight_int8pack_mm")

    def _build(self) -> Kernel:
        qweight, scales, bias, out = self.qweight, self.scales.to(torch.bfloat16), self.bias, self.out_features

        def call(x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            flat = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(flat, qweight, scales).view(*shape[:-1], out).to(x.dtype)
            return y + bias.to(y.dtype) if bias is not None else y

        call.tensors = (qweight, scales)  # type: ignore[attr-defined]
        return call

    def weight_error_bound(self) -> torch.Tensor:
        return BF16_U * self.dequantize().abs()


def output_error_bound(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The most `layer.kernel()(x)` may differ from x @ dequantize().T in exact arithmetic, from the format:
    the weights' bf16 error, x's bf16 rounding (u |x| |w|), the output's bf16 rounding (u |y|) and fp32
    accumulation (K 2^-24 sum |x w|, generously). A layer on the float32 block kernels (cpu_kernels.py) rounds
    nothing to bf16: it sums s (sum x q) + m (sum x) per group of 32 in fp32 (chains of 8 products, a 32-term sum
    of x, one product each, then K/32 groups; m recomputed from the stored zero), so its error is at most about
    (K/32 + 16) 2^-24 sum |x| (|s| q + |m|), taken twice as generously; on int8 activations each input is also
    off by up to half its group's step (`cpu_kernels.activation_error`) in the s q terms (the m terms take the
    float sum of x): sum |dx| |s| q."""
    w = layer.dequantize().double()
    xa = x.double().abs()
    exact = x.double() @ w.t()
    if not layer.rounds_inputs():
        magnitude = layer.block_magnitude().double()
        bound = (layer.in_features / GROUP + 16) * 2.0**-23 * (xa @ magnitude.t())
        if layer.int8_activations():
            bound = bound + cpu_kernels.activation_error(x) @ layer.scaled_values().double().t() * (1 + 2.0**-20)
        return bound
    weights = xa @ layer.weight_error_bound().double().t()
    inputs = BF16_U * (xa @ w.abs().t())
    accumulate = layer.in_features * 2.0**-23 * (xa @ w.abs().t())
    return weights + inputs + BF16_U * (exact.abs() + weights + inputs) + accumulate


def block_kernels(model: nn.Module) -> str | None:
    """Which kernels a model's quantized layers multiply through: "bf16" when any rounds its inputs to bf16
    (torch's; the model then attends in float64: attention.py), "int8" when they run the block kernels and some
    take int8 activations, "float32" when they all run the float32 block kernels on float32 activations, None when
    no layer runs a quantized kernel."""
    running = [m for m in model.modules() if isinstance(m, QuantLinear) and m.runs_kernel()]
    if not running:
        return None
    if any(m.rounds_inputs() for m in running):
        return "bf16"
    return "int8" if any(m.int8_activations() for m in running) else "float32"


def activations(model: nn.Module) -> str:
    """The precision a model's linear layers take their inputs in (/v1/models, cache keys): "int8" (Q4 and Q8_0
    blocks on int8 activations), "bfloat16" (torch's int4 / int8 kernels round them), else the model's dtype."""
    rounded = {"int8": "int8", "bf16": "bfloat16"}.get(block_kernels(model))
    return rounded or str(next(model.parameters()).dtype).removeprefix("torch.")


QUANT_KINDS: dict[str, type[QuantLinear]] = {"q4": Q4Linear, "q8": Q8Linear, "int8": Int8Linear}
