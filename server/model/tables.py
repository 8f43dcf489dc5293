"""Embedding tables and the LM head over them, as a GGUF file holds them or as fp16 values.

An embedding table held as fp16 values (`Fp16Table`: a file's F16 table, or a checkpoint's head under `int8`)
is multiplied as the LM head in fp32 (activations in, logits out: bf16 logits, the int4 kernel's output type,
would round a logit of 20 to steps of 0.125 and make near-ties exact ties) through the float32 block kernels'
fp16 tiles (cpu_kernels.py: a row's logits the same bits in any batch), or, where those do not build, fbgemm's
fp16 GEMM called on a fixed number of rows at a time (`FBGEMM_ROWS`): on an AVX2 host fbgemm's fp16 kernels sum a
row in an order that depends on how many rows the call holds (the same row gave other last bits alone, in 2 or in
7 rows), while in calls of one size every row gets the same bits. Measured on the 2-core development machine
(576 x 49152, one thread, CPU time, ms for 1 / 4 / 9 rows): fp16 fbgemm 2.1 / 3.2 / 5.7, Q8_0 through the int4 kernel
3.2 / 5.7 / 14.3, per-channel int8 3.5 / 5.6 / 14.3, bf16 oneDNN 3.7 / 2.8 / 3.8 (docs/bench.md).

A table held as the file's Q8_0 or Q6_K blocks (`BlockTable`) is looked up exactly and multiplied as its head
through the block kernels (Q6_K's scales per 16 inputs on int8 activations).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from server.model import cpu_kernels
from server.model.quantized import Kernel, _packed_from

HEAD_SLICE_ROWS = 16384  # rows of an fp16 LM head packed per fbgemm matrix (`TableHead`)
FBGEMM_ROWS = 8  # activation rows of every fbgemm fp16 call (the last call padded): the module doc says why
GROUP = 32


def has_fp16_gemm() -> bool:
    """Whether fbgemm's fp16-weight GEMM (fp32 in and out) is built into this torch."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_prepack_fp16"
    )


class Fp16Table(nn.Module):
    """An embedding table held as fp16 values of the file's weights (`weight` [vocab, hidden], a buffer): looked
    up as the model's input embeddings (fp32 rows out) and, tied, multiplied as its LM head (`TableHead`)."""

    kind = "fp16 table"  # the start-up log's name (loading.describe_weights)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(torch.float16).contiguous())
        self.num_embeddings, self.embedding_dim = weight.shape
        self.tiles: cpu_kernels.Tiles | None = None  # the tied head's kernel layout, once built (`TableHead`)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The table's rows `ids` in fp32: [..., hidden] (from the head kernel's tiles once they alone hold them)."""
        if self.tiles is None or self.weight.numel():
            return F.embedding(ids, self.weight).float()
        rows = self.tiles.values(ids.reshape(-1))  # the same values
        return rows.float().view(*ids.shape, self.embedding_dim)

    def release(self) -> list[torch.Tensor]:
        """Drop the table's own values once the head kernel's tiles hold them (lookups read those): a tied table
        is then held once. Returns what was dropped."""
        if self.tiles is None or not self.weight.numel():
            return []
        dropped = [self.weight]
        self.weight = torch.empty(0, self.embedding_dim, dtype=torch.float16, device=self.weight.device)
        return dropped


class BlockTable(nn.Module):
    """An embedding table held as the file's Q8_0 or Q6_K blocks (`qweight` [vocab, hidden] int8, `scales` [vocab,
    hidden/32] fp32, or [vocab, hidden/16] for Q6_K, buffers): looked up exactly (d q in fp32, the file's values)
    and, tied, multiplied as its LM head (`TableHead`) through the block kernels. Fewer bytes than an fp16 copy,
    which would round d q to 11 bits. It has no dense `weight`: `rows(ids)` gives rows of it, `dequantize()` the
    whole (a copy)."""

    kind = "q8 table"  # the start-up log's name (loading.describe_weights)

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.group = self.embedding_dim // scales.shape[1]  # inputs a scale covers: 32 (Q8_0) or 16 (Q6_K)
        self.tiles: cpu_kernels.Tiles | None = None  # the tied head's kernel layout, once built (`TableHead`)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The table's rows `ids` in fp32: [..., hidden] (from the head kernel's tiles once it holds them)."""
        if self.tiles is not None:
            q, d = self._from_tiles(ids.reshape(-1))
            q, d = q.view(*ids.shape, -1), d.view(*ids.shape, -1)
        else:
            q, d = self.qweight[ids].float(), self.scales[ids]
        return (q.view(*q.shape[:-1], -1, self.group) * d[..., None]).view(q.shape)

    def _from_tiles(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, hidden] (as floats) and d [n, hidden/32] of rows `ids`, read from the tiles [T, K, 16] / [T, G, 16]."""
        tiles = self.tiles
        return tiles.values(ids).float(), tiles.group_scales(ids)

    def release(self) -> list[torch.Tensor]:
        """Drop the table's own blocks once the head kernel's tiles hold the same values (lookups read those):
        a server's tied table is then held once. Returns what was dropped."""
        if self.tiles is None or not self.qweight.numel():
            return []
        dropped = [self.qweight, self.scales]
        self.qweight = torch.empty(0, self.embedding_dim, dtype=torch.int8, device=self.qweight.device)
        self.scales = torch.empty(0, self.embedding_dim // self.group, device=self.scales.device)
        return dropped

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.num_embeddings, device=self.qweight.device))


