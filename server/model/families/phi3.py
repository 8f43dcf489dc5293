"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layers with q, k, v stored as one `qkv_proj` and gate, up as one
`gate_up_proj` (split into the tree's layers on load; the kernels fuse them again), partial rotary where the
config's `partial_rotary_factor` says, and the config's sliding window in every layer (as transformers applies it).
The 128k-context variants' `longrope` changes its frequencies with the sequence length: not served here."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.model.families.base import Family, Spec, head_dim, standard_spec


def spec(config: Any) -> Spec:
    window = int(getattr(config, "sliding_window", None) or 0)
    return replace(standard_spec("phi3", config), windows=(window,) * config.num_hidden_layers)


def _qkv(config: Any) -> tuple[tuple[str, int], ...]:
    d = head_dim(config)
    return (("q_proj", config.num_attention_heads * d), ("k_proj", config.num_key_value_heads * d),
            ("v_proj", config.num_key_value_heads * d))


def _gate_up(config: Any) -> tuple[tuple[str, int], ...]:
    return (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size))


FAMILY = Family(name="phi3", model_types=("phi3",), gguf_arch="phi3", spec=spec,
                fused={"self_attn.qkv_proj": _qkv, "mlp.gate_up_proj": _gate_up})
