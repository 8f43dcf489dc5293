"""Decoders of every family the server serves (families/), as a module tree of its own, without transformers'
modeling stack.

The engine runs a served target only through the lean forward (lean_forward.py) and, on CPU with block weights,
the C decoder (cpu_decoder.py); both read this tree for its weights and shapes and its `Spec` (families/base.py) for
what the layers do, and never call the modules' own forwards. Building the tree with transformers' model classes
would import transformers' whole modeling stack for nothing the server uses: `PreTrainedModel` pulls in
torch.distributed.tensor, torch._dynamo and sympy through transformers' integrations, ~120 MiB of resident memory in
every server process (and ~2 s of start-up on 2 cores) before a weight is read. This module builds the same trees
(transformers' module names and attributes: `model.layers.N.self_attn.q_proj`, `...q_norm`, `...mlp.gate_proj`,
`...input_layernorm`, Gemma's `pre_feedforward_layernorm`...), so checkpoints and GGUF tensors map onto it unchanged,
from `torch.nn` alone, with transformers' configuration and tokenizer classes, which stay light.

Which models: `families.family_of(config)` (one decision, in families/). Anything else, and every tool that needs
transformers' forwards (distillation, the tests that compare against them), loads transformers' model instead
(loading.py).

The modules' own forwards compute whole sequences without a cache, as transformers' do, for checks and tools:
`Decoder.forward` is the reference the batched paths are tested against, written for clarity, one operation at a
time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from server.model import families
from server.model.attention import NAME as ATTENTION
from server.model.families.base import Spec, rope_kind, rope_parameters


def supports(config: Any) -> bool:
    """Whether this module tree serves the model of `config` exactly as transformers would (families/)."""
    return families.family_of(config) is not None


def _linear(inputs: int, outputs: int, bias: bool, meta: bool) -> nn.Linear:
    """`nn.Linear(inputs, outputs, bias)`; with `meta`, its parameters on the meta device and never initialised
    (a checkpoint's tensors replace them): initialising meta tensors runs torch's Python reference kernels,
    whose first call imports torch._dynamo (~70 MiB)."""
    if not meta:
        return nn.Linear(inputs, outputs, bias=bias)
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = inputs, outputs
    layer.weight = nn.Parameter(torch.empty(outputs, inputs, device="meta"))
    layer.register_parameter("bias", nn.Parameter(torch.empty(outputs, device="meta")) if bias else None)
    return layer


def _embedding(rows: int, size: int, meta: bool) -> nn.Embedding:
    """`nn.Embedding(rows, size)`; with `meta`, as `_linear` makes its layers."""
    if not meta:
        return nn.Embedding(rows, size)
    return nn.Embedding(rows, size, _weight=torch.empty(rows, size, device="meta"), _freeze=True)


def norm_weight(norm: nn.Module) -> torch.Tensor:
    """What an RMSNorm multiplies by: its weight plus its offset (Gemma's checkpoints: 1 + w, in float32 as
    transformers computes it)."""
    offset = getattr(norm, "offset", 0.0)
    return norm.weight if not offset else norm.weight.float() + offset


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """`norm` (an RMSNorm: `weight`, `variance_epsilon`, `offset`) of x over its last dimension, as the lean forward
    and the modules' own forwards compute it: normalised in float32, then multiplied by the weight (transformers'
    Llama casts back before the weight multiplies, Gemma after; in float32 the two are the same)."""
    weight = norm_weight(norm)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight.float(), norm.variance_epsilon)
    if getattr(norm, "offset", 0.0):
        return (F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon) * weight).to(x.dtype)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: `rotate`'s factor for the halves swapped (once per forward)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it, x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], computed as
    x * cos + [x2, x1] * [-sin1, sin2]: the same products bit for bit (a sign moves between exact factors), in
    three operations fewer. Any layout whose last dimension is the head's: x [batch, T, heads, d] (the lean
    forward) or [batch, heads, T, d] (`Decoder.forward`), cos and `signed` (`signed_sin(sin)`) broadcast against
    it. A partial rotary (cos narrower than the head) rotates the leading dimensions and leaves the rest."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + x.roll(rot // 2, dims=-1) * signed
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + head.roll(rot // 2, dims=-1) * signed, tail), dim=-1)


def activate(gate: torch.Tensor, kind: str) -> torch.Tensor:
    """The gated MLP's activation of its gate: SiLU, or GELU's tanh approximation (Gemma)."""
    return F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's scores and logits); x itself without a cap."""
    return x if not cap else torch.tanh(x / cap) * cap


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """An additive mask [..., q, keys] cut to each query's last `window` visible keys (itself included), as
    transformers' sliding window keeps keys with q - k < window: a row's live keys are its tokens in order."""
    allowed = mask == 0
    later = allowed.flip(-1).cumsum(-1).flip(-1)  # visible keys at or after each column
    return mask.masked_fill(allowed & (later > window), torch.finfo(mask.dtype).min)


