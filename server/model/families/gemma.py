"""Gemma 2 and Gemma 3 (text): RMSNorm multiplying by (1 + w), norms before and after attention and the MLP, a
GELU-gated MLP (tanh approximation), input embeddings scaled by sqrt(hidden), attention scaled by
query_pre_attn_scalar ** -0.5, local layers with a sliding window beside global ones (`layer_types`). Gemma 2 caps
attention scores and logits with tanh; Gemma 3 norms each head's q and k instead, and rotates its local layers
with another base (`rope_parameters` per layer type: the local rotary set, 1). llama.cpp's converter adds the 1 to
every norm weight it writes (`gguf_norm_offset` 0)."""

from __future__ import annotations

from typing import Any

from server.model.families.base import (
    ACTIVATIONS,
    Family,
    Spec,
    common_check,
    head_dim,
    layer_types,
    rope_parameters,
    windows_of,
)


def _act(config: Any) -> Any:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def check(config: Any) -> str | None:
    act = _act(config)
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    config_act = getattr(config, "hidden_act", None)
    try:
        config.hidden_act = act  # common_check reads hidden_act
        return common_check(config)
    finally:
        config.hidden_act = config_act


def _spec(family: str, config: Any, gemma3: bool) -> Spec:
    d = head_dim(config)
    kinds = layer_types(config)
    sets = tuple(1 if gemma3 and kind == "sliding_attention" and "sliding_attention" in
                 (getattr(config, "rope_parameters", None) or {}) else 0 for kind in kinds)
    factor = float(rope_parameters(config, kinds[0]).get("partial_rotary_factor", 1.0))
    scalar = getattr(config, "query_pre_attn_scalar", None) or d
    return Spec(family=family, head_dim=d, scaling=float(scalar) ** -0.5, windows=windows_of(config),
                rope_sets=sets, rotary_dim=int(d * factor), norm_offset=1.0, qk_norm=gemma3, sandwich=True,
                activation=ACTIVATIONS[_act(config)], embed_scale=float(config.hidden_size) ** 0.5,
                attn_softcap=None if gemma3 else getattr(config, "attn_logit_softcapping", None),
                final_softcap=getattr(config, "final_logit_softcapping", None))


def gemma2_spec(config: Any) -> Spec:
    return _spec("gemma2", config, gemma3=False)


def gemma3_spec(config: Any) -> Spec:
    return _spec("gemma3", config, gemma3=True)


def gemma2_gguf(fields: dict[str, Any], config: Any) -> None:
    for key, name in (("gemma2.attn_logit_softcapping", "attn_logit_softcapping"),
                      ("gemma2.final_logit_softcapping", "final_logit_softcapping")):
        if key in fields:
            setattr(config, name, float(fields[key]))
    if "gemma2.attention.key_length" in fields:
        config.query_pre_attn_scalar = int(fields["gemma2.attention.key_length"])


def gemma3_gguf(fields: dict[str, Any], config: Any) -> None:
    """The query scale from the key length (llama.cpp's reading: it stores no query_pre_attn_scalar) and a global
    RoPE scaling where the file names one (Gemma 3 4B and larger: linear, factor 8)."""
    if "gemma3.attention.key_length" in fields:
        config.query_pre_attn_scalar = int(fields["gemma3.attention.key_length"])
    kind, factor = fields.get("gemma3.rope.scaling.type"), fields.get("gemma3.rope.scaling.factor")
    if kind == "linear" and factor:
        full = dict(config.rope_parameters.get("full_attention") or {})
        full.update(rope_type="linear", factor=float(factor))
        config.rope_parameters = {**config.rope_parameters, "full_attention": full}


GEMMA2 = Family(name="gemma2", model_types=("gemma2",), gguf_arch="gemma2", spec=gemma2_spec, check=check,
                gguf_config=gemma2_gguf)
GEMMA3 = Family(name="gemma3", model_types=("gemma3_text",), gguf_arch="gemma3", spec=gemma3_spec, check=check,
                gguf_config=gemma3_gguf)
