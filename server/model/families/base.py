"""What a model family declares: its names (Hugging Face model types, GGUF architecture, tensor names) and the
description of its decoder (`Spec`) that the torch forward and the C decoder both run from.

A family is data, not code: `Family` holds the names and a `spec(config)` that reads a checkpoint's config into a
`Spec`, and `check(config)` that says why a config is not one the family serves exactly (None when it is). The
forwards (decoder.py's whole-sequence reference, lean_forward.py's batched path, cpu_decoder.py's one C call) read
only the `Spec`, so a family is one file of names and config reading plus one line in the registry
(families/__init__.py).

Worked example (Qwen3-0.6B's config): `QWEN3.spec(config)` gives `Spec(family="qwen3", qk_norm=True,
windows=(0,) * 28, rope_sets=(0,) * 28, head_dim=128, rotary_dim=128, scaling=128 ** -0.5, ...)`: RMSNorm over each
head's q and k before RoPE, full attention in every layer, one set of RoPE frequencies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies fixed at start (no per-length update)


@dataclass(frozen=True)
class Spec:
    """One model's decoder as every forward runs it (shapes come from the config and the weights).

    Per layer: x += post_attn(o(attn(rope(qk_norm(qkv(attn_in(x))))))), x += post_ffn(down(act(gate) * up(
    ffn_in(x)))), with the norms RMSNorms whose weight is (offset + w), the post norms only where `sandwich`."""

    family: str
    head_dim: int
    scaling: float  # attention scores' factor (head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5)
    windows: tuple[int, ...]  # per layer: 0 = every key before a query; W = its last W keys, itself included
    rope_sets: tuple[int, ...]  # per layer: which rotary set it rotates with (0 global, 1 Gemma 3's local one)
    rotary_dim: int  # the leading dimensions of a head RoPE rotates (partial rotary: fewer than head_dim)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): 1 for Gemma's checkpoints, 0 otherwise
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich: bool = False  # norms after attention and after the MLP too (Gemma 2 / 3)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    embed_scale: float | None = None  # input embeddings times this (Gemma: sqrt(hidden))
    attn_softcap: float | None = None  # scores as cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # logits as cap * tanh(logit / cap) (Gemma 2)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2; Llama's `attention_bias`)
    o_bias: bool = False  # a bias on the output projection (Llama's `attention_bias`)
    mlp_bias: bool = False  # biases on the MLP's projections (Llama's `mlp_bias`)

    @property
    def windowed(self) -> bool:
        return any(self.windows)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """A config's RoPE parameters (those of `layer_type` where the config keeps one set per layer type)."""
    parameters = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None and layer_type in parameters:
        parameters = dict(parameters[layer_type] or {})
    if "rope_theta" not in parameters and hasattr(config, "rope_theta"):
        parameters["rope_theta"] = config.rope_theta
    return parameters


def rope_kind(parameters: dict[str, Any]) -> str:
    return str(parameters.get("rope_type", parameters.get("type", "default")))


def head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def layer_types(config: Any) -> list[str]:
    """Each layer's attention kind ("full_attention" / "sliding_attention"), as transformers' configs give it."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds else ["full_attention"] * config.num_hidden_layers


def common_check(config: Any) -> str | None:
    """What every family needs of a config: a known activation and RoPE whose frequencies do not change with the
    sequence length, in every layer type."""
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    types = set(layer_types(config))
    if types - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(types)}"
    for kind in types:
        parameters = rope_parameters(config, kind)
        if rope_kind(parameters) not in STATIC_ROPE:
            return f"RoPE type {rope_kind(parameters)!r}"
        if "rope_theta" not in parameters:
            return "RoPE without rope_theta"
    return None


def windows_of(config: Any) -> tuple[int, ...]:
    """Per layer, the sliding window transformers applies (0: none): `sliding_window` on the layers
    `layer_types` marks sliding (Qwen2 / Qwen3 only with `use_sliding_window`)."""
    window = int(getattr(config, "sliding_window", None) or 0)
    if not getattr(config, "use_sliding_window", True):
        window = 0
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types(config))


@dataclass(frozen=True)
class Family:
    """A model family: the names that identify it and how its config reads into a `Spec`.

    `gguf_arch`: the GGUF `general.architecture` (llama.cpp's name); `permuted_qk`: llama.cpp's converter stored q
    and k rows permuted per head for this architecture (its rotary layout; undone on load); `fused`: checkpoint
    tensors that hold several of the tree's layers stacked along the outputs (Phi-3's qkv_proj, gate_up_proj:
    split on load), by suffix -> the layers and how to size each from the config; `gguf_norm_offset`: the offset
    of the norm weights as a GGUF stores them (llama.cpp's converter adds Gemma's 1 to the weights)."""

    name: str
    model_types: tuple[str, ...]
    gguf_arch: str
    spec: Callable[[Any], Spec]
    check: Callable[[Any], str | None] = common_check
    permuted_qk: bool = False
    fused: dict[str, Callable[[Any], tuple[tuple[str, int], ...]]] = field(default_factory=dict)
    gguf_norm_offset: float = 0.0
    gguf_config: Callable[[dict[str, Any], Any], None] | None = None  # config fields transformers' GGUF reader misses


def standard_spec(family: str, config: Any, **extra: Any) -> Spec:
    """The Llama-shaped description (full or windowed attention, one rotary set) with `extra` fields."""
    d = head_dim(config)
    factor = float(rope_parameters(config).get("partial_rotary_factor", 1.0))
    windows = windows_of(config)
    bias = bool(getattr(config, "attention_bias", False))
    values = dict(family=family, head_dim=d, scaling=d**-0.5, windows=windows, rope_sets=(0,) * len(windows),
                  rotary_dim=int(d * factor), activation=ACTIVATIONS[getattr(config, "hidden_act", None) or "silu"],
                  qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
    return Spec(**{**values, **extra})
