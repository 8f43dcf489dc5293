"""Random-weight models of real models' shapes as GGUF files, quantized by llama.cpp's own `llama-quantize`: what
the peer bench times when the real weights cannot be downloaded here (speed depends on shapes and block types, not
on what the weights say).

    python -m bench.shapes qwen2.5-0.5b [--type Q4_K_M]     # prints the cached file's path, building it first

A shape is a transformers config (the released model's `config.json` values); its weights are drawn from
N(0, 0.02) (norms 1), written as an F16 GGUF (bench/gguf_files.py: a byte-level tokenizer padded to the real
vocabulary, SmolLM2's chat template) and quantized to `--type` with llama.cpp's quantizer, so the file mixes types
exactly as a downloaded Q4_K_M of that model does (Qwen2.5-0.5B's rows of 896 inputs are not a multiple of 256:
its Q4_K_M holds Q5_0 and Q8_0 beside Q4_K and Q6_K). Cached under ~/.cache/specula/shapes/.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

CACHE = Path.home() / ".cache" / "specula" / "shapes"

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "head_dim": 64,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "rope_theta": 500000.0},
}


def random_model(shape: str, seed: int = 0):
    """The shape's transformers model with random weights, for writing out (never run: its RoPE buffers are unset)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(SHAPES[shape])
    config = AutoConfig.for_model(values.pop("model_type"), bos_token_id=1, eos_token_id=2, pad_token_id=2, **values)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu").eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0, 0.02)
    model.tie_weights()
    return model  # (RoPE's buffers are left unset: only the weights are written)


def shape_file(shape: str, kind: str = "Q4_K_M") -> Path:
    """The cached GGUF of `shape` in `kind`, built when missing (an F16 file, then llama-quantize)."""
    from bench import gguf_files
    from bench.llamacpp import quantize

    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / f"{shape}-random-{kind}.gguf"
    if target.is_file():
        return target
    f16 = CACHE / f"{shape}-random-F16.gguf"
    if not f16.is_file():
        part = f16.with_suffix(".part")
        gguf_files.write_gguf(part, random_model(shape), "F16")
        os.replace(part, f16)
    return quantize(f16, target, kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_K_M")
    args = parser.parse_args()
    print(shape_file(args.shape, args.type))


if __name__ == "__main__":
    main()
