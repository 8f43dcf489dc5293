"""Llama-architecture decoders as the server runs them: a module tree of its own, without transformers' modeling stack.

The engine runs a Llama-shaped target only through the lean forward (lean_forward.py), which reads the module
tree for its weights and shapes and never calls the modules' own forwards. Building that tree with transformers'
`LlamaForCausalLM` imports transformers' whole modeling stack for nothing the server uses: `PreTrainedModel`
pulls in torch.distributed.tensor, torch._dynamo and sympy through transformers' integrations, ~120 MiB of
resident memory in every server process (and ~2 s of start-up on 2 cores) before a weight is read. This module
builds the same tree (transformers' module names and attributes, so checkpoints, GGUF tensors and the lean forward
map onto it unchanged) from `torch.nn` alone, with transformers' configuration and tokenizer classes, which stay
light.

Which models: `supports(config)`, Llama's architecture exactly (SiLU MLP, full attention, a RoPE whose
frequencies do not change with the sequence length). Anything else, and every tool that needs transformers'
forwards (distillation, the tests that compare against them), loads transformers' model instead (loading.py).

The engine runs the tree only through `LeanForward` (batched cache, masks, packed passes); the modules' own
forwards compute whole sequences without a cache, as transformers' do, for checks and tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from server.model.attention import NAME as ATTENTION

MODEL_TYPES = ("llama",)  # config.model_type values this tree serves
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies fixed at start (no per-length update)


def rope_type(config: Any) -> str:
    """The config's RoPE type ("default" when it names none)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(parameters.get("rope_type", parameters.get("type", "default")))


def supports(config: Any) -> bool:
    """Whether this module tree serves the model of `config` exactly as transformers' Llama would."""
    if getattr(config, "model_type", None) not in MODEL_TYPES or getattr(config, "hidden_act", None) != "silu":
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    return rope_type(config) in _STATIC_ROPE and "rope_theta" in (getattr(config, "rope_parameters", None) or {})


_LLAMA_DEFAULTS = {  # transformers' LlamaConfig defaults, for a config.json that leaves them out
    "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}


def read_config(directory: Path) -> PretrainedConfig:
    """A checkpoint directory's `config.json` as `config_from_dict` reads it."""
    return config_from_dict(json.loads((Path(directory) / "config.json").read_text()))


def config_from_dict(raw: dict[str, Any]) -> PretrainedConfig:
    """A Llama config's values as a plain transformers config (no model class imported), with LlamaConfig's
    defaults and its RoPE settings in one `rope_parameters` dict (older files give `rope_theta` and
    `rope_scaling` apart)."""
    values = {**_LLAMA_DEFAULTS, **raw}
    if not values.get("rope_parameters"):
        scaling = dict(values.get("rope_scaling") or {})
        kind = scaling.pop("rope_type", scaling.pop("type", "default"))
        values["rope_parameters"] = {**scaling, "rope_type": kind, "rope_theta": values.get("rope_theta", 10_000.0)}
    for older in ("rope_scaling", "rope_theta"):  # in `rope_parameters` now (transformers' own reading of them
        values.pop(older, None)  # in a plain config would look for attributes set after it)
    values["num_key_value_heads"] = values.get("num_key_value_heads") or values.get("num_attention_heads")
    config = PretrainedConfig.from_dict(values)
    config._attn_implementation = ATTENTION
    return config


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


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """`norm` (an RMSNorm: `weight`, `variance_epsilon`) of x, as the lean forward and the modules' own forwards
    compute it. transformers' LlamaRMSNorm normalises in float32 and casts back before the weight multiplies."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: `rotate`'s factor for the halves swapped (once per forward)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it, x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], computed as
    x * cos + [x2, x1] * [-sin1, sin2]: the same products bit for bit (a sign moves between exact factors), in
    three operations fewer. Any layout whose last dimension is the head's: x [batch, T, heads, d] (the lean
    forward) or [batch, heads, T, d] (`Decoder.forward`), cos and `signed` (`signed_sin(sin)`) broadcast against
    it."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, meta: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta") if meta else torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self)


class Rotary(nn.Module):
    """RoPE's cos and sin for given positions, as transformers' `LlamaRotaryEmbedding` computes them."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        kind = rope_type(config)
        if kind == "default":
            base = config.rope_parameters["rope_theta"]
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq, self.attention_scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, meta: bool = False) -> None:
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        hidden, q, kv = config.hidden_size, config.num_attention_heads * self.head_dim, \
            config.num_key_value_heads * self.head_dim
        self.q_proj = _linear(hidden, q, bias, meta)
        self.k_proj = _linear(hidden, kv, bias, meta)
        self.v_proj = _linear(hidden, kv, bias, meta)
        self.o_proj = _linear(q, hidden, bias, meta)


