"""Attention for the engine's batched, masked forwards.

transformers' `sdpa` path copies every layer's cached keys and values to repeat the grouped KV heads
(`repeat_kv`) whenever a custom mask is given and more than one query token is fed: exactly the
verify pass of speculative decoding, so that copy would be paid on every step, proportional to the
whole context. PyTorch's SDPA handles grouped heads itself (`enable_gqa`); this registers an
attention function that uses it, and `use_gqa_attention` switches a loaded model over when it runs
plain `sdpa` (other implementations, such as flash attention on GPUs, are left alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

NAME = "specula_gqa_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [batch, 1, q_len, kv_len] additive, or None for causal
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query, key, value,
        attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None  # [batch, q_len, heads, head_dim]


AttentionInterface.register(NAME, gqa_sdpa_attention)


def use_gqa_attention(model: PreTrainedModel) -> None:
    """Switch a model running plain `sdpa` to the grouped-head SDPA above."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