class RMSNorm(nn.Module):
    """RMSNorm multiplying by (offset + weight): `offset` 1 for Gemma's checkpoints (transformers' Gemma norms),
    0 for the others and for GGUF files, whose weights hold the offset already."""

    def __init__(self, size: int, eps: float, meta: bool = False, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta") if meta else
                                   torch.zeros(size) if offset else torch.ones(size))
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self)


class Rotary(nn.Module):
    """RoPE's cos and sin for given positions, as transformers' rotary embeddings compute them (one layer type's
    parameters where the config keeps several: Gemma 3's local and global layers). A partial rotary's cos and sin
    cover its rotated dimensions only."""

    def __init__(self, config: Any, layer_type: str | None = None) -> None:
        super().__init__()
        parameters = rope_parameters(config, layer_type)
        kind = rope_kind(parameters)
        if kind == "default":
            base = parameters["rope_theta"]
            head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            dim = int(head * float(parameters.get("partial_rotary_factor", 1.0)))
            inv_freq, self.attention_scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        elif layer_type is not None and layer_type in (getattr(config, "rope_parameters", None) or {}):
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, layer_type=layer_type)
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Any, spec: Spec, layer_idx: int, meta: bool = False) -> None:
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.head_dim = spec.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = spec.scaling
        self.sliding_window = spec.windows[layer_idx]
        self.rope_set = spec.rope_sets[layer_idx]
        self.softcap = spec.attn_softcap
        hidden, q, kv = config.hidden_size, config.num_attention_heads * self.head_dim, \
            config.num_key_value_heads * self.head_dim
        self.q_proj = _linear(hidden, q, spec.qkv_bias, meta)
        self.k_proj = _linear(hidden, kv, spec.qkv_bias, meta)
        self.v_proj = _linear(hidden, kv, spec.qkv_bias, meta)
        self.o_proj = _linear(q, hidden, spec.o_bias, meta)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, meta, spec.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, meta, spec.norm_offset)


class MLP(nn.Module):
    def __init__(self, config: Any, spec: Spec, meta: bool = False) -> None:
        super().__init__()
        bias = spec.mlp_bias
        self.activation = spec.activation
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, bias, meta)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, bias, meta)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, bias, meta)


class DecoderLayer(nn.Module):
    """A layer's modules under transformers' names. Llama's shape: `input_layernorm` before attention,
    `post_attention_layernorm` before the MLP. Gemma's (`spec.sandwich`): `post_attention_layernorm` after
    attention, `pre_feedforward_layernorm` before the MLP, `post_feedforward_layernorm` after it (`norms`)."""

    def __init__(self, config: Any, spec: Spec, layer_idx: int, meta: bool = False) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, spec.norm_offset
        self.self_attn = Attention(config, spec, layer_idx, meta)
        self.mlp = MLP(config, spec, meta)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, meta, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, meta, offset)
        if spec.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, meta, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, meta, offset)

    def norms(self) -> tuple[nn.Module, nn.Module | None, nn.Module, nn.Module | None]:
        """(before attention, after attention or None, before the MLP, after the MLP or None)."""
        if hasattr(self, "pre_feedforward_layernorm"):
            return (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                    self.post_feedforward_layernorm)
        return self.input_layernorm, None, self.post_attention_layernorm, None


def layer_norms(layer: nn.Module) -> tuple[nn.Module, nn.Module | None, nn.Module, nn.Module | None]:
    """`DecoderLayer.norms` of any decoder layer (transformers' Llama-shaped layers too)."""
    if isinstance(layer, DecoderLayer):
        return layer.norms()
    return layer.input_layernorm, None, layer.post_attention_layernorm, None


@dataclass(frozen=True)
class Output:
    """What a whole-sequence forward gives (transformers' output names)."""

    last_hidden_state: torch.Tensor  # [batch, T, hidden], after the final norm
    logits: torch.Tensor | None = None  # [batch, T, vocab] (a causal LM's)


class _Placed(nn.Module):
    """Where a model's weights live, as transformers' models say it (`model.device`, `model.dtype`)."""

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def _spec(config: Any, spec: Spec | None) -> Spec:
    if spec is not None:
        return spec
    found = families.spec_of(config)
    if found is None:
        raise ValueError(f"the server's modules do not serve {families.unsupported(config)}")
    return found


