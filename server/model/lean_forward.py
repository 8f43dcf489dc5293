"""A leaner forward for Llama-family decoders: transformers' computation with fewer operations.

A one-token step of a small model is bound by its weights (the linear layers stream every weight once),
plus a few microseconds of dispatch for every other operation: norms, rotary embedding, reshapes, the
module calls, transformers' output-capturing hooks and keyword plumbing. On the 2-core development
machine that dispatch was about 40% of SmolLM2-135M's one-token step (40 ms against 24 ms for the linear
layers alone), and it is paid again on every verify pass whatever its width. `LeanForward` runs the same
layers over the same weights and the same cache with about half the operations: one fused RMSNorm call
per norm, the rotary embedding applied without the module layers around it, the engine's attention
function (server/model/attention.py) called directly, and no hooks.

It is the same computation, not a different model: the logits agree with transformers' to float
rounding (about 1e-6 relative), the way one GEMM shape agrees with another. Which forward the engine
uses only changes speed; speculation stays lossless against whichever target it runs, because drafts
are verified by that same forward.

Only decoders whose layers are exactly Llama's shape qualify (`LeanForward.of`: Llama, Mistral without a
sliding window, Qwen2 with full attention; linear layers that are plain `nn.Linear`; SiLU MLPs; the
engine's grouped-head attention); any other model keeps transformers' forward, which is also what
`ModelRunner(lean=False)` asks for (tests compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from server.model.attention import Packing, gqa_sdpa_attention, packs

# Decoder classes (by name, so a model type transformers does not ship here needs no import) whose
# layers are input norm -> attention (q, k, v, o projections with RoPE) -> residual -> norm -> SiLU MLP.
_BASES = {"LlamaModel", "MistralModel", "Qwen2Model"}


@dataclass(frozen=True)
class LeanOutput:
    """What `ModelRunner` reads of transformers' outputs."""

    logits: torch.Tensor | None  # [batch, kept positions, vocab] in the model's dtype; None without an LM head
    hidden_states: tuple[torch.Tensor, ...] | None  # transformers' layout: embeddings, after each layer, final norm
    last_hidden_state: torch.Tensor  # after the final norm


def _plain_linear(module: object) -> bool:
    return type(module) is nn.Linear


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    # transformers' LlamaRMSNorm normalises in float32 and casts back before the weight multiplies
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it (rotate_half): x [batch, T, heads, d], cos/sin [batch, T, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanForward:
    """A callable with the keyword interface `ModelRunner` gives transformers' causal LMs and base models."""

    def __init__(self, model: PreTrainedModel, base: nn.Module) -> None:
        self.base = base
        self.lm_head = model.get_output_embeddings() if model is not base else None
        # the final norm: RMSNorm, or whatever module stands there (a draft head's decoder has an identity)
        rms = hasattr(base.norm, "variance_epsilon")
        self.final_norm = (lambda x: _rms_norm(x, base.norm)) if rms else base.norm

    @classmethod
    def of(cls, model: PreTrainedModel) -> LeanForward | None:
        """The lean forward of `model`, or None when its layers are not exactly Llama's (see the module doc)."""
        base = model if model.get_output_embeddings() is None else getattr(model, "model", None)
        if base is None or type(base).__name__ not in _BASES or not packs(model):
            return None
        config = base.config
        if getattr(config, "hidden_act", None) != "silu":
            return None
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return None  # a window transformers' mask would apply (the engine's masks do not)
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            return None
        lm_head = model.get_output_embeddings()
        if lm_head is not None and not _plain_linear(lm_head):
            return None
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                           mlp.down_proj)
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(_plain_linear(p) for p in projections) or not all(hasattr(n, "variance_epsilon") for n in norms):
                return None
            if any(hasattr(attn, extra) for extra in ("q_norm", "k_norm", "sinks")):
                return None
        return cls(model, base)

    @torch.no_grad()
    def __call__(
        self,
        *,
        attention_mask: torch.Tensor,  # [batch, 1, W, length + W] additive (runner.py)
        position_ids: torch.Tensor,  # [batch, W], or [1, N] packed
        cache: Cache,
        input_ids: torch.Tensor | None = None,  # [batch, W] or [1, N]
        inputs_embeds: torch.Tensor | None = None,  # [batch, W, hidden] or [1, N, hidden]
        packing: Packing | None = None,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        use_cache: bool = True,  # the runner always writes the cache: accepted for transformers' keywords
    ) -> LeanOutput:
        base = self.base
        x = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, width = x.shape[:2]
        cos, sin = base.rotary_emb(x, position_ids)  # [batch, W, d] each
        cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
        states = [x] if output_hidden_states else None
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, layer.input_layernorm)
            shape = (batch, width, -1, attn.head_dim)  # heads as the projection gives them (transformers' view)
            q = _linear(attn.q_proj, h).view(shape)
            k = _linear(attn.k_proj, h).view(shape)
            v = _linear(attn.v_proj, h).view(shape).transpose(1, 2)
            q, k = _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin).transpose(1, 2)  # [batch, heads, W, d]
            k, v = cache.update(k, v, i)
            o, _ = gqa_sdpa_attention(attn, q, k, v, attention_mask, scaling=attn.scaling, packing=packing)
            x = x + _linear(attn.o_proj, o.reshape(batch, width, -1))
            h = _rms_norm(x, layer.post_attention_layernorm)
            x = x + _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, h)) * _linear(mlp.up_proj, h))
            if states is not None and i < len(base.layers) - 1:
                states.append(x)
        x = self.final_norm(x)
        if states is not None:
            states.append(x)
        logits = None
        if self.lm_head is not None:
            logits = _linear(self.lm_head, x[:, -logits_to_keep:] if logits_to_keep else x)
        return LeanOutput(logits, tuple(states) if states is not None else None, x)
