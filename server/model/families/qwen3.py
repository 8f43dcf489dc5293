"""Qwen3: Llama's layers with an RMSNorm over each head of q and of k before RoPE, no biases, an explicit
head_dim (128 on every released size, not hidden / heads). GGUF files give it as `attention.key_length`."""

from __future__ import annotations

from typing import Any

from server.model.families.base import Family, Spec, standard_spec


def spec(config: Any) -> Spec:
    return standard_spec("qwen3", config, qk_norm=True)


def gguf_config(fields: dict[str, Any], config: Any) -> None:
    """transformers' GGUF reader leaves Qwen3's head_dim at its config default: the file's key length wins."""
    if (size := fields.get("qwen3.attention.key_length")) is not None:
        config.head_dim = int(size)


FAMILY = Family(name="qwen3", model_types=("qwen3",), gguf_arch="qwen3", spec=spec, gguf_config=gguf_config)
