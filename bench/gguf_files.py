"""GGUF files of Hugging Face models written as llama.cpp's converter lays them out, for models its converter cannot
take here (random weights of a real model's shape with a byte-level tokenizer; tests/gguf_fixtures.py's tiny models):
gguf-py's tensor names per architecture, q and k rows permuted for the `llama` architecture, Gemma's norm weights
with their 1 added, Phi-3's fused tensors as they are. Any tensor type gguf-py writes (F32, F16, Q8_0, Q4_0, Q5_0...);
`quantize` may supply others (tests/kquants.py writes K-quants); llama.cpp's `llama-quantize` makes real mixes.

The tokenizer is byte-level BPE over 256 byte tokens and 3 specials, padded with filler tokens to `vocab` entries
(a real model's vocabulary size: its embedding table and LM head cost what they would), with SmolLM2's chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "gemma2": "gemma2",
          "gemma3_text": "gemma3", "phi3": "phi3"}  # transformers model type -> GGUF architecture
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def tokens(vocab: int | None = None) -> tuple[list[str], list[str]]:
    """The tokenizer's tokens (padded with filler tokens to `vocab`) and merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "i n"]
    base = specials + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    return base + [f"tok{i}" for i in range(max(0, (vocab or 0) - len(base)))], merges


def add_tokenizer(w: object, toks: list[str], merges: list[str], specials: int = 3) -> None:
    """A byte-level BPE tokenizer's metadata (`tokens`: its first `specials` tokens control tokens, ids 0-2 as
    <|endoftext|>, <|im_start|>, <|im_end|>: unk, bos, eos / pad)."""
    import gguf

    w.add_vocab_size(len(toks))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types([gguf.TokenType.CONTROL] * specials + [gguf.TokenType.NORMAL] * (len(toks) - specials))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)


# a mix as llama-quantize's Q4_K_M makes it (its v and down in Q6_K, the table Q6_K), by GGUF tensor name
_Q6_IN_Q4_K_M = ("attn_v", "ffn_down", "token_embd", "output.")
MIXES: dict[str, Callable[[str], str]] = {
    "Q4_K_M": lambda name: "Q6_K" if any(p in name for p in _Q6_IN_Q4_K_M) else "Q4_K",
}


def _chooser(types: str | Callable[[str], str]) -> Callable[[str], str]:
    if not isinstance(types, str):
        return types
    return MIXES.get(types) or (lambda _name: types)


def gguf_names(model: torch.nn.Module) -> dict[str, str]:
    """The model's state-dict names -> the GGUF tensor names llama.cpp's converter gives them."""
    import gguf

    arch_name = ARCHES[model.config.model_type]
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    out = {}
    for hf in model.state_dict():
        base, _, suffix = hf.rpartition(".")
        name = names.get_name(base)
        if name is not None:
            out[hf] = f"{name}.{suffix}"
    return out


def write_gguf(path: Path, model: torch.nn.Module, types: str | Callable[[str], str] = "F32",
               quantize: Callable[[np.ndarray, str], np.ndarray] | None = None) -> Path:
    """`model` as a GGUF file of its architecture, each tensor (norms stay F32) in `types(name)`'s type (a mix's name
    in `MIXES`, a type for all, or a function of the tensor's GGUF name), quantized by `quantize` (default gguf-py)."""
    import gguf

    config = model.config
    model_type, arch_name = config.model_type, ARCHES[config.model_type]
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
    if model_type == "gemma2":
        w.add_float32(f"{arch_name}.attn_logit_softcapping", config.attn_logit_softcapping)
        w.add_float32(f"{arch_name}.final_logit_softcapping", config.final_logit_softcapping)
    toks, merges = tokens(config.vocab_size)
    add_tokenizer(w, toks, merges)
    w.add_chat_template(CHAT_TEMPLATE)
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
        elif kind == "F16":
            w.add_tensor(full, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            blocks = quantize(values.astype(np.float32), kind) if quantize else \
                gguf.quants.quantize(values.astype(np.float32), qtype)
            w.add_tensor(full, blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
