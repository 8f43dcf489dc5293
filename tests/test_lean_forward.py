"""The lean forward (server/model/lean_forward.py) computes what transformers' forward computes: the same
logits, hidden states and cache contents, padded or packed, from token ids or embeddings; models whose
layers are not Llama's keep transformers' forward."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaModel, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from server.model.attention import use_gqa_attention
from server.model.lean_forward import LeanForward, PackedLinear, linear_kernel, packs_linears
from server.model.memory import drop_file_pages
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


def _pair(model, prompts, pack=False, **join):
    lean, reference = ModelRunner(model), ModelRunner(model, lean=False)
    assert isinstance(lean.call, LeanForward) and reference.call is model
    lean.call = LeanForward.of(model, pack=pack)
    ids = [f"r{b}" for b in range(len(prompts))]
    return lean, reference, lean.join(ids, prompts, **join), reference.join(ids, prompts, **join)


def _close(a, b, packed=False):
    # the same GEMMs agree to 1e-5 here; oneDNN's (PackedLinear) round differently from MKL's, by ~1e-7
    # relative a product, which three layers of this model's large random weights grow to ~1e-5 relative
    tolerance = 2e-4 if packed else 1e-5
    torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


ONEDNN = packs_linears(torch.nn.Linear(2, 2))
PACKS = [False, pytest.param(True, marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN"))]


@pytest.mark.parametrize("pack", PACKS, ids=["dense", "onednn"])
@pytest.mark.parametrize("make", [lambda: _ready(tiny_llama(1000, layers=3)), _qwen2], ids=["llama", "qwen2"])
def test_lean_steps_equal_transformers_padded_and_packed(make, pack):
    model = make()
    prompts = [[5, 17, 99, 4, 8, 9], [7, 8], [300, 301, 302, 303]]
    lean, reference, h1, h2 = _pair(model, prompts, pack, hidden=True)
    assert lean.call.packed is pack
    close = functools.partial(_close, packed=pack)
    for a, b in zip(h1, h2, strict=True):  # prefill's hidden states (what an eagle head is given)
        close(a, b)
    gen = torch.Generator().manual_seed(0)
    for counts in ([1, 1, 1], [4, 4, 4], [1, 7, 0], [2, 1, 3]):  # uniform, then packed (a held row too)
        fed = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in counts]
        a = lean.forward(fed, hidden=True, layers=(0, 1, 2))
        b = reference.forward(fed, hidden=True, layers=(0, 1, 2))
        assert a.computed == b.computed
        for row, n in enumerate(counts):
            close(a.logits[row, :n], b.logits[row, :n])
            close(a.hidden[row, :n], b.hidden[row, :n])
            for i in (0, 1, 2):
                close(a.layers[i][row, :n], b.layers[i][row, :n])
        lean.rollback(1, 1), reference.rollback(1, 1)  # a rejected token: its column becomes a hole
        assert lean.kv.positions == reference.kv.positions
    for layer_a, layer_b in zip(lean.kv.cache.layers, reference.kv.cache.layers, strict=True):
        close(layer_a.keys, layer_b.keys)
        close(layer_a.values, layer_b.values)


@pytest.mark.parametrize("pack", PACKS, ids=["dense", "onednn"])
@pytest.mark.parametrize("make", [lambda: _ready(tiny_llama(1000, layers=3)), _qwen2], ids=["llama", "qwen2"])
def test_a_forward_scores_only_the_positions_asked_for(make, pack):
    """A verify pass whose rows also feed prompt tokens (engine.py: a riding prompt tail) scores each
    row's last `scored[b]` positions only: the same logits as a full forward's there, row after row, in
    the lean forward and in transformers'; hidden states for every fed position as before."""
    model = make()
    lean, reference, _, _ = _pair(model, [[5, 17, 99, 4], [7, 8], [300, 301, 302]], pack)
    close = functools.partial(_close, packed=pack)
    fed, scored = [[11, 12, 13], [14, 15], [16]], [1, 2, 0]
    full = lean.forward(fed, hidden=True)
    for b, x in enumerate(fed):
        lean.rollback(b, len(x))
    want = torch.cat([full.logits[0, 2:3], full.logits[1, 0:2]])
    for runner in (lean, reference):
        part = runner.forward(fed, hidden=True, scored=scored)
        logits, hidden = part.of_rows([0, 1, 2])
        assert logits.shape[0] == 3 and hidden.shape[0] == 6
        close(logits, want)
        close(hidden, full.of_rows([0, 1, 2])[1])


