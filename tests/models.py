"""Tiny randomly initialised causal LMs for tests (no downloads): a target and a draft that differs."""

from __future__ import annotations

import copy
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from server.model.loading import LoadedModel

# Where the tiny models run: `SPECULA_TEST_DEVICE=cuda python -m pytest tests/...` runs the engine,
# proposer and sampler tests on a GPU (the default, cpu, is what CI and `make test` run).
TEST_DEVICE = torch.device(os.environ.get("SPECULA_TEST_DEVICE", "cpu"))


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
            param.add_(torch.randn(param.shape, generator=gen).to(param.device) * scale * param.std())
    return draft


def as_loaded(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, name: str) -> LoadedModel:
    model = model.to(TEST_DEVICE)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=TEST_DEVICE, dtype=torch.float32)


def cycling_llama(vocab_size: int, cycle: list[int], *, hidden: int = 64) -> LlamaForCausalLM:
    """A 1-layer Llama whose greedy output repeats `cycle` forever: text that copies itself, so n-gram
    drafts get accepted (a random model never repeats). Its layers add nothing (zero output
    projections), so the next token depends on the current one only: `cycle[i]` -> `cycle[i + 1]`
    (wrapping), any other token -> `cycle[0]`. Never EOS. Token ids in `cycle` must be distinct."""
    assert len(set(cycle)) == len(cycle) and len(cycle) < hidden, "distinct tokens, fewer than hidden"
    model = tiny_llama(vocab_size, layers=1, hidden=hidden)
    with torch.no_grad():
        for name, param in model.model.layers.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed = model.model.embed_tokens.weight  # [vocab, hidden]: dim 0 is on for every token
        embed.zero_()
        embed[:, 0] = 1.0
        head = model.lm_head.weight  # [vocab, hidden]
        head.zero_()
        head[cycle[0], 0] = 1.0  # the fallback: scores 1 for any token outside the cycle
        for i, token in enumerate(cycle):
            embed[token, i + 1] = 4.0  # cycle token i also lights dim i + 1 ...
            head[cycle[(i + 1) % len(cycle)], i + 1] = 10.0  # ... which makes its successor win
    return model
