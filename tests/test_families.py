"""Every served architecture (server/model/families/) on the server's own modules: the same model as transformers',
on the torch path and on the C decoder, from a Hugging Face checkpoint and from GGUF files of each block type.

Tiny random models (tests/gguf_fixtures.py: transformers builds them; gguf-py and tests/kquants.py write their
files as llama.cpp's converter lays them out). Random tiny models amplify rounding layer after layer: logits are
compared within a bound, greedy text only where both sides run the same arithmetic (across proposers, batches and
chunkings of one served model)."""

from __future__ import annotations

import copy

import pytest
import torch

from server.model import checkpoints, decoder, families
from server.model.attention import use_gqa_attention
from server.model.lean_forward import LeanForward
from server.model.loading import load_model
from server.model.quantize import quantize_linears
from server.model.quantized import Q4Linear, Q8Linear
from server.model.runner import ModelRunner
from server.model.tables import BlockTable
from tests.gguf_fixtures import FAMILIES, as_file, hf_model, write_gguf
from tests.kernel_marks import needs_kernels

pytestmark = pytest.mark.slow  # seconds a model: `make test` runs them, `make test-fast` does not
NAMES = list(FAMILIES)
IDS = [5, 17, 40, 99, 120, 3, 77, 8, 9, 10, 11, 12, 200, 201, 7, 33]


