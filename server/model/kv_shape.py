"""What one token of a model's KV cache holds, the precision of its values (`kv_precision`), and how many
tokens a byte budget buys (the KV budget)."""

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


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZED_WEIGHTS = ("as-file", "int8")  # loading.py's quantized formats (not imported: this module stays a leaf)


def kv_precision(setting: str, weights: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the target's keys and values are rounded to when written (the `kv_cache_dtype` setting), or
    None where they stay as the model computes them (the setting is its own dtype or a wider one).

    "auto": float16 where the weights are quantized (`weights` "as-file" or "int8"), as llama.cpp's server
    keeps its cache by default, when the model computes in float32; the model's own dtype otherwise, so a dense
    model is served as it was. A model computing in 16 bits keeps its own values (float32 asked) or refuses
    the other 16-bit type."""
    if setting == "auto":
        wanted = torch.float16 if weights in QUANTIZED_WEIGHTS and model_dtype == torch.float32 else model_dtype
    elif setting in KV_DTYPES:
        wanted = KV_DTYPES[setting]
    else:
        raise ValueError(f"unknown kv_cache_dtype {setting!r}; use auto or one of {', '.join(KV_DTYPES)}")
    if wanted == model_dtype or wanted == torch.float32:
        return None  # float32 holds every value a model computes in float32, bfloat16 or float16 as it is
    if model_dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype {kv_name(wanted, model_dtype)}: the model computes in "
                         f"{kv_name(None, model_dtype)}, whose keys and values it cannot round to another 16-bit "
                         "type; use auto (its own dtype)")
    return wanted


def kv_name(precision: torch.dtype | None, model_dtype: torch.dtype) -> str:
    """The precision of a cache's values as `/v1/models` and the logs name it ("float16", "float32", ...)."""
    return str(precision or model_dtype).removeprefix("torch.")


def slots_for(budget_bytes: int, shapes: list[KVShape]) -> int:
    """Token slots a budget buys when every cache in `shapes` holds the same number of tokens."""
    per_token = sum(s.bytes_per_token for s in shapes)
    return max(0, math.floor(budget_bytes / per_token)) if per_token else 0
