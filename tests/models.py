"""Tiny randomly initialised causal LMs for tests (no downloads): a target and a draft that differs."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn
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


def write_tiny_gguf(
    path: Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, quant: str | None = None,
    cycle: list[int] | None = None, merges: tuple[str, ...] = ("Ġ t", "h e", "i n"),
) -> Path:
    """A tiny Llama as a real GGUF file (a byte-level BPE tokenizer of ~260 tokens) that transformers
    dequantizes in well under a second: the loading path and the weights cache on a file like the built-in
    model's, without its 20 s. `quant`: None for float32 tensors; "Q4_0", "Q4_1" or "Q8_0" for the linear
    layers in that type (quantized by gguf's reference code) and, as in SmolLM2's file, the embedding table
    (tied to the output layer) in Q8_0. q and k are written permuted per head, as llama.cpp's converter
    writes them. `cycle`: instead of random weights, `cycling_llama`'s (the greedy text repeats these token
    ids of the file's tokenizer forever; its own output matrix, in the table's type). `merges`: the
    tokenizer's BPE merges, each adding a token (another list: a file whose tokenizer differs)."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from bench.gguf_files import add_tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = list(merges)
    tokens = specials + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    heads, kv_heads, ffn = 4, 2, 2 * hidden
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    add_tokenizer(w, tokens, merges, specials=len(specials))
    rng = np.random.default_rng(seed)
    fixed = _cycling_tensors(len(tokens), hidden, cycle) if cycle is not None else {}

    def add(name: str, *shape: int, kind: str | None = quant) -> None:
        values = fixed[name] if name in fixed else (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if cycle is not None and name.endswith(("attn_output.weight", "ffn_down.weight")):
            values = np.zeros(shape, np.float32)
        if ".attn_q." in name or ".attn_k." in name:  # llama.cpp's per-head row permutation
            n_head = heads if ".attn_q." in name else kv_heads
            values = values.reshape(n_head, 2, shape[0] // n_head // 2, shape[1]).swapaxes(1, 2).reshape(shape)
        if kind is None:
            w.add_tensor(name, values)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", len(tokens), hidden, kind="Q8_0" if quant else None)  # tied to the output layer
    kv = hidden // heads * kv_heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            add(f"blk.{i}.{name}.weight", *shape)
    if cycle is not None:  # its own output matrix (a cycling model's head is not its table)
        add("output.weight", len(tokens), hidden, kind="Q8_0" if quant else None)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _cycling_tensors(vocab: int, hidden: int, cycle: list[int]) -> dict:
    """`cycling_llama`'s embedding table and output matrix (numpy, GGUF's tensor names); the layers' output
    projections are zero (`write_tiny_gguf` writes every `attn_output` and `ffn_down` as zeros)."""
    import numpy as np

    assert len(set(cycle)) == len(cycle) and len(cycle) < hidden, "distinct tokens, fewer than hidden"
    embed = np.zeros((vocab, hidden), np.float32)
    embed[:, 0] = 1.0
    head = np.zeros((vocab, hidden), np.float32)
    head[cycle[0], 0] = 1.0
    for i, token in enumerate(cycle):
        embed[token, i + 1] = 4.0
        head[cycle[(i + 1) % len(cycle)], i + 1] = 10.0
    return {"token_embd.weight": embed, "output.weight": head}


def copying_head(target: nn.Module, directory: Path, name: str = "tiny-cycling") -> Path:
    """An EAGLE head (server/draft_head/model.py) for a cycling model (`cycling_llama`, `write_tiny_gguf(cycle=)`)
    that drafts exactly what the target will say: its fc passes the next token's embedding through ([I, 0]), its
    layer adds nothing (zero output projections), so its feature is that embedding, whose logits under the
    target's head rank the token's successor first, as the target's own normalised feature does. Saved in
    `directory` (the `draft_head` setting); its FR vocabulary is the whole vocabulary."""
    from server.draft_head.model import EagleHead, vocab_rows

    head = EagleHead.create(target, list(range(vocab_rows(target.get_output_embeddings()))), name)
    hidden = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
        head.fc.bias.zero_()
        for layer in head.decoder.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    head.save_pretrained(directory, dtype=torch.float32)
    return directory