class MLP(nn.Module):
    def __init__(self, config: Any, meta: bool = False) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, bias, meta)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, bias, meta)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, bias, meta)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, meta: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, meta)
        self.mlp = MLP(config, meta)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, meta)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, meta)


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


class Decoder(_Placed):
    """The decoder stack (transformers' `LlamaModel`): embeddings, layers, final norm, RoPE."""

    def __init__(self, config: Any, meta: bool = False) -> None:
        """`meta`: parameters on the meta device, uninitialised (`empty`); else initialised on CPU (a draft head's)."""
        super().__init__()
        self.config = config
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size, meta)
        self.layers = nn.ModuleList(DecoderLayer(config, i, meta) for i in range(config.num_hidden_layers))
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps, meta)
        self.rotary_emb = Rotary(config)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.embed_tokens = module

    def get_output_embeddings(self) -> None:
        return None

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Output:
        """The causal forward of whole sequences [batch, T], without a cache: transformers' computation, for checks
        and tools. The engine never calls it: it runs the tree through `LeanForward` (batched cache, masks)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, width = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(width, device=x.device)[None].expand(batch, width)
        cos, sin = self.rotary_emb(x, position_ids)
        cos, sin = cos[:, None], signed_sin(sin[:, None])  # [batch, 1, T, d]
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm(x)
            q, k, v = (p(h).view(batch, width, -1, attn.head_dim).transpose(1, 2)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            o = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=width > 1,
                                               scale=attn.scaling, enable_gqa=k.shape[1] != q.shape[1])
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, width, -1))
            h = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
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
    """A decoder with its LM head (transformers' `LlamaForCausalLM`'s tree: `model`, `lm_head`)."""

    def __init__(self, config: Any, generation: GenerationDefaults | None = None, meta: bool = False) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation or GenerationDefaults.of(config)
        self.model = Decoder(config, meta)
        self.lm_head: nn.Module = _linear(config.hidden_size, config.vocab_size, False, meta)

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
        return Output(hidden, self.lm_head(hidden))


def empty(config: Any, generation: GenerationDefaults | None = None) -> CausalLM:
    """The tree of `config` with its parameters on the meta device (`load_state_dict(..., assign=True)` fills it)."""
    config._attn_implementation = ATTENTION
    return CausalLM(config, generation, meta=True)  # RoPE's computed buffer is real from the start


def filled(model: CausalLM, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> CausalLM:
    """`model` (from `empty`) holding `tensors` by transformers' state-dict names, cast to `dtype`: an LM head
    tied to the embeddings where the config says so and the tensors hold none. Refuses a missing or unknown tensor."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()
               if not k.endswith("rotary_emb.inv_freq")}  # older checkpoints saved RoPE's computed buffer
    tied = "lm_head.weight" not in tensors and bool(getattr(model.config, "tie_word_embeddings", False))
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"tensors with no place in the model: {unexpected[:5]}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise ValueError(f"the checkpoint has no tensor for {missing[:5]}")
    return model.eval().requires_grad_(False)


def checkpoint_files(directory: Path) -> list[Path] | None:
    """A directory's safetensors files (one, or the shards its index lists); None when it holds none."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else None


def load_directory(directory: Path, dtype: torch.dtype) -> CausalLM | None:
    """A local Llama checkpoint (config.json and safetensors) as this module tree in `dtype`, on CPU; None when
    the directory is not one this tree serves (another architecture, or weights not in safetensors)."""
    from safetensors.torch import load_file

    if not (directory / "config.json").is_file():
        return None
    config = read_config(directory)
    files = checkpoint_files(directory)
    if files is None or not supports(config) or getattr(config, "quantization_config", None):
        return None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return filled(empty(config, GenerationDefaults.of(config, directory)), tensors, dtype)


def adopt(model: nn.Module) -> nn.Module:
    """transformers' dense Llama causal LM as this tree, holding the same tensors (no copy); any other model (one
    this tree does not serve, or one with quantized layers) as it is."""
    if isinstance(model, CausalLM) or not supports(model.config) or not hasattr(model, "model"):
        return model
    if any(type(m).__module__ == "server.model.quantized" for m in model.modules()):
        return model
    tensors = dict(model.state_dict())
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is table.weight or head.weight.data_ptr() == table.weight.data_ptr():
        tensors.pop("lm_head.weight")
        model.config.tie_word_embeddings = True
    generation = GenerationDefaults(getattr(getattr(model, "generation_config", None), "eos_token_id", None)
                                    or getattr(model.config, "eos_token_id", None))
    return filled(empty(model.config, generation), tensors, next(model.parameters()).dtype)
