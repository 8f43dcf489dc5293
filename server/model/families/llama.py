"""Llama (Llama 2 / 3 / 3.x, SmolLM, TinyLlama...): RMSNorm, SiLU-gated MLP, grouped-query attention, RoPE (Llama 3's
frequency scaling included), optional biases. llama.cpp's converter stores q and k rows permuted per head."""

from __future__ import annotations

from typing import Any

from server.model.families.base import Family, Spec, standard_spec


def spec(config: Any) -> Spec:
    return standard_spec("llama", config)


FAMILY = Family(name="llama", model_types=("llama",), gguf_arch="llama", spec=spec, permuted_qk=True)
