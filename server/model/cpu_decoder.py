"""A Llama model's decoder stack on the float32 block kernels in one C call per forward (CPU).

Decoding and verify passes of a small model on a CPU are dispatch, not arithmetic: SmolLM2-135M as its Q4_1
file runs 30 layers of about 30 torch operations each (norms, projections, RoPE, cache writes, attention,
residuals), ~900 calls of a few microseconds for ~3 ms of kernels (a one-token step measured 12.9 ms on the
2-core development machine). `CpuDecoder` runs the same layers as one call into cpu_kernels.py's
`decoder_forward`: per layer RMSNorm, the fused q/k/v kernel, RoPE, the new keys and values written into the
engine's cache (`BatchKV`: the same columns `BufferLayer.update` writes, in the cache's dtype: float32, or float16
or bfloat16 rounded to nearest as it rounds them), attention, the output projection and
residual, RMSNorm, the fused gate/up kernel, SiLU times up, the down projection and residual, with one thread
team for the whole stack.

Attention here reads, for each query, only the cache columns its mask lets it see, in column order (which is
token order: the cache keeps each row's live tokens in order), in runs of 256 live keys (threads share a long
context's runs out; each run's softmax parts are merged in run order), and sums scores, softmax and values over
them in one fixed order. Consecutive queries of one row (a prompt chunk, a verify pass) are attended in blocks of
8 that read and convert each key and value once, the query heads of a KV head with them; per query the operations
are the same whatever the block. A position's result therefore depends on its row's tokens only: not on holes,
other rows, where a pass starts, how many tokens it feeds or how a step's budget cuts a prompt into chunks, so a
token gets the same bits in a plain step, in any verify pass, in any prompt chunk and beside any other rows (tests
check it). The other operations are per row, as the block kernels are.

Every pass of the model runs here: steps, verify passes, prompt chunks short or deep, and passes that hold both
(chunked prefill beside decoding rows). Measured on the 2-core AVX2 host with int8 activations, a 128-token prompt
chunk takes 116-125 ms at the start of a prompt, 235-253 at 1,000 tokens in and 342-349 at 2,000 (medians of 7;
the lean forward's torch path, PyTorch's SDPA, took 205-313 / 401-407 / 470-497 when last compared): faster, and
the same bits for a position whichever pass computes it, which is what lets the linear layers take int8 activations
(cpu_kernels.py: an activation's rounding would turn two paths' float differences into steps).

Used when every layer qualifies (`CpuDecoder.of`): q, k, v and gate, up fused on the float32 block kernels
without biases, o and down on them too, RMSNorm, head and hidden sizes multiples of 16 (the kernels' vectors),
float32 activations; anything else keeps the lean forward's layers. `SPECULA_CPU_DECODER=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from server.model import cpu_kernels
from server.model.cpu_kernels import Tiles
from server.model.decoder import layer_norms, norm_weight
from server.model.decoder import signed_sin as signed
from server.model.families.base import Spec
from server.model.kv_layers import KVBudgetExceeded

KEY_RUN = 256  # cpu_kernels.py's KCHUNK: attention shares a query's keys out between threads in runs this long
QUERY_BLOCK = 8  # cpu_kernels.py's QBLOCK: a row's consecutive queries attended together

_i64 = ctypes.c_int64


class _Weights(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("tiles", _i64), ("K", _i64), ("kind", ctypes.c_int32), ("scales", ctypes.c_int32)]


class _Product(ctypes.Structure):
    _fields_ = [("part", _Weights * 3), ("parts", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("attn_in", "attn_out", "ffn_in", "ffn_out", "q_norm",
                                                     "k_norm")] + \
               [(name, _Product) for name in ("qkv", "o", "gate_up", "down")] + [("window", _i64), ("rope", _i64)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "qkv_ld", "k_off",
                                           "v_off", "gu_ld", "u_off", "o_ld", "down_ld")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_kind", _i64), ("rot_dim", _i64),
                ("act", _i64), ("softcap", ctypes.c_float), ("unused", ctypes.c_float)]


SIZES = (_Weights, _Product, _Layer, _Dims)  # csrc/specula.h's structs, in `cpu_kernels.abi`'s order
KV_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the cache's storage dtype -> dims.kv_kind
ACT = {"silu": 0, "gelu_tanh": 1}  # dims.act


def _weights(tiles: Tiles) -> _Weights:
    bias = tiles.bias.data_ptr() if tiles.bias is not None else None
    return _Weights(tiles.q.data_ptr(), tiles.s.data_ptr(), tiles.m.data_ptr(), bias, tiles.tiles, tiles.in_features,
                    tiles.kind, tiles.scales)


def _product(parts: list[Tiles]) -> _Product:
    product = _Product()
    for i, tiles in enumerate(parts):
        product.part[i] = _weights(tiles)
    product.parts = len(parts)
    return product


def _width(parts: list[Tiles]) -> int:
    return sum(t.tiles for t in parts) * 16


def enabled() -> bool:
    return os.environ.get("SPECULA_CPU_DECODER", "1").lower() not in ("0", "false", "no", "off")


def _parts(both: object, kernels: tuple, fused: str, single: tuple[int, ...]) -> list[Tiles] | None:
    """A layer's q/k/v (or gate/up) products as the C decoder takes them: the fused kernel, or its layers one by
    one (layers of different block types: a Q4_K_M file's Q6_K v beside Q4_K q and k); None when one is not on the
    block kernels."""
    parts = [getattr(both, fused)] if both is not None else [kernels[j] for j in single]
    return parts if all(isinstance(t, Tiles) for t in parts) else None


def _norm(module: nn.Module | None) -> torch.Tensor | None:
    return norm_weight(module).detach().float().contiguous() if module is not None else None


class CpuDecoder:
    """The decoder layers of one lean forward (lean_forward.py) as `decoder_forward` calls."""

    def __init__(self, lib: ctypes.CDLL, base: nn.Module, spec: Spec, products: list[tuple[list[Tiles], ...]]
                 ) -> None:
        self.lib = lib
        config, attn = base.config, base.layers[0].self_attn
        qkv, o, gate_up, down = products[0]
        self.hidden, self.head_dim = config.hidden_size, attn.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        q_size, k_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.inter = down[0].in_features
        self.sets = max(spec.rope_sets) + 1
        self.rot = spec.rotary_dim
        self.dims = _Dims(self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, _width(qkv), q_size,
                          q_size + k_size, _width(gate_up), self.inter, _width(o), _width(down),
                          layer_norms(base.layers[0])[0].variance_epsilon, spec.scaling, 0, self.rot,
                          ACT[spec.activation], spec.attn_softcap or 0.0, 0.0)
        self.layers = (_Layer * len(base.layers))()
        self.keep: list[object] = []  # what the pointers point into: alive as long as this decoder
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(base.layers, products, strict=True)):
            norms = [_norm(n) for n in layer_norms(layer)]
            qk = [_norm(getattr(layer.self_attn, n, None)) for n in ("q_norm", "k_norm")]
            self.keep += [*norms, *qk, *qkv, *o, *gate_up, *down]
            pointer = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
            self.layers[i] = _Layer(*(pointer(t) for t in (*norms, *qk)), _product(qkv), _product(o),
                                    _product(gate_up), _product(down), spec.windows[i], spec.rope_sets[i])
        self.count = len(base.layers)
        # the final RMSNorm too, where it is one with the layers' epsilon (a draft head's decoder has none)
        norm, first_norm = base.norm, layer_norms(base.layers[0])[0]
        self.final = None
        if type(norm) is type(first_norm) and norm.variance_epsilon == first_norm.variance_epsilon \
                and norm.weight.shape == (self.hidden,):
            self.final = _norm(norm)
            self.keep.append(self.final)
        self.scratch = self.hidden + self.dims.qkv_ld + self.heads * self.head_dim + \
            max(self.dims.o_ld, self.dims.down_ld) + self.dims.gu_ld + self.inter + \
            cpu_kernels.scratch_per_row(max(self.inter, self.heads * self.head_dim, self.hidden))  # floats per token

    @classmethod
    def of(cls, base: nn.Module, spec: Spec, fused: list, linears: list) -> CpuDecoder | None:
        """The decoder for a lean forward's layers, or None when one does not qualify (module doc)."""
        lib = cpu_kernels.library()
        if lib is None or not enabled() or not base.layers:
            return None
        if cpu_kernels.abi(lib) != tuple(ctypes.sizeof(t) for t in SIZES):
            return None  # structs out of step with csrc/specula.h: the lean forward's layers serve
        config = base.config
        if next(base.parameters()).dtype != torch.float32 or next(base.parameters()).device.type != "cpu":
            return None
        head_dim, hidden = spec.head_dim, config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if head_dim % 16 or head_dim > 256 or hidden % 16 or spec.rotary_dim % 2 or spec.rotary_dim > head_dim:
            return None
        if heads % kv_heads or heads // kv_heads > 16:  # query heads per KV head: the C attention holds up to 16
            return None
        eps = layer_norms(base.layers[0])[0].variance_epsilon
        products = []
        for layer, both, kernels in zip(base.layers, fused, linears, strict=True):
            qkv, gate_up = _parts(both, kernels, "qkv", (0, 1, 2)), _parts(both, kernels, "gate_up", (4, 5))
            o, down = [kernels[3]], [kernels[6]]
            if qkv is None or gate_up is None or not isinstance(o[0], Tiles) or not isinstance(down[0], Tiles):
                return None
            attn = layer.self_attn
            if attn.head_dim != head_dim or attn.scaling != spec.scaling:
                return None
            if [t.out for t in qkv] not in ([heads * head_dim + 2 * kv_heads * head_dim],
                                            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]):
                return None
            if o[0].in_features != heads * head_dim or o[0].out != hidden:
                return None
            inter = down[0].in_features
            if inter % 16 or sum(t.out for t in gate_up) != 2 * inter or down[0].out != hidden:
                return None
            if len(gate_up) == 2 and gate_up[0].out != inter:
                return None
            if len(qkv) == 3 and (qkv[0].tiles * 16, qkv[1].tiles * 16) != (heads * head_dim, kv_heads * head_dim):
                return None  # k and v start where the kernel's padded outputs of q (and k) end
            norms = [n for n in layer_norms(layer) if n is not None] + \
                [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
            if spec.qk_norm != hasattr(attn, "q_norm"):
                return None
            for norm in norms:
                if getattr(norm, "variance_epsilon", None) != eps or norm.weight.shape[0] not in (hidden, head_dim):
                    return None
            products.append((qkv, o, gate_up, down))
        return cls(lib, base, spec, products)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether a forward from activations `x` runs here (float32 on the CPU: every pass of the model it was
        built for, steps, verify passes and prompt chunks alike)."""
        return x.dtype == torch.float32 and x.device.type == "cpu"

    def __call__(
        self,
        x: torch.Tensor,  # [batch, W, hidden] or packed [1, N, hidden] (a fresh tensor: updated in place)
        rotations: list[tuple[torch.Tensor, torch.Tensor]],  # per rotary set (cos, sin) [batch, W, rot] / [1, N, rot]
        mask: torch.Tensor,  # [batch, 1, W, length + W] additive
        cache: object,  # kv_layers.BatchCache
        packing: object | None,  # attention.Packing
        states: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x after the last layer and the final norm where `final` holds it (same shape) and, when `states`, after
        each layer."""
        shape = x.shape
        layers = cache.layers
        owner = layers[0].owner
        start = owner.length
        if packing is not None:
            rows, steps, width = packing.rows, packing.steps, packing.width
        else:
            batch, width = shape[0], shape[1]
            rows = torch.arange(batch).repeat_interleave(width)
            steps = torch.arange(width).repeat(batch)
        for layer in layers:
            if not layer.is_initialized:
                like = x.new_empty(1, self.kv_heads, 1, self.head_dim)
                layer.lazy_initialization(like, like)
        # keys and values written in the cache's dtype, rounded as BufferLayer.update rounds them, and read back
        self.dims.kv_kind = KV_KIND[layers[0].keys.dtype]
        capacity = layers[0].keys.shape[2]
        if start + width > min(owner.capacity, capacity):
            raise KVBudgetExceeded("a forward wrote past the reserved columns (runner.forward reserves them)")
        flat = x.reshape(-1, self.hidden).clone()  # the residual stream, updated in place
        n = flat.shape[0]
        mask = mask.to(torch.float32).contiguous()
        length = mask.shape[-1]
        cols = start + steps
        mask_rows = rows * width + steps
        cos = torch.stack([c.reshape(n, self.rot) for c, _ in rotations[: self.sets]]).contiguous()
        signed_sin = torch.stack([signed(s.reshape(n, self.rot)) for _, s in rotations[: self.sets]]).contiguous()
        threads = torch.get_num_threads()
        group = self.heads // self.kv_heads
        work = torch.empty(n * self.scratch + threads * (QUERY_BLOCK * group * (KEY_RUN + 16) + 32 * self.head_dim))
        live = torch.empty(n * (length + 1), dtype=torch.int32)
        runs = n * self.kv_heads * (length // KEY_RUN + 1)  # attention's work items, at most
        first = torch.empty(2 * n + 2, dtype=torch.int64)
        items = torch.empty(runs, dtype=torch.int64)
        parts = torch.empty(runs * self.heads // self.kv_heads * (self.head_dim + 2))
        out = torch.empty(self.count, n, self.hidden) if states else None
        pointers = ctypes.c_void_p * self.count
        keys = pointers(*(layer.keys.data_ptr() for layer in layers))
        values = pointers(*(layer.values.data_ptr() for layer in layers))
        self.lib.decoder_forward(
            ctypes.byref(self.dims), self.layers, self.count, keys, values, capacity,
            flat.data_ptr(), n, cos.data_ptr(), signed_sin.data_ptr(), rows.data_ptr(), cols.data_ptr(),
            mask_rows.data_ptr(), mask.data_ptr(), length, out.data_ptr() if out is not None else None,
            self.final.data_ptr() if self.final is not None else None, work.data_ptr(), live.data_ptr(),
            first.data_ptr(), items.data_ptr(), parts.data_ptr(), threads,
        )
        return flat.view(shape), [s.view(shape) for s in out] if out is not None else []
