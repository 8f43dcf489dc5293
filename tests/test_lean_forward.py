"""The lean forward (server/model/lean_forward.py) computes what transformers' forward computes: the same
logits, hidden states and cache contents, padded or packed, from token ids or embeddings; models whose
layers are not Llama's keep transformers' forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaModel, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from server.model.attention import use_gqa_attention
from server.model.lean_forward import LeanForward
from server.model.runner import ModelRunner
from tests.models import tiny_llama

SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3)


def _ready(model):
    model.config._attn_implementation = "sdpa"
    use_gqa_attention(model)
    return model.eval().requires_grad_(False)


def _qwen2():
    torch.manual_seed(3)
    return _ready(Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False)))  # q/k/v with biases


def _pair(model, prompts, **join):
    lean, reference = ModelRunner(model), ModelRunner(model, lean=False)
    assert isinstance(lean.call, LeanForward) and reference.call is model
    ids = [f"r{b}" for b in range(len(prompts))]
    return lean, reference, lean.join(ids, prompts, **join), reference.join(ids, prompts, **join)


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: _ready(tiny_llama(1000, layers=3)), _qwen2], ids=["llama", "qwen2"])
def test_lean_steps_equal_transformers_padded_and_packed(make):
    model = make()
    prompts = [[5, 17, 99, 4, 8, 9], [7, 8], [300, 301, 302, 303]]
    lean, reference, h1, h2 = _pair(model, prompts, hidden=True)
    for a, b in zip(h1, h2, strict=True):  # prefill's hidden states (what an eagle head is given)
        _close(a, b)
    gen = torch.Generator().manual_seed(0)
    for counts in ([1, 1, 1], [4, 4, 4], [1, 7, 0], [2, 1, 3]):  # uniform, then packed (a held row too)
        fed = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in counts]
        a = lean.forward(fed, hidden=True, layers=(0, 1, 2))
        b = reference.forward(fed, hidden=True, layers=(0, 1, 2))
        assert a.computed == b.computed
        for row, n in enumerate(counts):
            _close(a.logits[row, :n], b.logits[row, :n])
            _close(a.hidden[row, :n], b.hidden[row, :n])
            for i in (0, 1, 2):
                _close(a.layers[i][row, :n], b.layers[i][row, :n])
        lean.rollback(1, 1), reference.rollback(1, 1)  # a rejected token: its column becomes a hole
        assert lean.kv.positions == reference.kv.positions
    for layer_a, layer_b in zip(lean.kv.cache.layers, reference.kv.cache.layers, strict=True):
        _close(layer_a.keys, layer_b.keys)
        _close(layer_a.values, layer_b.values)


@pytest.mark.parametrize("final_norm", ["rms", "identity"])
def test_lean_base_model_from_embeddings_equals_transformers(final_norm):
    """A draft head's decoder: a base model (no LM head, its final norm an identity) fed embeddings,
    hidden states out."""
    torch.manual_seed(1)
    model = _ready(LlamaModel(LlamaConfig(**SMALL)))
    if final_norm == "identity":
        model.norm = torch.nn.Identity()
    first = [torch.randn(5, 64), torch.randn(3, 64)]
    lean, reference, _, _ = _pair(model, first)
    for counts in ([1, 1], [3, 1]):
        fed = [torch.randn(n, 64) for n in counts]
        a, b = lean.forward(fed, logits=False, hidden=True), reference.forward(fed, logits=False, hidden=True)
        for row, n in enumerate(counts):
            _close(a.hidden[row, :n], b.hidden[row, :n])


def test_lean_bfloat16_follows_transformers_rounding():
    model = _ready(tiny_llama(1000)).to(torch.bfloat16)
    lean, reference, _, _ = _pair(model, [[5, 6, 7, 8], [9, 10]])
    a, b = lean.forward([[11, 12], [13, 14]]), reference.forward([[11, 12], [13, 14]])
    torch.testing.assert_close(a.logits, b.logits, atol=0.05, rtol=0.02)


def test_models_not_shaped_like_llama_keep_transformers_forward():
    plain_sdpa = tiny_llama(1000)  # transformers' own sdpa: not the engine's attention
    assert LeanForward.of(plain_sdpa) is None
    assert ModelRunner(plain_sdpa).call is plain_sdpa
    torch.manual_seed(0)
    windowed = _ready(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16)))
    assert LeanForward.of(windowed) is None  # a sliding window the engine's masks would not apply
    no_window = _ready(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)))
    assert isinstance(LeanForward.of(no_window), LeanForward)
    gelu = _ready(tiny_llama(1000))
    gelu.config.hidden_act = "gelu"
    assert LeanForward.of(gelu) is None
    wrapped = _ready(tiny_llama(1000))
    wrapped.model.layers[1].mlp.up_proj = torch.nn.Sequential(copy.deepcopy(wrapped.model.layers[1].mlp.up_proj))
    assert LeanForward.of(wrapped) is None  # a layer that is not a plain nn.Linear (quantized, adapters)


def test_the_engine_runs_the_lean_forward(tiny_engine_factory):
    engine = tiny_engine_factory()
    assert isinstance(engine.runner.call, LeanForward)
