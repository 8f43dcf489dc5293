"""Every method the server lists drafts on a copy-heavy prompt, has drafts accepted, and keeps `none`'s greedy text.

A test that cannot pass on a dead method: a proposer that fails safe answers with plain decoding's text, so text
equality alone never noticed one that drafted nothing (a bf16 self-draft once failed at every step, and the suite
stayed green). Here each of `ngram`, `suffix`, `eagle`, `draft` (its draft in every `--draft-dtype`) and `auto`
must draft and have drafts accepted, alone and all in one batch, nothing may fall back, and every text is
`none`'s. The target is a tiny model whose greedy text repeats a sentence (tests/models.py `cycling_llama`), dense
fp32 and as a quantized GGUF on the C decoder; its EAGLE head drafts exactly what it will say (`copying_head`).
"""

from __future__ import annotations

import pytest

from server.config import Settings
from server.engine.engine import Engine
from server.model.loading import LoadedModel, load_draft_like, load_model
from tests.engine_helpers import request, run_with_stats
from tests.models import copying_head, write_tiny_gguf

METHODS = ("ngram", "suffix", "eagle", "draft", "auto")
GGUF_CYCLE = list(range(40, 60))  # token ids of the tiny GGUF's tokenizer its cycling weights repeat
CYCLING_TEXT = " Speculative decoding checks several guessed tokens in one pass of the model."  # conftest's cycle


@pytest.fixture(scope="module")
def targets(request, tmp_path_factory) -> dict[str, tuple[LoadedModel, list[int], object]]:
    """kind -> (a cycling target, a copy-heavy prompt for it, its copying head's directory): "fp32" the dense tiny
    model on the SmolLM2 tokenizer, "as-file" the GGUF one served as its quantized blocks (the C decoder)."""
    dense = request.getfixturevalue("cycling_target")
    root = tmp_path_factory.mktemp("cycling-gguf")
    path = write_tiny_gguf(root / "cycling.gguf", hidden=64, quant="Q8_0", cycle=GGUF_CYCLE)
    quantized = load_model(str(path), device="cpu", weights="as-file", cache_dir=root / "cache")
    dense_cycle = dense.tokenizer.encode(CYCLING_TEXT)
    out = {}
    for kind, model, cycle in (("fp32", dense, dense_cycle), ("as-file", quantized, GGUF_CYCLE)):
        out[kind] = (model, cycle[:6] + cycle[:3] + cycle[:4], copying_head(model.model, root / f"head-{kind}"))
    return out


def engine_with(targets, kind: str, draft_dtype: str) -> tuple[Engine, list[int]]:
    model, prompt, head = targets[kind]
    draft = load_draft_like(model, "target", dtype=draft_dtype, cache_dir=None)
    engine = Engine(model, draft, Settings.load(device="cpu", draft_head=str(head)))
    assert engine.limits.methods == ("none", *METHODS[:2], "draft", "eagle", "auto")
    return engine, prompt


def assert_ran(stats, method: str) -> None:
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0, method
    assert method == "auto" or stats.by_proposer[method].accepted_tokens > 0, method
    assert stats.fallbacks == [], method


FAST = {("as-file", "auto"), ("as-file", "bfloat16")}  # the fast tier's (a bf16 LM head of 49,152 rows is slow)


@pytest.mark.parametrize(("kind", "draft_dtype"), [
    pytest.param(k, d, marks=() if (k, d) in FAST else pytest.mark.slow, id=f"{k}-{d}")
    for k in ("as-file", "fp32") for d in ("auto", "float32", "bfloat16", "float16")])
def test_every_method_drafts_is_accepted_and_keeps_nones_text(targets, kind, draft_dtype):
    engine, prompt = engine_with(targets, kind, draft_dtype)
    plain = run_with_stats(engine, [request("none", prompt, "none", max_tokens=24)])[0]["none"]
    for method in METHODS:
        tokens, stats = run_with_stats(engine, [request(method, prompt, method, 4, max_tokens=24)])
        assert_ran(stats[method], method)
        assert tokens[method] == plain, method
    assert engine.parts.report() == {}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["as-file", "fp32"])
def test_every_method_drafts_beside_the_others_in_one_batch(targets, kind):
    engine, prompt = engine_with(targets, kind, "bfloat16")
    plain = run_with_stats(engine, [request("none", prompt, "none", max_tokens=24)])[0]["none"]
    tokens, stats = run_with_stats(engine, [request(m, prompt, m, 4, max_tokens=24) for m in ("none", *METHODS)])
    for method in METHODS:
        assert_ran(stats[method], method)
    assert all(t == plain for t in tokens.values()) and engine.parts.report() == {}
