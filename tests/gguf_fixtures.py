"""Tiny random-weight models of every served family, as transformers builds them, and as GGUF files in any mix of
block types (written with gguf-py, K-quants with tests/kquants.py), laid out as llama.cpp's converter lays them out:
its tensor names (gguf-py's map per architecture), q and k rows permuted for the `llama` architecture, Gemma's norm
weights with their 1 added, Phi-3's fused tensors as they are. The byte-level BPE tokenizer of tests/models.py's
`write_tiny_gguf` (~260 tokens), so transformers reads every file without a download.

Shapes are K-quant sized (rows of 256 inputs) and small: hidden 256, 2 layers, 4 query heads over 2 KV heads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench import gguf_files
from tests import kquants

# family -> (transformers model type, GGUF architecture, config values beyond the common ones)
FAMILIES = {
    "llama": ("llama", "llama", {}),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 128}),
    "mistral": ("mistral", "llama", {"sliding_window": None}),
    "gemma2": ("gemma2", "gemma2", {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3": ("gemma3_text", "gemma3", {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 8,
                                         "layer_types": ["sliding_attention", "sliding_attention"]}),
    "phi3": ("phi3", "phi3", {}),
}
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 256, 2, 4, 2, 512


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A transformers causal LM of `family` with random weights (norms perturbed around their neutral value)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, extra = FAMILIES[family]
    vocab = len(gguf_files.tokens()[0])
    values = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=vocab, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    values.update(extra)
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p)) if "gemma" not in model_type else p.normal_(0, 0.1)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


def as_file(model: torch.nn.Module, family: str, types: str | Callable[[str], str]) -> torch.nn.Module:
    """A copy of `model` holding the weights a file of `types` holds (each quantized tensor dequantized as gguf-py
    reads it): the dense reference the served file is compared with."""
    import copy

    import gguf
    from gguf.quants import dequantize

    choose, names = gguf_files._chooser(types), gguf_files.gguf_names(model)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for hf, tensor in out.state_dict().items():
            name = names.get(hf)
            if name is None or tensor.dim() == 1 or (hf == "lm_head.weight" and out.config.tie_word_embeddings):
                continue
            kind = choose(name)
            if kind != "F32":
                raw = kquants.quantize(tensor.float().numpy(), kind)
                values = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(tensor.shape)
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(values)))
    return out




def write_gguf(path: Path, model: torch.nn.Module, family: str, types: str | Callable[[str], str] = "F32") -> Path:
    """`model` as a GGUF file (bench/gguf_files.py), K-quants written by tests/kquants.py."""
    return gguf_files.write_gguf(path, model, types, quantize=kquants.quantize)
