"""Qwen2 / Qwen2.5: Llama's layers with biases on the q, k and v projections (the weights carry them), a sliding
window only where `use_sliding_window` turns it on."""

from __future__ import annotations

from typing import Any

from server.model.families.base import Family, Spec, standard_spec


def spec(config: Any) -> Spec:
    return standard_spec("qwen2", config, qkv_bias=True, o_bias=False)


FAMILY = Family(name="qwen2", model_types=("qwen2",), gguf_arch="qwen2", spec=spec)
