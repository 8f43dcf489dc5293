"""Checkpoints on the server's module tree (decoder.py): configs read and written, a directory's safetensors loaded,
a transformers model's tensors adopted, fused tensors split.

The weights cache writes complete configs (`write_config`), read back without transformers' configuration classes:
those import ~60 MiB (sympy, torch.distributed through their validators) a served entry never needs. A checkpoint
from the hub holds only what differs from its class's defaults, so it is read through its configuration class."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from server.model import families
from server.model.attention import NAME as ATTENTION
from server.model.decoder import CausalLM, GenerationDefaults, empty, supports

COMPLETE = "specula_complete_config"  # a config.json holding every value (`write_config`), not a diff


def write_config(config: PretrainedConfig, directory: Path) -> None:
    """`config` as a config.json of every value (not transformers' diff against its class defaults), so that
    `read_config` reads it back without transformers' configuration classes (the weights cache's entries)."""
    values = {**config.to_dict(), COMPLETE: True}
    values.pop("_attn_implementation_internal", None)
    (Path(directory) / "config.json").write_text(json.dumps(values, indent=1, sort_keys=True, default=str))


def read_config(directory: Path) -> PretrainedConfig:
    """A checkpoint directory's `config.json` as `config_from_dict` reads it."""
    return config_from_dict(json.loads((Path(directory) / "config.json").read_text()))


def config_from_dict(raw: dict[str, Any]) -> PretrainedConfig:
    """A config's values as transformers' configuration class of its model type reads them (defaults, RoPE settings
    in one `rope_parameters`, older files' `rope_theta` / `rope_scaling` included), naming the engine's attention.
    A complete config (`write_config`: the weights cache's) is read as plain values: transformers' configuration
    classes import ~60 MiB (sympy, torch.distributed through their validators) a served entry never needs."""
    values = dict(raw)
    if values.pop(COMPLETE, False):
        config = PretrainedConfig.from_dict(values)
    else:
        from transformers import AutoConfig

        model_type = values.pop("model_type", "llama")
        values.pop("transformers_version", None)
        config = AutoConfig.for_model(model_type, **values)
    config._attn_implementation = ATTENTION
    return config


def split_fused(config: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with the family's fused ones (Phi-3's qkv_proj, gate_up_proj) split into the tree's
    layers along their outputs (rows)."""
    family = families.family_of(config)
    if family is None or not family.fused:
        return tensors
    out = {}
    for name, tensor in tensors.items():
        stem, _, kind = name.rpartition(".")
        rule = next((rule for suffix, rule in family.fused.items() if stem.endswith(suffix)), None)
        if rule is None:
            out[name] = tensor
            continue
        parent = stem.rpartition(".")[0]
        parts = rule(config)
        for (layer, _), piece in zip(parts, tensor.split([n for _, n in parts]), strict=True):
            out[f"{parent}.{layer}.{kind}"] = piece
    return out


def filled(model: CausalLM, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> CausalLM:
    """`model` (from `empty`) holding `tensors` by transformers' state-dict names, cast to `dtype`: an LM head
    tied to the embeddings where the config says so and the tensors hold none. Refuses a missing or unknown tensor."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in split_fused(model.config, tensors).items()
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
    """A local checkpoint (config.json and safetensors) of a served family as this module tree in `dtype`, on CPU;
    None when the directory is not one this tree serves (another architecture, or weights not in safetensors)."""
    from safetensors.torch import load_file

    if not (directory / "config.json").is_file():
        return None
    raw = json.loads((directory / "config.json").read_text())
    if "text_config" in raw and raw.get("model_type") == "gemma3":
        return None  # Gemma 3's multimodal checkpoints: transformers' modules
    config = read_config(directory)
    files = checkpoint_files(directory)
    if files is None or not supports(config) or getattr(config, "quantization_config", None):
        return None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return filled(empty(config, GenerationDefaults.of(config, directory)), tensors, dtype)


def adopt(model: nn.Module) -> nn.Module:
    """transformers' dense causal LM of a served family as this tree, holding the same tensors (no copy); any other
    model (one this tree does not serve, or one with quantized layers) as it is."""
    if isinstance(model, CausalLM) or not supports(model.config) or not hasattr(model, "model"):
        return model
    if any(type(m).__module__ == "server.model.quantized" for m in model.modules()):
        return model
    tensors = dict(model.state_dict())
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is table.weight or head.weight.data_ptr() == table.weight.data_ptr():
        tensors.pop("lm_head.weight")
        model.config.tie_word_embeddings = True  # (in the copy below too)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("embed_scale")}  # Gemma's buffer: the spec's
    generation = GenerationDefaults(getattr(getattr(model, "generation_config", None), "eos_token_id", None)
                                    or getattr(model.config, "eos_token_id", None))
    config = copy.deepcopy(model.config)  # the engine's attention named in its own copy: `model` runs as it did
    return filled(empty(config, generation), tensors, next(model.parameters()).dtype)
