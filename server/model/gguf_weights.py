"""A GGUF file's tensors as a model whose linear layers stay quantized (`weights: as-file`; quantized.py).

`read_gguf` maps a llama-architecture file's tensors onto transformers' module names without dequantizing
what a kernel can run (Q4_0, Q4_1, Q8_0: quantized.py); `assemble` builds the model from a config and those
tensors. The pair in between (`QuantizedWeights`: each module's kind and the tensors by state-dict name) is
also what the weights cache stores for this format (loading.py), so a later start skips the file's parsing.

Two details of llama.cpp's conversion are undone here as transformers' own GGUF loader undoes them:

* q and k projections are stored with their rows permuted per head (llama.cpp's rotary layout): a row
  permutation, applied to the quantized rows as they are (a row's blocks run along its inputs).
* GGUF lists shapes innermost first: a [576, 49152] tensor is 49152 rows of 576 inputs.

Tensors of other types (F32, F16, BF16, K-quants) are dequantized to fp32 with gguf's reference code and served
dense. The embedding table and the LM head become a `BlockTable` / `TableHead` when the file holds them as Q8_0
(SmolLM2's tied table: its blocks as they are, looked up exactly, multiplied by the float32 block kernel), else
`Fp16Table` / `TableHead` (fp16 values of the file's weights, fp32 logits: quantized.py says why).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from server.model import llama
from server.model.quantized import (
    GROUP,
    QUANT_KINDS,
    BlockTable,
    Fp16Table,
    Q4Linear,
    Q8Linear,
    QuantLinear,
    TableHead,
)

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama",)  # whose tensor names and q/k permutation this module knows
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # served as they are; every other type is dequantized

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class QuantizedWeights:
    """A model's weights as served: `kinds` maps a module path to how it is held ("q4", "q8", "int8",
    "table"); `tensors` holds every tensor by state-dict name (modules named in `kinds` included)."""

    kinds: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)  # the file's tensor types and counts, for the log


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: a tensor this loader does not map)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, index, part = base.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return f"model.layers.{index}.{mapped}.{suffix}" if mapped else None
    mapped = _GLOBAL_NAMES.get(base)
    return f"{mapped}.{suffix}" if mapped else None


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's per-head permutation of q / k (transformers' reverse_permute)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _blocks(data: np.ndarray, rows: int, size: int) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(rows, -1, size)


def decode_q4(data: np.ndarray, rows: int, with_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q4_0 (d, 16 bytes) / Q4_1 (d, m, 16 bytes) blocks -> q [rows, in] in [0, 15], d and m [rows, in/32].
    A block's byte j holds weight j in its low nibble and weight j + 16 in its high one (ggml)."""
    head = 4 if with_min else 2
    blocks = _blocks(data, rows, head + GROUP // 2)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) if with_min else None
    qs = torch.from_numpy(blocks[..., head:].copy())
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, -1)
    return q.to(torch.int32), d, m


