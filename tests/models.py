"""Tiny randomly initialised causal LMs for tests (no downloads): a target and a draft that differs."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from server.engine.models import LoadedModel


def tiny_llama(
    vocab_size: int, *, seed: int = 0, layers: int = 2, hidden: int = 64, max_positions: int = 1024
) -> LlamaForCausalLM:
    """A 2-layer Llama whose random logits are peaked enough that greedy argmax has no near-ties."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees only partly."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())
    return draft


def as_loaded(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, name: str) -> LoadedModel:
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=torch.device("cpu"), dtype=torch.float32)
