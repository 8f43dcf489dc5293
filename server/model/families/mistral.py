"""Mistral: Llama's layers with a sliding window over the keys in every layer where the config sets one (Mistral 7B
v0.1: 4096; later versions none). llama.cpp converts Mistral checkpoints to the `llama` GGUF architecture."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.model.families.base import Family, Spec, standard_spec


def spec(config: Any) -> Spec:
    window = int(getattr(config, "sliding_window", None) or 0)
    base = standard_spec("mistral", config)
    return replace(base, windows=(window,) * config.num_hidden_layers)


FAMILY = Family(name="mistral", model_types=("mistral",), gguf_arch="mistral", spec=spec, permuted_qk=True)