def _fbgemm_fp16(x: torch.Tensor, slices: list[torch.Tensor]) -> torch.Tensor:
    """x [..., K] times packed fp16 slices of a head, side by side, in calls of `FBGEMM_ROWS` rows each (the last
    padded with zeros): a row's logits the same bits in any batch (the module doc)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    rows = flat.shape[0]
    padded = -rows % FBGEMM_ROWS
    if padded:
        flat = torch.cat([flat, flat.new_zeros(padded, flat.shape[1])])
    gemm = torch.ops.quantized.linear_dynamic_fp16
    out = torch.cat([torch.cat([gemm(part.contiguous(), s) for s in slices], dim=-1)
                     for part in flat.split(FBGEMM_ROWS)])
    return out[:rows].view(*x.shape[:-1], -1)


def table_dtype(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device an embedding table or LM head holds its values in (a quantized table's: fp16, what
    a draft head reading it plans for), without building a dense copy."""
    table = getattr(module, "table", module)
    if isinstance(table, BlockTable):
        return torch.float16, table.qweight.device
    return module.weight.dtype, module.weight.device


class TableHead(nn.Module):
    """The LM head over an `Fp16Table` or a `BlockTable` (tied: the input embeddings'; or a matrix of its own):
    fp32 activations in, fp32 logits out. A `BlockTable` multiplies through the float32 block kernel
    (cpu_kernels.py); fp16 values through fbgemm's fp16 GEMM on CPU (see the module doc); elsewhere `F.linear`
    by the fp32 values."""

    def __init__(self, table: Fp16Table | BlockTable) -> None:
        super().__init__()
        self.table = table  # shared with the input embeddings when tied
        self.in_features, self.out_features = table.embedding_dim, table.num_embeddings
        self._kernel: Kernel | None = None

    @property
    def weight(self) -> torch.Tensor:
        if isinstance(self.table, BlockTable):
            raise AttributeError("a Q8_0 table head holds no dense weight (BlockTable.rows / dequantize)")
        return self.table.weight

    def kernel(self) -> Kernel:
        if self._kernel is None:
            self._kernel = self._build()
        return self._kernel

    def _build(self) -> Kernel:
        table = self.table
        if isinstance(table, BlockTable):
            lib = cpu_kernels.library() if table.qweight.device.type == "cpu" else None
            if lib is not None:
                table.tiles = cpu_kernels.Tiles.q8(table.qweight, table.scales, lib)
                _packed_from(table)  # the blocks' file pages: lookups read the tiles from now on (`BlockTable.rows`)
                return table.tiles
            weight = table.dequantize().half()  # fbgemm's fp16 GEMM below, or F.linear
        else:
            weight = table.weight
            lib = cpu_kernels.library() if weight.device.type == "cpu" else None
            if lib is not None and table.embedding_dim % GROUP == 0:
                table.tiles = cpu_kernels.Tiles.f16(weight, lib)
                _packed_from(table)  # the values' file pages: the tiles are a copy
                return table.tiles
        if weight.device.type == "cpu" and has_fp16_gemm():
            try:
                # packed a slice of rows at a time: the fp32 copy fbgemm packs from is a slice's, not the
                # table's (113 MB for SmolLM2); the logits are the slices' side by side, the same sums
                slices = [torch.ops.quantized.linear_prepack_fp16(part.float(), None)
                          for part in weight.split(HEAD_SLICE_ROWS)]
                if not isinstance(table, BlockTable):
                    _packed_from(table)  # the embeddings read it a row per token from here on
                return lambda x: _fbgemm_fp16(x, slices)
            except RuntimeError:
                pass
        return lambda x: F.linear(x, weight.to(x.dtype))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TableHead:  # type: ignore[override]
        self._kernel = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.kernel()(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)


def model_head_as_table(model: nn.Module) -> None:
    """A causal LM's LM head as a `TableHead` over fp16 values of its weights (fp32 logits; quantized
    layers' bf16 outputs would round them), sharing one `Fp16Table` with the input embeddings when tied."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    table = Fp16Table(head.weight.detach())
    if embed is not None and embed.weight is head.weight:
        model.set_input_embeddings(table)
    model.set_output_embeddings(TableHead(table))