@pytest.mark.parametrize("pack", PACKS, ids=["dense", "onednn"])
@pytest.mark.parametrize("final_norm", ["rms", "identity"])
def test_lean_base_model_from_embeddings_equals_transformers(final_norm, pack):
    """A draft head's decoder: a base model (no LM head, its final norm an identity) fed embeddings,
    hidden states out."""
    torch.manual_seed(1)
    model = _ready(LlamaModel(LlamaConfig(**SMALL)))
    if final_norm == "identity":
        model.norm = torch.nn.Identity()
    first = [torch.randn(5, 64), torch.randn(3, 64)]
    lean, reference, _, _ = _pair(model, first, pack)
    for counts in ([1, 1], [3, 1]):
        fed = [torch.randn(n, 64) for n in counts]
        a, b = lean.forward(fed, logits=False, hidden=True), reference.forward(fed, logits=False, hidden=True)
        for row, n in enumerate(counts):
            _close(a.hidden[row, :n], b.hidden[row, :n], pack)


@pytest.mark.parametrize("pack", PACKS, ids=["dense", "onednn"])
def test_lean_bfloat16_follows_transformers_rounding(pack):
    model = _ready(tiny_llama(1000)).to(torch.bfloat16)
    if pack and not packs_linears(model):
        pytest.skip("no bf16 oneDNN kernel on this CPU")
    lean, reference, _, _ = _pair(model, [[5, 6, 7, 8], [9, 10]], pack)
    a, b = lean.forward([[11, 12], [13, 14]]), reference.forward([[11, 12], [13, 14]])
    torch.testing.assert_close(a.logits, b.logits, atol=0.05, rtol=0.02)


def test_a_sliding_window_is_applied_as_transformers_applies_it():
    """Mistral's window over the keys (each query sees its last 6 here), in prompt chunks, a verify pass and steps:
    the logits of transformers' whole-sequence forward, which masks with the window itself."""
    torch.manual_seed(0)
    model = _ready(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=6)))
    assert LeanForward.of(model) is not None
    tokens = [(11 * i) % 900 + 5 for i in range(20)]
    runner = ModelRunner(model)
    runner.join(["a"], [tokens[:9]], chunk=4)
    got = [runner.forward([tokens[9:14]]).logits[0]]
    got += [runner.forward([[t]]).logits[0] for t in tokens[14:20]]
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")  # transformers' own masks, the window in them
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, 9:20]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)