def _reference(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' own forward with its own masks (the window, the caps): eager attention."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", NAMES)
def test_the_servers_tree_computes_transformers_logits(family):
    reference = hf_model(family)
    own = checkpoints.adopt(reference)
    assert isinstance(own, decoder.CausalLM) and own.spec.family == family
    want = _logits(_reference(reference), IDS)
    torch.testing.assert_close(_logits(own, IDS), want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("family", NAMES)
def test_a_checkpoint_directory_loads_on_the_servers_modules(family, tmp_path, tokenizer):
    """A Hugging Face directory of each family (what a GPU user serves): the server's tree, every tensor in place
    (Phi-3's fused ones split), transformers' logits."""
    reference = hf_model(family)
    reference.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert isinstance(loaded.model, decoder.CausalLM) and loaded.model.spec.family == family
    want = _logits(_reference(reference), IDS)
    torch.testing.assert_close(_logits(loaded.model, IDS), want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("family", NAMES)
def test_the_lean_forward_in_chunks_and_steps_computes_transformers_logits(family):
    """What the engine runs (cache, masks, windows past their width), dense float32."""
    reference = hf_model(family)
    own = checkpoints.adopt(reference)
    use_gqa_attention(own)
    runner = ModelRunner(own)
    assert isinstance(runner.call, LeanForward)
    runner.join(["a"], [IDS[:7]], chunk=3)
    got = [runner.forward([IDS[7:12]]).logits[0]] + [runner.forward([[t]]).logits[0] for t in IDS[12:]]
    want = _logits(_reference(reference), IDS)[7:]
    torch.testing.assert_close(torch.cat(got), want, atol=2e-5 * float(want.abs().max()), rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("family", NAMES)
def test_the_c_decoder_is_the_torch_path_and_a_positions_bits_do_not_depend_on_its_pass(family, monkeypatch):
    """On float32 activations the C decoder and the lean forward's torch layers differ only in the order of float
    sums; on int8 activations (the default where the host lacks AVX-512) a position's logits are the same bits fed
    alone or within a verify pass."""
    own = checkpoints.adopt(hf_model(family))
    quantize_linears(own, "q4")
    use_gqa_attention(own)
    prompt, tail = IDS[:9], IDS[9:14]
    for int8 in ("0", "1"):
        monkeypatch.setenv("SPECULA_INT8_ACTIVATIONS", int8)
        model = copy.deepcopy(own)
        fast, slow = ModelRunner(model), ModelRunner(model)
        assert fast.call.decoder is not None, "every family runs on the C decoder"
        slow.call = LeanForward(model, model.model)
        slow.call.decoder = None
        for runner in (fast, slow):
            runner.join(["a"], [prompt])
        a, b = fast.forward([tail]).logits[0], slow.forward([tail]).logits[0]
        if int8 == "0":
            torch.testing.assert_close(a, b, atol=3e-5 * float(b.abs().max()), rtol=0)
        single = ModelRunner(model)
        single.join(["a"], [prompt])
        assert torch.equal(torch.cat([single.forward([[t]]).logits[0] for t in tail]), a)


TYPES = ["Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]


@needs_kernels
@pytest.mark.parametrize("family,types", [("llama", t) for t in TYPES] + [(f, "Q4_K_M") for f in NAMES[1:]])
def test_a_gguf_file_is_served_as_its_blocks_with_the_files_weights_and_logits(family, types, tmp_path, monkeypatch):
    """A file of each block type (and Q4_K_M's mix): every linear layer held as its blocks (none dequantized) with
    the file's weights (q/k unpermuted, fused tensors split), on the C decoder, with the logits of transformers'
    model holding those weights: within float32's rounding where every layer has float32 activations, within int8
    activations' rounding where some cannot (the K-quants, Q5_1: llama.cpp's run on int8 too)."""
    monkeypatch.setenv("SPECULA_INT8_ACTIVATIONS", "0")
    model = hf_model(family)
    path = write_gguf(tmp_path / f"{family}.gguf", model, family, types)
    served = load_model(str(path), device="cpu", weights="as-file").model
    read_as = families.by_gguf_arch(FAMILIES[family][1]).name  # Mistral's files are llama.cpp's `llama`
    assert isinstance(served, decoder.CausalLM) and served.spec.family == read_as
    reference = as_file(model, family, types)
    weights = checkpoints.split_fused(served.config, reference.state_dict())
    linears = {n: m for n, m in served.named_modules() if isinstance(m, Q4Linear | Q8Linear)}
    assert len(linears) == 7 * model.config.num_hidden_layers
    assert not [n for n, m in served.named_modules() if type(m) is torch.nn.Linear]
    for name, layer in linears.items():
        want = weights[f"{name}.weight"]
        assert (layer.dequantize() - want).abs().max() <= 8 * torch.finfo(torch.float32).eps * want.abs().max(), name
    use_gqa_attention(served)
    runner = ModelRunner(served)
    assert runner.call.decoder is not None
    runner.join(["a"], [IDS[:8]], chunk=5)
    got = torch.cat([runner.forward([IDS[8:12]]).logits[0]] + [runner.forward([[t]]).logits[0] for t in IDS[12:]])
    want = _logits(_reference(reference), IDS)[8:]
    exact = not any(m.int8_activations() for m in linears.values())
    assert exact == (types in ("Q4_0", "Q5_0", "Q8_0", "Q4_K"))
    # a table in another type than Q8_0 / Q6_K is held as fp16 values: its head rounds the weights to 11 bits
    table = served.get_input_embeddings()
    bound = (2e-5 if isinstance(table, BlockTable) else 2e-3) if exact else 0.08
    assert (got - want).abs().max() <= bound * float(want.abs().max())


def test_what_is_not_served_says_why(tmp_path):
    from transformers import AutoConfig

    from tests.models import write_tiny_gguf

    long_rope = AutoConfig.for_model("phi3", rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
        "original_max_position_embeddings": 4096}, max_position_embeddings=131072)
    assert "longrope" in families.unsupported(long_rope) and families.family_of(long_rope) is None
    assert "'gpt2'" in families.unsupported(AutoConfig.for_model("gpt2"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant="Q4_1")
    import gguf

    reader = gguf.GGUFReader(str(path))
    assert families.by_gguf_arch(str(reader.fields["general.architecture"].contents())).name == "llama"
    assert families.by_gguf_arch("rwkv7") is None


@needs_kernels
@pytest.mark.parametrize("family", NAMES)
def test_greedy_text_is_the_same_across_proposers_batches_and_chunkings(family, tmp_path):
    """A Q4_K_M file of each family in the engine: none, ngram, suffix and auto give the same greedy tokens, with
    the rows decoding together, and with prompts cut into chunks by a small step budget (n-gram drafts, so the
    verify passes are several tokens wide)."""
    from server.config import Settings
    from server.engine.engine import Engine
    from tests.engine_helpers import request, run_with_stats

    path = write_gguf(tmp_path / f"{family}.gguf", hf_model(family), family, "Q4_K_M")
    loaded = load_model(str(path), device="cpu", weights="as-file")
    loop = [40, 41, 42, 43, 44, 45, 46, 47]
    prompts = [loop * 5, [9, 8, 7] + loop * 3 + [100, 101], IDS * 2]
    outs = {}
    for budget in (None, 12):
        settings = Settings.load(calibrate=False, max_batch_size=4, num_speculative_tokens=4,
                                 auto_max_speculative_tokens=8, max_num_batched_tokens=budget, draft_head=None)
        engine = Engine(loaded, None, settings)
        for method in ("none", "ngram", "suffix", "auto"):
            tokens, stats = run_with_stats(engine, [request(f"{method}{i}", p, method, 4, max_tokens=12)
                                                    for i, p in enumerate(prompts)])
            outs[budget, method] = [tokens[f"{method}{i}"] for i in range(len(prompts))]
            if method == "ngram":
                assert sum(s.draft_tokens for s in stats.values()) > 0  # verify passes wider than one token
    first = outs[None, "none"]
    assert all(len(t) == 12 for t in first)
    for key, got in outs.items():
        assert got == first, key
