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
from server.model.kv_layers import KVBudgetExceeded

KEY_RUN = 256  # cpu_kernels.py's KCHUNK: attention shares a query's keys out between threads in runs this long
QUERY_BLOCK = 8  # cpu_kernels.py's QBLOCK: a row's consecutive queries attended together

_i64 = ctypes.c_int64


class _Weights(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("m", ctypes.c_void_p), ("tiles", _i64),
                ("K", _i64), ("kind", ctypes.c_int32), ("unused", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("qkv", _Weights), ("o", _Weights),
                ("gate_up", _Weights), ("down", _Weights)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "qkv_ld", "k_off",
                                           "v_off", "gu_ld", "u_off", "o_ld", "down_ld")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_kind", _i64)]

KV_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the cache's storage dtype -> dims.kv_kind


def _weights(tiles: Tiles) -> _Weights:
    return _Weights(tiles.q.data_ptr(), tiles.s.data_ptr(), tiles.m.data_ptr(), tiles.tiles, tiles.in_features,
                    tiles.kind, 0)


def enabled() -> bool:
    return os.environ.get("SPECULA_CPU_DECODER", "1").lower() not in ("0", "false", "no", "off")


class CpuDecoder:
    """The decoder layers of one lean forward (lean_forward.py) as `decoder_forward` calls."""

    def __init__(self, lib: ctypes.CDLL, base: nn.Module, fused: list, linears: list) -> None:
        self.lib = lib
        config, attn = base.config, base.layers[0].self_attn
        first = fused[0]
        q_size, k_size, _ = first.qkv_sizes
        self.hidden, self.head_dim = config.hidden_size, attn.head_dim
        self.heads, self.kv_heads = q_size // attn.head_dim, k_size // attn.head_dim
        self.inter = linears[0][6].in_features
        self.dims = _Dims(self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter,
                          first.qkv.tiles * 16, q_size, q_size + k_size, first.gate_up.tiles * 16, self.inter,
                          linears[0][3].tiles * 16, linears[0][6].tiles * 16,
                          base.layers[0].input_layernorm.variance_epsilon, attn.scaling)
        self.layers = (_Layer * len(base.layers))()
        self.keep: list[object] = []  # what the pointers point into: alive as long as this decoder
        for i, (layer, both, kernels) in enumerate(zip(base.layers, fused, linears, strict=True)):
            norms = (layer.input_layernorm.weight.detach().float().contiguous(),
                     layer.post_attention_layernorm.weight.detach().float().contiguous())
            self.keep += [*norms, both.qkv, both.gate_up, kernels[3], kernels[6]]
            self.layers[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), _weights(both.qkv),
                                    _weights(kernels[3]), _weights(both.gate_up), _weights(kernels[6]))
        self.count = len(base.layers)
        # the final RMSNorm too, where it is one with the layers' epsilon (a draft head's decoder has none)
        norm, first_norm = base.norm, base.layers[0].input_layernorm
        self.final = None
        if type(norm) is type(first_norm) and norm.variance_epsilon == first_norm.variance_epsilon \
                and norm.weight.shape == (self.hidden,):
            self.final = norm.weight.detach().float().contiguous()
            self.keep.append(self.final)
        self.scratch = self.hidden + self.dims.qkv_ld + self.heads * self.head_dim + \
            max(self.dims.o_ld, self.dims.down_ld) + self.dims.gu_ld + self.inter + \
            cpu_kernels.scratch_per_row(max(self.inter, self.heads * self.head_dim, self.hidden))  # floats per token

    @classmethod
    def of(cls, base: nn.Module, fused: list, linears: list) -> CpuDecoder | None:
        """The decoder for a lean forward's layers, or None when one does not qualify (module doc)."""
        lib = cpu_kernels.library()
        if lib is None or not enabled() or not base.layers:
            return None
        if cpu_kernels.abi(lib) != (ctypes.sizeof(_Weights), ctypes.sizeof(_Layer), ctypes.sizeof(_Dims)):
            return None  # structs out of step with csrc/specula.h: the lean forward's layers serve
        config = base.config
        if next(base.parameters()).dtype != torch.float32 or next(base.parameters()).device.type != "cpu":
            return None
        attn0, norm0 = base.layers[0].self_attn, base.layers[0].input_layernorm  # LeanForward.of: RMSNorms
        head_dim = getattr(attn0, "head_dim", 0)
        if not head_dim or head_dim % 16 or head_dim > 256 or config.hidden_size % 16:
            return None
        for layer, both, kernels in zip(base.layers, fused, linears, strict=True):
            if both is None or not all(isinstance(k, Tiles) for k in (both.qkv, both.gate_up, kernels[3], kernels[6])):
                return None
            attn = layer.self_attn
            q_size, k_size, v_size = both.qkv_sizes
            if attn.head_dim != head_dim or k_size != v_size or q_size % head_dim or k_size % head_dim:
                return None
            if (q_size // head_dim) % (k_size // head_dim) or attn.scaling != attn0.scaling:
                return None
            if q_size // k_size > 16:  # query heads per KV head: the C attention holds up to 16
                return None
            if kernels[3].in_features != q_size or kernels[3].out != config.hidden_size:
                return None
            inter = kernels[6].in_features
            if inter % 16 or both.gate_up.out != 2 * inter or kernels[6].out != config.hidden_size:
                return None
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if type(norm) is not type(norm0) or norm.variance_epsilon != norm0.variance_epsilon \
                        or norm.weight.shape != (config.hidden_size,):
                    return None
        return cls(lib, base, fused, linears)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether a forward from activations `x` runs here (float32 on the CPU: every pass of the model it was
        built for, steps, verify passes and prompt chunks alike)."""
        return x.dtype == torch.float32 and x.device.type == "cpu"

    def __call__(
        self,
        x: torch.Tensor,  # [batch, W, hidden] or packed [1, N, hidden] (a fresh tensor: updated in place)
        cos: torch.Tensor,  # [batch, W, d] / [1, N, d]
        signed_sin: torch.Tensor,
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
        cos = cos.reshape(n, self.head_dim).contiguous()
        signed_sin = signed_sin.reshape(n, self.head_dim).contiguous()
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