def test_models_not_shaped_like_llama_keep_transformers_forward():
    plain_sdpa = tiny_llama(1000)  # transformers' own sdpa: not the engine's attention
    assert LeanForward.of(plain_sdpa) is None
    assert ModelRunner(plain_sdpa).call is plain_sdpa
    torch.manual_seed(0)
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


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN")
def test_packed_linear_follows_its_weight():
    """A weight changed in place, replaced (a checkpoint loaded, a head trained on) or given new storage
    is reordered again."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True).requires_grad_(False)
    packed = PackedLinear(layer)
    x = torch.randn(9, 64)
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    layer.weight.mul_(-2.0)
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(96, 64), requires_grad=False)
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    layer.weight.data = torch.randn(96, 64)  # new storage, same parameter and version (what Module.to does)
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    head = torch.nn.Module()  # an output matrix kept as a buffer, no bias (the eagle head's FR vocabulary)
    head.register_buffer("matrix", torch.randn(50, 64))
    product = linear_kernel(head, True, weight="matrix", bias=None)
    assert isinstance(product, PackedLinear)
    torch.testing.assert_close(product(x), x @ head.matrix.T, atol=1e-5, rtol=1e-5)


def test_the_lean_forward_packs_only_where_onednn_runs_it():
    model = _ready(tiny_llama(1000))
    assert LeanForward.of(model, pack=False).packed is False
    assert LeanForward.of(model).packed is packs_linears(model)
    assert not packs_linears(model.to(torch.float16))  # no fp16 oneDNN path: F.linear


def test_runners_over_one_model_share_its_lean_forward_until_the_model_changes():
    """Reordering a model's weights costs time and their size again: every runner over the model (the
    engine's, calibration's scratch ones) shares one lean forward per kernel choice, made anew when a
    projection was replaced or the weights changed dtype; a deep copy of the model (a draft made from the
    target) gets its own."""
    model = _ready(tiny_llama(1000))
    first = ModelRunner(model).call
    assert isinstance(first, LeanForward) and ModelRunner(model).call is first
    assert LeanForward.of(model, pack=not first.packed) is not first  # the other kernel choice: its own
    copied = ModelRunner(copy.deepcopy(model)).call
    assert isinstance(copied, LeanForward) and copied is not first
    model.model.layers[0].mlp.up_proj = copy.deepcopy(model.model.layers[0].mlp.up_proj)
    replaced = ModelRunner(model).call
    assert replaced is not first
    model.to(torch.bfloat16)
    assert ModelRunner(model).call is not replaced


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN")
@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-head"])
def test_a_servers_model_drops_the_dense_weights_its_kernels_replace(tied):
    """On CPU the packed kernels hold reordered copies of the linear layers' weights; a server's model runs
    only through them, so the dense weights go: the same logits after, transformers' forward raises
    (never computes from missing weights), and an LM head tied to the input embeddings keeps its weight (the embedding
    lookup reads it)."""
    model = _ready(tiny_llama(1000, layers=3))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    runner = ModelRunner(model)
    prompt = [[5, 9, 13, 200, 7]]
    before = runner.join(["a"], prompt)
    projections = [p for layer in model.model.layers for p in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                   layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                   layer.mlp.down_proj)]
    dense = sum(p.weight.numel() * 4 for p in projections) + (0 if tied else model.lm_head.weight.numel() * 4)
    assert runner.release_dense() == dense
    assert runner.release_dense() == 0  # once
    assert all(p.weight.numel() == 0 for p in projections)
    assert (model.lm_head.weight.numel() == 0) is not tied
    after = ModelRunner(model)  # another runner over the model (calibration's) shares the packed kernels
    assert after.call is runner.call
    torch.testing.assert_close(after.join(["a"], prompt), before, atol=0, rtol=0)
    step = runner.forward([[3]]).logits
    again = after.forward([[3]]).logits
    torch.testing.assert_close(again, step, atol=0, rtol=0)
    with pytest.raises(RuntimeError):
        model(input_ids=torch.tensor(prompt))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux only")
def test_dropping_pages_of_weights_read_from_a_file_keeps_every_value(tmp_path):
    """Weights read zero-copy from a file leave the RSS when dropped (the kernel is told their pages
    will not be read); a page that is read again anyway comes back from the file with its values, and
    memory that is not mapped from a file (where the same advice would zero it) is left alone."""
    values = torch.arange(4 * 65536, dtype=torch.float32)
    path = tmp_path / "weights.bin"
    values.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32)
    assert torch.equal(mapped, values)  # every page faulted in
    heap = values.clone()
    assert drop_file_pages([mapped]) >= values.numel() * 4 - 2 * os.sysconf("SC_PAGE_SIZE")
    assert drop_file_pages([heap]) == 0
    assert torch.equal(mapped, values) and torch.equal(heap, values)


@pytest.mark.parametrize("width", [1, 5, 33])
def test_the_lean_rotary_embedding_is_transformers_bit_for_bit(width):
    """The lean forward rotates q and k (side by side, one call) as x*cos + roll(x)*signed sin: the same products
    as transformers' rotate_half form, so the same bits, not merely close ones (greedy exactness needs them)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from server.model.lean_forward import _rotate, _signed

    g = torch.Generator().manual_seed(width)
    q, k = torch.randn(2, 9, width, 64, generator=g), torch.randn(2, 3, width, 64, generator=g)
    angles = torch.rand(2, width, 32, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [batch, W, d]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    qk = torch.cat([q, k], dim=1).transpose(1, 2)  # [batch, W, heads, d] as the projection gives them
    got_q, got_k = _rotate(qk, cos[:, :, None], _signed(sin[:, :, None])).transpose(1, 2).split([9, 3], dim=1)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
