"""A GGUF file's tensors as a model whose linear layers stay quantized (`weights: as-file`; quantized.py).

`read_gguf` maps a file's tensors onto the server's module tree (decoder.py: transformers' module names) of its
family (families/: the file's `general.architecture` names it, gguf-py's tensor-name map of that architecture gives
each tensor's place) without dequantizing what a kernel can run (gguf_blocks.py: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K,
Q6_K, Q8_0); `assemble` builds the model from a config and those tensors. The pair in between (`QuantizedWeights`:
each module's kind and the tensors by state-dict name) is also what the weights cache stores for this format
(loading.py), so a later start skips the file's parsing. A file mixing types (Q4_K_M: Q4_K, Q6_K, Q8_0 or F16...)
keeps each tensor as it is.

Details of llama.cpp's conversion undone here as transformers' own GGUF loader undoes them:

* for the architectures whose rotary layout differs (`Family.permuted_qk`: llama), q and k are stored with their rows
  permuted per head: a row permutation, applied to the quantized rows as they are (a row's blocks run along its
  inputs);
* fused tensors (Phi-3's attn_qkv, ffn_up holding gate and up) are split into the tree's layers along their rows;
* Gemma's norm weights were written with its 1 added: the tree's norms then take them with offset 0;
* GGUF lists shapes innermost first: a [576, 49152] tensor is 49152 rows of 576 inputs.

Tensors of other types (F32, F16, BF16, other quantizations) are dequantized to fp32 with gguf's reference code and
served dense. The embedding table and the LM head become a `BlockTable` / `TableHead` when the file holds them as
Q8_0 or Q6_K (their blocks as they are, looked up exactly, multiplied by the block kernels), else `Fp16Table` /
`TableHead` (fp16 values of the file's weights, fp32 logits: quantized.py says why).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from server.model import decoder, families
from server.model.families.base import Family
from server.model.gguf_blocks import SERVED, Blocks, decode
from server.model.quantized import QUANT_KINDS, Q4Linear, Q8Linear, QuantLinear
from server.model.tables import BlockTable, Fp16Table, TableHead

log = logging.getLogger(__name__)

TABLE_BLOCKS = ("Q8_0", "Q6_K")  # table types kept as blocks (`BlockTable`); other quantized tables: fp16 values
_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_GLOBAL_PARTS = ("model.embed_tokens", "model.norm", "lm_head")


@dataclass
class QuantizedWeights:
    """A model's weights as served: `kinds` maps a module path to how it is held ("q4", "q8", "int8", "table",
    "q8table"); `tensors` holds every tensor by state-dict name (modules named in `kinds` included)."""

    kinds: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)  # the file's tensor types and counts, for the log


def family_of_file(reader: Any) -> Family:
    """The family a GGUF reader's file belongs to; a ValueError naming its architecture if none serves it."""
    arch = str(reader.fields["general.architecture"].contents())
    family = families.by_gguf_arch(arch)
    if family is None:
        known = ", ".join(f.gguf_arch for f in families.FAMILIES)
        raise ValueError(f"GGUF architecture {arch!r} is not served (known: {known})")
    return family


def tensor_names(family: Family, layers: int) -> dict[str, str]:
    """GGUF tensor base names (`blk.3.attn_q`) -> the tree's module paths (`model.layers.3.self_attn.q_proj`), from
    gguf-py's name map of the family's architecture (the converter's own table)."""
    import gguf

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.gguf_arch)
    mapping = gguf.get_tensor_name_map(arch, layers)
    out = {}
    parts = (*family.fused, *_LAYER_PARTS)  # a family's fused tensors first: they own the names they share
    for hf in [*(f"model.layers.{i}.{part}" for i in range(layers) for part in parts), *_GLOBAL_PARTS]:
        name = mapping.get_name(hf)
        if name is not None and name not in out:
            out[name] = hf
    return out


def hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: a tensor with no place here)."""
    base, _, suffix = gguf_name.rpartition(".")
    mapped = names.get(base)
    return f"{mapped}.{suffix}" if mapped else None


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's per-head permutation of q / k (transformers' reverse_permute)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _dequantized(tensor: object) -> torch.Tensor:
    """Any tensor of the file as fp32, in its logical shape (rows first)."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape)


def _layer(blocks: Blocks) -> QuantLinear:
    if blocks.four_bit:
        return Q4Linear.from_blocks(blocks.q, blocks.scales, blocks.mins)
    return Q8Linear(blocks.q.to(torch.int8), blocks.scales, mins=blocks.mins)


