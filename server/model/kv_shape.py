"""What one token of a model's KV cache holds, and how many tokens a byte budget buys (the KV budget)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """What one token of one model's cache holds per layer: keys [kv_heads, head_dim] and values
    [kv_heads, value_dim] in `dtype`."""

    num_layers: int
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.kv_heads * (self.head_dim + self.value_dim) * size

    @classmethod
    def of(cls, config: object, dtype: torch.dtype) -> KVShape:
        """From a Hugging Face (Llama-like) config."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, head_dim, dtype)


def slots_for(budget_bytes: int, shapes: list[KVShape]) -> int:
    """Token slots a budget buys when every cache in `shapes` holds the same number of tokens."""
    per_token = sum(s.bytes_per_token for s in shapes)
    return max(0, math.floor(budget_bytes / per_token)) if per_token else 0
