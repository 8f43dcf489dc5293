"""The server's own module tree (server/model/decoder.py) on a Llama: the same model as transformers' Llama, loaded
without transformers' modeling stack, and a server process that never imports it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from server.config import Settings
from server.draft_head.model import EagleHead
from server.model import checkpoints, decoder
from server.model.loading import LoadedModel, load_model
from server.model.runner import ModelRunner
from tests.engine_helpers import request, run
from tests.models import as_loaded, tiny_llama, write_tiny_gguf


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    """A tiny transformers Llama saved as a checkpoint directory, and the model itself."""
    model = tiny_llama(len(tokenizer), seed=5)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def test_a_llama_checkpoint_loads_on_the_servers_modules_and_computes_transformers_logits(checkpoint):
    path, reference = checkpoint
    loaded = load_model(str(path), device="cpu")
    model = loaded.model
    assert isinstance(model, decoder.CausalLM)
    assert type(load_model(str(path), device="cpu", modules="transformers").model).__name__ == "LlamaForCausalLM"
    assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    ids = torch.tensor([[5, 17, 40, 99, 120, 3, 77, 8], [9, 8, 7, 6, 5, 4, 3, 2]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_the_lean_forward_gives_the_same_bits_on_either_module_tree(checkpoint):
    """What the engine runs: prompt passes and a verify pass over two rows, logits and hidden states."""
    from server.model.attention import use_gqa_attention

    _, reference = checkpoint
    own = checkpoints.adopt(reference)
    assert isinstance(own, decoder.CausalLM) and own.lm_head.weight.data_ptr() == reference.lm_head.weight.data_ptr()
    for model in (reference, own):  # the engine's attention on both (adopt leaves the reference's as it was)
        use_gqa_attention(model)
    outs = []
    for model in (reference, own):
        runner = ModelRunner(model)
        runner.join(["a", "b"], [[5, 17, 40, 99, 120], [3, 77, 8]], hidden=True)
        out = runner.forward([[7, 8, 9], [10]], logits=True, hidden=True)
        outs.append((out.logits, out.hidden))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 100000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_rope_is_transformers_to_the_bit(rope):
    values = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 10, "max_position_embeddings": 1024,
              "rope_parameters": rope}
    theirs = LlamaRotaryEmbedding(LlamaConfig(**values))
    ours = decoder.Rotary(checkpoints.config_from_dict(values))
    assert torch.equal(ours.inv_freq, theirs.inv_freq) and ours.attention_scaling == theirs.attention_scaling
    x, positions = torch.zeros(1, 5, 64), torch.tensor([[0, 1, 2, 700, 1023]])
    for a, b in zip(ours(x, positions), theirs(x, positions), strict=True):
        assert torch.equal(a, b)


def test_older_configs_and_other_architectures(tmp_path):
    """A config.json of the older layout (`rope_theta` and `rope_scaling` apart) reads into one `rope_parameters`;
    what the tree does not serve exactly (dynamic RoPE, another architecture or activation) is refused, and
    `load_model` gives it transformers' modules."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_act": "silu", "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}, "num_attention_heads": 4}))
    config = checkpoints.read_config(tmp_path)
    assert {k: v for k, v in config.rope_parameters.items() if k != "type"} == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    assert config.num_key_value_heads == 4 and config.tie_word_embeddings is False and decoder.supports(config)
    base = {"model_type": "llama", "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
    assert decoder.supports(checkpoints.config_from_dict(base))
    for other in ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0, "factor": 2.0}},
                  {"model_type": "olmo"}, {"hidden_act": "gelu"}):
        assert not decoder.supports(checkpoints.config_from_dict({**base, **other})), other


def test_the_engine_serves_the_same_tokens_on_either_tree(tiny_target, tokenizer, prompt_ids, tmp_path):
    """Greedy output for plain decoding, n-gram drafts and an EAGLE head (loaded from a file saved from the
    transformers target: its decoder becomes decoder.py's for the server's tree)."""
    from server.engine.engine import Engine

    head = EagleHead.create(tiny_target.model, list(range(0, tiny_target.model.config.vocab_size, 2)), "tiny", seed=1)
    head.save_pretrained(tmp_path, dtype=torch.float32)
    settings = Settings.load(draft_head=str(tmp_path))
    own = LoadedModel(name="tiny", model=checkpoints.adopt(tiny_llama(len(tokenizer), seed=0)), tokenizer=tokenizer,
                      device=torch.device("cpu"), dtype=torch.float32)
    theirs = as_loaded(tiny_llama(len(tokenizer), seed=0), tokenizer, "tiny")
    for method in ("none", "ngram", "eagle"):
        engines = [Engine(model, None, settings) for model in (theirs, own)]
        if method == "eagle":
            head_decoder = engines[1].planner.proposers["eagle"].head.decoder  # type: ignore[attr-defined]
            assert isinstance(head_decoder, decoder.Decoder)
        outs = [run(e, [request(f"r{i}", p, method, 3) for i, p in enumerate(prompt_ids)]) for e in engines]
        assert outs[0] == outs[1], method


def test_a_server_process_never_imports_transformers_modeling_stack(tmp_path):
    """A GGUF served from the weights cache (the default model's path): loading, the draft head, the step-memory
    probe and the HTTP app leave transformers' modeling stack, torch._dynamo and sympy unimported (~120 MiB of
    resident memory in every server process), and transformers' Auto tables (5 MiB)."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant="Q4_1")
    load_model(str(path), device="cpu", cache_dir=tmp_path / "cache")  # the first load converts and caches
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import torch
        from server.draft_head.model import EagleHead
        from server.engine.memory import measure_step_memory
        from server.model.attention import use_gqa_attention
        from server.model.loading import load_model
        from server.model.runner import ModelRunner
        import server.api.app
        loaded = load_model({str(path)!r}, device="cpu", cache_dir=Path({str(tmp_path / "cache")!r}))
        use_gqa_attention(loaded.model)
        head = EagleHead.create(loaded.model, list(range(16)), "tiny")
        use_gqa_attention(head.decoder)
        measure_step_memory(loaded.model, loaded.model.config.vocab_size, True)
        runner = ModelRunner(loaded.model)
        runner.join(["a"], [[5, 6, 7]], hidden=True)
        ModelRunner(head.decoder).join(["a"], [torch.zeros(3, 64)])
        heavy = ["transformers.modeling_utils", "torch._dynamo", "sympy", "torch.distributed.tensor",
                 "transformers.models.auto.tokenization_auto"]
        print(type(loaded.model).__name__, [m for m in heavy if m in sys.modules])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "CausalLM []"


def test_a_sharded_checkpoint_with_tied_embeddings_loads_on_the_servers_modules(tokenizer, tmp_path):
    """Checkpoints as the hub ships them: weights in several safetensors shards named by an index, an LM head
    tied to the input embeddings (no tensor of its own in the files), the model saved in bf16."""
    reference = tiny_llama(len(tokenizer), seed=7)
    reference.config.tie_word_embeddings = True
    reference.tie_weights()
    reference.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="200KB")
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_model(str(tmp_path), device="cpu").model
    assert isinstance(model, decoder.CausalLM) and model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, as the file has it
    theirs = load_model(str(tmp_path), device="cpu", modules="transformers").model  # transformers' reading
    ids = torch.tensor([[5, 17, 40, 99, 120, 3]])
    with torch.no_grad():
        want = theirs(ids).logits
        got = model(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
