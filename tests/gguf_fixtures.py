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

# every linear layer in one type, or a mix as llama-quantize's Q4_K_M makes it (its v and down in Q6_K, the table Q6_K)
_Q6_IN_Q4_K_M = ("attn_v", "ffn_down", "token_embd", "output.")
MIXES: dict[str, Callable[[str], str]] = {
    "Q4_K_M": lambda name: "Q6_K" if any(p in name for p in _Q6_IN_Q4_K_M) else "Q4_K",
}


def tokens() -> tuple[list[str], list[str]]:
    """The tokenizer's tokens and merges (tests/models.py's `write_tiny_gguf`)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "i n"]
    return specials + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges], merges


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A transformers causal LM of `family` with random weights (norms perturbed around their neutral value)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, extra = FAMILIES[family]
    vocab = len(tokens()[0])
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


def _chooser(types: str | Callable[[str], str]) -> Callable[[str], str]:
    if not isinstance(types, str):
        return types
    return MIXES.get(types) or (lambda _name: types)


def gguf_names(model: torch.nn.Module, family: str) -> dict[str, str]:
    """The model's state-dict names -> the GGUF tensor names llama.cpp's converter gives them."""
    import gguf

    arch_name = FAMILIES[family][1]
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    out = {}
    for hf in model.state_dict():
        base, _, suffix = hf.rpartition(".")
        name = names.get_name(base)
        if name is not None:
            out[hf] = f"{name}.{suffix}"
    return out


def as_file(model: torch.nn.Module, family: str, types: str | Callable[[str], str]) -> torch.nn.Module:
    """A copy of `model` holding the weights a file of `types` holds (each quantized tensor dequantized as gguf-py
    reads it): the dense reference the served file is compared with."""
    import copy

    import gguf
    from gguf.quants import dequantize

    choose, names = _chooser(types), gguf_names(model, family)
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
    """`model` as a GGUF file of `family`'s architecture, each tensor (norms stay F32) in `types(name)`'s type."""
    import gguf

    model_type, arch_name, _ = FAMILIES[family]
    config = model.config
    choose = _chooser(types)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch_name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(config.rope_parameters.get("rope_theta", 10000.0)
                               if "rope_theta" in config.rope_parameters else 10000.0))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    if getattr(config, "sliding_window", None):
        w.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        w.add_float32(f"{arch_name}.attn_logit_softcapping", config.attn_logit_softcapping)
        w.add_float32(f"{arch_name}.final_logit_softcapping", config.final_logit_softcapping)
    toks, merges = tokens()
    w.add_vocab_size(len(toks))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(toks) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    for hf, tensor in model.state_dict().items():
        base, _, suffix = hf.rpartition(".")
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(base)
        if name is None:
            continue
        values = tensor.detach().float().numpy().copy()
        if "gemma" in model_type and base.endswith("norm"):
            values = values + 1  # llama.cpp's converter writes Gemma's norms with their 1 added
        if arch_name == "llama" and (base.endswith("q_proj") or base.endswith("k_proj")) and suffix == "weight":
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            rows = values.shape[0]
            values = values.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(values.shape)
        full = f"{name}.{suffix}"
        kind = "F32" if values.ndim == 1 else choose(full)
        if kind == "F32":
            w.add_tensor(full, values.astype(np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(full, kquants.quantize(values.astype(np.float32), kind), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