def _splits(family: Family, config: PretrainedConfig, module: str) -> list[tuple[str, int]] | None:
    """The layers a fused tensor holds, as (module path, rows): `...self_attn.qkv_proj` -> `...self_attn.q_proj`,
    `...k_proj`, `...v_proj` (None for a tensor that is not fused)."""
    scope = module.rpartition(".")[0]
    for suffix, rule in family.fused.items():
        if module.endswith(suffix):
            return [(f"{scope}.{part}", n) for part, n in rule(config)]
    return None


def read_config_fields(reader: Any) -> dict[str, Any]:
    """The file's metadata as plain values (strings, numbers; arrays left out)."""
    out: dict[str, Any] = {}
    for name, item in reader.fields.items():
        if name.startswith("tokenizer.") or len(item.types) != 1:
            continue
        try:
            out[name] = item.contents()
        except Exception:  # a value gguf-py cannot read plainly: not needed here
            continue
    return out


def complete_config(path: Path, config: PretrainedConfig) -> PretrainedConfig:
    """`config` (transformers' reading of the file) with what its GGUF reader leaves out for the file's family
    (`Family.gguf_config`: Qwen3's head_dim, Gemma's query scale and soft-caps...)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    family = family_of_file(reader)
    if family.gguf_config is not None:
        family.gguf_config(read_config_fields(reader), config)
    return config


def read_gguf(path: Path, config: PretrainedConfig) -> QuantizedWeights:
    """The file's tensors as `QuantizedWeights` for `config` (transformers' reading of the same file)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    family = family_of_file(reader)
    names = tensor_names(family, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = QuantizedWeights()
    for tensor in reader.tensors:
        name = hf_name(tensor.name, names)
        kind = tensor.tensor_type.name
        out.types[kind] = out.types.get(kind, 0) + 1
        if name is None:
            log.warning("GGUF tensor %s (%s) has no place in the model: ignored", tensor.name, kind)
            continue
        module, _, suffix = name.rpartition(".")
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        order = None
        if family.permuted_qk and module.endswith(".q_proj"):
            order = _rope_rows(rows, heads)
        elif family.permuted_qk and module.endswith(".k_proj"):
            order = _rope_rows(rows, kv_heads)
        table = module in ("model.embed_tokens", "lm_head")
        if suffix == "weight" and kind in SERVED and not table and len(tensor.shape) > 1:
            blocks = decode(kind, tensor.data, rows)
            if order is not None:
                blocks = blocks.take(order)
            start = 0
            for part, n in _splits(family, config, module) or [(module, rows)]:
                layer = _layer(blocks.take(slice(start, start + n)))
                start += n
                out.kinds[part] = layer.kind
                out.tensors.update({f"{part}.{k}": v for k, v in layer.state_dict().items()})
            continue
        if table and kind in TABLE_BLOCKS:  # the file's blocks as they are (quantized.BlockTable)
            blocks = decode(kind, tensor.data, rows)
            out.kinds[module] = "q8table"
            out.tensors.update({f"{module}.qweight": blocks.q.to(torch.int8), f"{module}.scales": blocks.scales})
            continue
        values = _dequantized(tensor)
        if order is not None:
            values = values[order]
        if table and kind not in ("F32", "F16", "BF16"):  # fp16 values of the file's weights (quantized.py)
            out.kinds[module] = "table"
            out.tensors[f"{module}.weight"] = values.to(torch.float16)
            continue
        start = 0
        for part, n in _splits(family, config, module) or [(module, values.shape[0])]:
            out.tensors[f"{part}.{suffix}"] = values[start:start + n] if values.dim() else values
            start += n
    return out


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def assemble(config: PretrainedConfig, weights: QuantizedWeights, ours: bool = True) -> nn.Module:
    """The causal LM of `config` holding `weights` (quantized modules where `kinds` says), on CPU, eval mode:
    the server's modules (decoder.py) where they serve the architecture (and `ours`), else transformers'."""
    family = families.family_of(config)
    if ours and family is not None:
        model: nn.Module = decoder.empty(config, norm_offset=family.gguf_norm_offset)
    else:  # an architecture the server's tree does not serve: transformers' modules
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
            if cls is Q8Linear:
                module = Q8Linear(own["qweight"], own["scales"], own.get("bias"), own.get("mins"))
            else:
                module = cls(own["qweight"], own["scales_zeros" if cls is Q4Linear else "scales"], own.get("bias"))
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
