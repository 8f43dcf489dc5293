"""Attention for the engine's batched, masked forwards, padded or packed.

transformers' `sdpa` path copies every layer's cached keys and values to repeat the grouped KV heads
(`repeat_kv`) whenever a custom mask is given and more than one query token is fed: exactly the
verify pass of speculative decoding, so that copy would be paid on every step, proportional to the
whole context. PyTorch's SDPA handles grouped heads itself (`enable_gqa`); this registers an
attention function that uses it, and `use_gqa_attention` switches a loaded model over when it runs
plain `sdpa` (other implementations, such as flash attention on GPUs, are left alone).

Packed forwards. When the rows of a verify pass feed different numbers of tokens (one row drafts 16,
the others none), padding every row to the widest would make the model's linear layers, the bulk of a
small model's compute, run on rows x width positions. A packed forward feeds the real tokens only, as
one sequence [1, N] (`Packing` says which row and step each is); the cache writes each token into its
row's column (`kv_cache.py`), and attention, the one place rows must be told apart, scatters the
queries back into the batch's padded layout [rows, W] and gathers the outputs again. On a CPU, where
attention's own cost grows with every padded query, each row's first query is attended in one batched
call and only the rows that feed more run their other queries, one call per row (`Packing.split`).
The packed order puts every row's first token ahead of the others, so that batched call reads a slice
of the queries and the outputs are one concatenation: at 8 rows on 2 cores, a pass where one row
drafts one token costs ~8% more than the plain pass where gathering and scattering per layer cost ~15%.

Wide attention. Greedy output must not depend on the proposer, so a position's logits must be the same
bits whether it is the one token of a step, one of a verify pass's K + 1, or one of a prompt chunk; the
linear layers and norms are (each row alone), attention is not: PyTorch's CPU SDPA takes another path for
1-3 queries than for more, and blocks the key columns by the call's length, so a query gets other last bits
in calls of other widths or beside longer rows. In float32 those differences stay ~1e-7 of a logit (and
greedy text held across proposers on dense float32 weights and on the float32 block kernels of
cpu_kernels.py). torch's int4 kernel (quantized.py's fallback) rounds its inputs to bfloat16, where a
last-bit difference sometimes crosses a rounding boundary and becomes a 2^-8 step: on the built-in model with `--weights
as-file` that changed greedy text with the proposer within 8-18 tokens on 2 of 4 prompts. A model with such
layers therefore attends in float64 (`use_gqa_attention` marks it): each call's differences are then ~1e-16
and vanish when the output is rounded back to float32 (the same 4 prompts, 64 tokens, `none`, `ngram`,
`suffix`, `eagle` and `auto`: identical). Measured on 2 cores, as-file: decoding 6-7% slower (1 and 4 rows),
a 2,000-token prompt's prefill 1.39x (attention is ~40% of a chunk's cost there; float64 halves its speed).
A dense model on CPU attends in float64 too: on an AVX2 host (no AVX-512) SDPA's float32 results for a position
moved by ~1e-5 of a logit with the pass's width and the rows beside it (a tiny model: 9.5e-6; 0 in float64), enough
to change a seeded sample with the proposer. A model on the float32 block kernels runs every pass in the C decoder
(cpu_decoder.py: the same bits in any pass); it attends here in float32 only with `SPECULA_CPU_DECODER=0`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from server.model.quantized import block_kernels

if TYPE_CHECKING:
    from torch import nn

NAME = "specula_gqa_sdpa"


@dataclass(frozen=True)
class Packing:
    """Where the N packed tokens of one forward sit in the batch's padded layout [rows, width].

    Packed order: every fed row's first token (in row order), then the other tokens of each row that
    feeds more, row after row. Each row's first query is then a slice of the packed queries (attended
    in one batched call without a gather) and each row's further queries a contiguous run."""

    rows: torch.Tensor  # [N] long: each packed token's row
    steps: torch.Tensor  # [N] long: its position among the row's new tokens
    counts: tuple[int, ...]  # tokens per row
    fed: tuple[int, ...]  # the rows that feed a token: their first tokens are packed indices 0..len(fed)-1
    rests: tuple[tuple[int, int, int], ...]  # (row, first packed index, how many) of each row's other tokens
    width: int  # the widest row
    split: bool  # attend each row's first query batched and the rest row by row (see the module doc)

    @classmethod
    def of(cls, counts: list[int], device: torch.device) -> Packing:
        width = max(counts)
        fed = tuple(b for b, n in enumerate(counts) if n)
        rests, start = [], len(fed)
        for b, n in enumerate(counts):
            if n > 1:
                rests.append((b, start, n - 1))
                start += n - 1
        rows = [*fed, *(b for b, _, m in rests for _ in range(m))]
        steps = [0] * len(fed) + [j for _, _, m in rests for j in range(1, m + 1)]
        # Padded attention computes rows x width queries; split, about one per row plus the extra
        # queries of the rows that feed more, at a call per such row (worth ~2 queries each on a CPU).
        extra = sum(m for _, _, m in rests)
        split = device.type == "cpu" and len(counts) * width > len(counts) + extra + 2 * len(rests)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(rows), as_tensor(steps), tuple(counts), fed, tuple(rests), width, split)

    @property
    def tokens(self) -> int:
        return len(self.rows)

    def index(self) -> tuple[tuple[int, ...], ...]:
        """Per row, the packed indices of its tokens in order (empty for a row that feeds none)."""
        index: list[tuple[int, ...]] = [() for _ in self.counts]
        for i, b in enumerate(self.fed):
            index[b] = (i,)
        for b, start, m in self.rests:
            index[b] += tuple(range(start, start + m))
        return tuple(index)

    def pieces(self, inputs: Sequence[Sequence]) -> list[Sequence]:
        """Every row's inputs cut into the packed order (`Packing`): concatenated, they are the N tokens."""
        return [inputs[b][:1] for b in self.fed] + [inputs[b][1:] for b, _, _ in self.rests]