class Decoder(_Placed):
    """The decoder stack (transformers' `<Family>Model`): embeddings, layers, final norm, RoPE (and Gemma 3's local
    RoPE, `rotary_local`)."""

    def __init__(self, config: Any, meta: bool = False, spec: Spec | None = None, norm_offset: float | None = None
                 ) -> None:
        """`meta`: parameters on the meta device, uninitialised (`empty`); else initialised on CPU (a draft head's).
        `norm_offset`: the offset the weights to be loaded hold the norms with (a GGUF's: 0; default the spec's)."""
        super().__init__()
        spec = _spec(config, spec)
        if norm_offset is not None and norm_offset != spec.norm_offset:
            from dataclasses import replace

            spec = replace(spec, norm_offset=norm_offset)
        self.config, self.spec = config, spec
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size, meta)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, i, meta) for i in range(config.num_hidden_layers))
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps, meta, spec.norm_offset)
        kinds = getattr(config, "layer_types", None)
        per_type = isinstance(getattr(config, "rope_parameters", None), dict) and \
            "full_attention" in config.rope_parameters
        self.rotary_emb = Rotary(config, "full_attention" if per_type else None)
        self.rotary_local = Rotary(config, "sliding_attention") if 1 in spec.rope_sets and kinds else None

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.embed_tokens = module

    def get_output_embeddings(self) -> None:
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `input_ids`, scaled where the family scales them (Gemma: sqrt(hidden), in the
        embeddings' dtype as transformers multiplies)."""
        x = self.embed_tokens(input_ids)
        scale = self.spec.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

    def rotations(self, x: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) per rotary set for `position_ids` ([..., T] -> [..., T, rotary dim] each)."""
        sets = [self.rotary_emb(x, position_ids)]
        if self.rotary_local is not None:
            sets.append(self.rotary_local(x, position_ids))
        return sets

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Output:
        """The causal forward of whole sequences [batch, T], without a cache: transformers' computation, for checks
        and tools. The engine never calls it: it runs the tree through `LeanForward` (batched cache, masks)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        batch, width = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(width, device=x.device)[None].expand(batch, width)
        rotations = [(cos[:, None], signed_sin(sin[:, None])) for cos, sin in self.rotations(x, position_ids)]
        causal = torch.zeros(width, width, dtype=x.dtype, device=x.device).masked_fill_(
            torch.ones(width, width, dtype=torch.bool, device=x.device).triu(1), torch.finfo(x.dtype).min)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            before_attn, after_attn, before_mlp, after_mlp = layer.norms()
            h = before_attn(x)
            q, k, v = (p(h).view(batch, width, -1, attn.head_dim).transpose(1, 2)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin = rotations[attn.rope_set]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k = k.repeat_interleave(attn.num_key_value_groups, dim=1)
            v = v.repeat_interleave(attn.num_key_value_groups, dim=1)
            mask = window_mask(causal, attn.sliding_window) if attn.sliding_window else causal
            scores = soft_cap(q @ k.transpose(2, 3) * attn.scaling, attn.softcap) + mask
            o = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
            o = attn.o_proj(o.transpose(1, 2).reshape(batch, width, -1))
            x = x + (after_attn(o) if after_attn is not None else o)
            h = before_mlp(x)
            m = mlp.down_proj(activate(mlp.gate_proj(h), mlp.activation) * mlp.up_proj(h))
            x = x + (after_mlp(m) if after_mlp is not None else m)
        return Output(self.norm(x))


class GenerationDefaults:
    """What the engine reads of a checkpoint's `generation_config.json`: its end-of-sequence ids."""

    def __init__(self, eos_token_id: int | list[int] | None) -> None:
        self.eos_token_id = eos_token_id

    @classmethod
    def of(cls, config: Any, directory: Path | None = None) -> GenerationDefaults:
        file = Path(directory) / "generation_config.json" if directory is not None else None
        if file is not None and file.is_file():
            return cls(json.loads(file.read_text()).get("eos_token_id", getattr(config, "eos_token_id", None)))
        return cls(getattr(config, "eos_token_id", None))


class CausalLM(_Placed):
    """A decoder with its LM head (transformers' `<Family>ForCausalLM`'s tree: `model`, `lm_head`)."""

    def __init__(self, config: Any, generation: GenerationDefaults | None = None, meta: bool = False,
                 norm_offset: float | None = None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation or GenerationDefaults.of(config)
        self.model = Decoder(config, meta, norm_offset=norm_offset)
        self.lm_head: nn.Module = _linear(config.hidden_size, config.vocab_size, False, meta)

    @property
    def spec(self) -> Spec:
        return self.model.spec

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.lm_head = module

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> Output:
        """Logits of whole sequences (`Decoder.forward`'s reference computation; not the engine's path)."""
        hidden = self.model(input_ids, position_ids=position_ids).last_hidden_state
        return Output(hidden, soft_cap(self.lm_head(hidden), self.spec.final_softcap))


def empty(config: Any, generation: GenerationDefaults | None = None, norm_offset: float | None = None) -> CausalLM:
    """The tree of `config` with its parameters on the meta device (`load_state_dict(..., assign=True)` fills it)."""
    config._attn_implementation = ATTENTION
    return CausalLM(config, generation, meta=True, norm_offset=norm_offset)  # RoPE's buffers are real from the start
