"""Shared fixtures: the SmolLM2 tokenizer, tiny random target/draft models, and engines built on them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from server.config import Settings
from server.model.loading import LoadedModel, load_default_tokenizer
from tests.engine_helpers import PROMPTS, request, run
from tests.models import as_loaded, cycling_llama, perturbed, tiny_llama

CACHE_DIR = Path(os.environ.get("SPECULA_CACHE_DIR", Path.home() / ".cache" / "specula"))


@pytest.fixture(autouse=True, scope="session")
def bench_results_elsewhere(tmp_path_factory):
    """No test appends to the repository's benchmark ledger: bench code run by a test records into a
    temporary directory (`SPECULA_BENCH_RESULTS`, bench/ledger.py)."""
    before = os.environ.get("SPECULA_BENCH_RESULTS")
    os.environ["SPECULA_BENCH_RESULTS"] = str(tmp_path_factory.mktemp("bench-results"))
    yield
    if before is None:
        os.environ.pop("SPECULA_BENCH_RESULTS", None)
    else:
        os.environ["SPECULA_BENCH_RESULTS"] = before


@pytest.fixture(scope="session")
def tokenizer():
    return load_default_tokenizer(CACHE_DIR)


@pytest.fixture(scope="session")
def tiny_target(tokenizer) -> LoadedModel:
    return as_loaded(tiny_llama(len(tokenizer), seed=0), tokenizer, "tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_target, tokenizer) -> LoadedModel:
    """A draft close to the target (weights + noise): it agrees on some tokens, not all."""
    return as_loaded(perturbed(tiny_target.model, 0.05), tokenizer, "tiny-draft")


@pytest.fixture(scope="session")
def cycling_target(tokenizer) -> LoadedModel:
    """A tiny model that repeats one sentence forever (see `cycling_llama`): n-gram drafts land on it."""
    cycle = tokenizer.encode(" Speculative decoding checks several guessed tokens in one pass of the model.")
    return as_loaded(cycling_llama(len(tokenizer), cycle), tokenizer, "tiny-cycling")


@pytest.fixture
def tiny_engine_factory(tiny_target, tiny_draft) -> Callable[..., object]:
    """`factory(registry=..., cost=..., acceptance=..., policy=..., **settings_overrides) -> Engine` on the
    tiny models (draft included unless draft=None; `registry`: the proposers; `auto`'s parts injected)."""
    from server.engine.engine import Engine
    from server.speculation.registry import BUILTIN

    def make(registry=BUILTIN, cost=None, acceptance=None, policy=None, **overrides) -> Engine:
        with_draft = overrides.pop("draft", "target") is not None
        settings = Settings.load(**overrides)
        return Engine(tiny_target, tiny_draft if with_draft else None, settings, registry=registry, cost=cost,
                      acceptance=acceptance, policy=policy)

    return make


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def greedy_reference(tiny_target, tiny_draft, prompt_ids) -> dict[str, list[int]]:
    """Target-only greedy tokens, one prompt at a time (no batching at all)."""
    from server.config import Settings
    from server.engine.engine import Engine

    ref = {}
    for i, p in enumerate(prompt_ids):
        ref.update(run(Engine(tiny_target, None, Settings.load()), [request(f"r{i}", p)]))
    return ref