WIDE = "specula_wide_attention"  # the attention module's flag: attend in float64 (module doc)


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]; packed: [1, heads, N, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [batch, 1, q_len, kv_len] additive, or None for causal
    dropout: float = 0.0,
    scaling: float | None = None,
    packing: Packing | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    gqa = key.shape[1] != query.shape[1]
    if getattr(module, WIDE, False) and query.dtype != torch.float64:
        mask = attention_mask.double() if attention_mask is not None and attention_mask.is_floating_point() \
            else attention_mask
        out, _ = gqa_sdpa_attention(module, query.double(), key.double(), value.double(), mask, dropout, scaling,
                                    packing, softcap, **kwargs)
        return out.to(query.dtype), None
    if softcap:  # SDPA has no score cap: the scores themselves, grouped by KV head
        return _capped(query, key, value, attention_mask, scaling, softcap, packing), None
    if packing is not None:
        return _packed(query, key, value, attention_mask, scaling, gqa, packing), None
    is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query, key, value,
        attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=gqa,
    )
    return out.transpose(1, 2).contiguous(), None  # [batch, q_len, heads, head_dim]


def _packed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    scaling: float | None, gqa: bool, pack: Packing,
) -> torch.Tensor:
    """Attention of a packed forward's queries [1, heads, N, d] against the batch's cache: returns [1, N, heads, d]."""
    assert mask is not None, "a packed forward needs the batch's padded mask"
    q = query[0].transpose(0, 1)  # [N, heads, d]
    batch, heads, dim = len(pack.counts), q.shape[1], q.shape[2]
    if not pack.split:
        padded = q.new_zeros(batch, pack.width, heads, dim)
        padded[pack.rows, pack.steps] = q
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa
        ).transpose(1, 2)  # [batch, W, heads, d]
        return out[pack.rows, pack.steps][None]
    first_q = q[: len(pack.fed), :, None]  # [fed, heads, 1, d]: each fed row's first query
    if len(pack.fed) < batch:  # rows that feed nothing attend a zero query (discarded)
        first_q = q.new_zeros(batch, heads, 1, dim).index_copy_(0, pack.rows[: len(pack.fed)], first_q)
    firsts = F.scaled_dot_product_attention(
        first_q, key, value, attn_mask=mask[:, :, :1], scale=scaling, enable_gqa=gqa
    )  # [batch, heads, 1, d]
    parts = [firsts[:, :, 0] if len(pack.fed) == batch else firsts[list(pack.fed), :, 0]]
    for b, start, m in pack.rests:
        rest = F.scaled_dot_product_attention(
            q[start : start + m].transpose(0, 1)[None], key[b : b + 1], value[b : b + 1],
            attn_mask=mask[b : b + 1, :, 1 : m + 1], scale=scaling, enable_gqa=gqa,
        )  # [1, heads, m, d]
        parts.append(rest[0].transpose(0, 1))
    return torch.cat(parts)[None]


def _capped(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
    cap: float, pack: Packing | None,
) -> torch.Tensor:
    """Attention with scores cap * tanh(s / cap) before the mask (Gemma 2), for the batch or a packed forward (its
    queries placed in the padded layout first): [batch, q_len, heads, d] / [1, N, heads, d]."""
    if pack is not None:
        q = query[0].transpose(0, 1)  # [N, heads, d]
        padded = q.new_zeros(len(pack.counts), pack.width, *q.shape[1:])
        padded[pack.rows, pack.steps] = q
        out = _capped(padded.transpose(1, 2), key, value, mask, scaling, cap, None)  # [batch, W, heads, d]
        return out[pack.rows, pack.steps][None]
    batch, heads, width, dim = query.shape
    groups = heads // key.shape[1]
    q = query.reshape(batch, key.shape[1], groups * width, dim)  # each KV head's query heads side by side
    scores = q @ key.transpose(2, 3) * (scaling if scaling is not None else dim**-0.5)
    scores = (torch.tanh(scores / cap) * cap).reshape(batch, heads, width, -1)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype).reshape(batch, key.shape[1], groups * width, -1)
    return (weights @ value).view(batch, heads, width, dim).transpose(1, 2).contiguous()


def register_with_transformers() -> None:
    """Make `NAME` an attention implementation transformers' models can name (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, gqa_sdpa_attention)


def use_gqa_attention(model: nn.Module) -> None:
    """Switch a model running plain `sdpa` to the grouped-head SDPA above; a model whose linear layers round
    their inputs to bfloat16 (quantized layers on CPU) attends in float64 (module doc). A transformers model gets
    the function registered with transformers' attention interface (imported here, so a server whose models are
    decoder.py's never imports transformers' modeling stack); decoder.py's modules name it in their config already."""
    if hasattr(model, "set_attn_implementation"):
        register_with_transformers()
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(NAME)
    kernels = block_kernels(model)
    first = next(model.parameters(), None)
    dense_cpu = kernels is None and first is not None and first.device.type == "cpu"
    wide = kernels == "bf16" or dense_cpu
    for module in model.modules():
        if hasattr(module, "q_proj"):  # a decoder layer's attention
            setattr(module, WIDE, wide)


def attends_wide(model: nn.Module) -> bool:
    """Whether `use_gqa_attention` made the model attend in float64 (its first attention module says)."""
    first = next((m for m in model.modules() if hasattr(m, "q_proj")), None)
    return bool(getattr(first, WIDE, False))


def packs(model: nn.Module) -> bool:
    """Whether forwards of `model` can be packed (its attention is the function above)."""
    return model.config._attn_implementation == NAME