def decode_q8(data: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (d, 32 int8) -> q [rows, in] int8 and d [rows, in/32]."""
    blocks = _blocks(data, rows, 2 + GROUP)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, -1)
    return q, d


def _dequantized(tensor: object) -> torch.Tensor:
    """Any tensor of the file as fp32, in its logical shape (rows first)."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape)


def read_gguf(path: Path, config: PretrainedConfig) -> QuantizedWeights:
    """The file's tensors as `QuantizedWeights` for `config` (transformers' reading of the same file)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in ARCHITECTURES:
        raise ValueError(f"quantized serving knows the {', '.join(ARCHITECTURES)} architecture, not {arch!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = QuantizedWeights()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        kind = tensor.tensor_type.name
        out.types[kind] = out.types.get(kind, 0) + 1
        if name is None:
            log.warning("GGUF tensor %s (%s) has no place in the model: ignored", tensor.name, kind)
            continue
        module = name.removesuffix(".weight")
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        order = None
        if ".q_proj." in name:
            order = _rope_rows(rows, heads)
        elif ".k_proj." in name:
            order = _rope_rows(rows, kv_heads)
        table = module in ("model.embed_tokens", "lm_head")
        if kind in QUANTIZED_TYPES and not table:
            if kind == "Q8_0":
                q, d = decode_q8(tensor.data, rows)
                layer: QuantLinear = Q8Linear(q, d)
            else:
                q, d, m = decode_q4(tensor.data, rows, with_min=kind == "Q4_1")
                layer = Q4Linear.from_blocks(q, d, m)
            if order is not None:
                layer = _permuted(layer, order)
            out.kinds[module] = layer.kind
            out.tensors.update({f"{module}.{k}": v for k, v in layer.state_dict().items()})
            continue
        if table and kind == "Q8_0":  # the file's blocks as they are (quantized.BlockTable)
            q, d = decode_q8(tensor.data, rows)
            if order is not None:
                q, d = q[order], d[order]
            out.kinds[module] = "q8table"
            out.tensors.update({f"{module}.qweight": q, f"{module}.scales": d})
            continue
        values = _dequantized(tensor)
        if order is not None:
            values = values[order]
        if table and kind in QUANTIZED_TYPES:  # fp16 values of the file's weights (quantized.py)
            out.kinds[module] = "table"
            out.tensors[f"{module}.weight"] = values.to(torch.float16)
        else:
            out.tensors[name] = values
    return out


def _permuted(layer: QuantLinear, order: torch.Tensor) -> QuantLinear:
    """`layer` with its output rows in `order` (the quantized rows moved as they are)."""
    if isinstance(layer, Q4Linear):
        return Q4Linear(layer.qweight[order], layer.scales_zeros[:, order])
    assert isinstance(layer, Q8Linear)
    return Q8Linear(layer.qweight[order], layer.scales[order])


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def assemble(config: PretrainedConfig, weights: QuantizedWeights, ours: bool = True) -> nn.Module:
    """The causal LM of `config` holding `weights` (quantized modules where `kinds` says), on CPU, eval mode:
    llama.py's modules where they serve the architecture (and `ours`), else transformers'."""
    if ours and llama.supports(config):
        model: nn.Module = llama.empty(config)
    else:  # an architecture llama.py does not serve: transformers' modules
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = dict(weights.tensors)
    for path, kind in weights.kinds.items():
        own = {k.removeprefix(f"{path}."): tensors.pop(k) for k in list(tensors) if k.startswith(f"{path}.")}
        if kind in ("table", "q8table"):
            module: nn.Module = Fp16Table(own["weight"]) if kind == "table" else \
                BlockTable(own["qweight"], own["scales"])
            if path == "lm_head":
                module = TableHead(module)
        else:
            cls = QUANT_KINDS[kind]
            extra = "scales_zeros" if cls is Q4Linear else "scales"
            module = cls(own["qweight"], own[extra], own.get("bias"))
        _set_module(model, path, module)
    tied = "lm_head" not in weights.kinds and "lm_head.weight" not in tensors  # as SmolLM2's file
    if tied and isinstance(model.get_input_embeddings(), Fp16Table | BlockTable):
        model.lm_head = TableHead(model.get_input_embeddings())
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"tensors with no place in the model: {unexpected[:5]}")
    if tied and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.get_input_embeddings().weight
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ValueError(f"the file has no tensor for {left[:5]}")
    del missing  # the quantized modules' buffers are theirs, not the state dict's
    model.config.tie_word_embeddings = False  # ties are the modules' own now (TableHead shares the table)
    return model.eval().requires_grad_(False)


def weights_of(model: nn.Module) -> QuantizedWeights:
    """The inverse of `assemble`: what the weights cache stores for a quantized model."""
    out = QuantizedWeights()
    for path, module in model.named_modules():
        if isinstance(module, QuantLinear):
            out.kinds[path] = module.kind
        elif isinstance(module, Fp16Table | BlockTable) and path and not path.endswith(".table"):
            out.kinds[path] = "table" if isinstance(module, Fp16Table) else "q8table"
    head = model.get_output_embeddings()
    if isinstance(head, TableHead) and head.table is not model.get_input_embeddings():
        out.kinds["lm_head"] = "table" if isinstance(head.table, Fp16Table) else "q8table"
    embedding = getattr(model.get_input_embeddings(), "weight", None) \
        if not isinstance(model.get_input_embeddings(), BlockTable) else None
    for name, tensor in model.state_dict().items():
        if name.startswith("lm_head.table.") and head.table is model.get_input_embeddings():
            continue  # tied: the table is stored once, under the embeddings
        if name == "lm_head.weight" and embedding is not None and tensor.data_ptr() == embedding.data_ptr():
            continue  # a dense head tied to the embeddings (a file without quantized tables): `assemble` ties it
        out.tensors[name.replace("lm_head.table.", "lm_head.")] = tensor
    return out
