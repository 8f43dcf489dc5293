"""The engine on tiny random models: greedy exactness, cache correctness, join/leave, stops, seeds."""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import assert_same_draws, request, run


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_equals_target_greedy(tiny_engine_factory, prompt_ids, greedy_reference, method, k):
    engine = tiny_engine_factory()
    out = run(engine, [request(f"r{i}", p, method, k) for i, p in enumerate(prompt_ids)])
    assert out == greedy_reference


def test_mixed_methods_in_one_batch_equal_target_greedy(tiny_engine_factory, prompt_ids, greedy_reference):
    methods = ["none", "ngram", "draft", "draft", "ngram"]
    requests = [request(f"r{i}", p, m, 1 + i) for i, (p, m) in enumerate(zip(prompt_ids, methods, strict=True))]
    out = run(tiny_engine_factory(), requests)
    assert out == greedy_reference


def test_draft_that_equals_target_accepts_everything(tiny_target, tokenizer, prompt_ids):
    from server.config import Settings
    from server.engine.engine import Engine

    engine = Engine(tiny_target, tiny_target, Settings.load())
    for i, p in enumerate(prompt_ids):
        engine.add_requests([request(f"r{i}", p, "draft", 4, max_tokens=21)])
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.stats for o in engine.step().outputs if o.finished})
    for stats in final.values():
        assert stats.acceptance_rate == 1.0
        assert stats.decode_steps == 5  # 4 accepted + 1 bonus per step: 21 tokens in 5 steps
        assert stats.accepted_per_position == [4, 4, 4, 4]
        assert stats.bonus_tokens == 4 and stats.recovered_tokens == 0


def test_cache_after_uneven_acceptance_matches_fresh_forward(tiny_engine_factory, prompt_ids):
    engine = tiny_engine_factory()
    for i, p in enumerate(prompt_ids[:4]):
        engine.add_requests([request(f"r{i}", p, ["draft", "ngram", "draft", "none"][i], 3 + i, max_tokens=40)])
    for _ in range(5):
        engine.step()
    seqs = [engine.running[rid] for rid in engine.runner.rows]
    assert len({s.stats.accepted_tokens for s in seqs}) > 1  # rows really did accept different amounts
    logits = engine.runner.forward([[s.last_token] for s in seqs]).logits
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            fresh = engine.target.model(input_ids=torch.tensor([seq.tokens], device=engine.target.device)).logits[0, -1]
        torch.testing.assert_close(logits[b, 0], fresh, atol=1e-4, rtol=1e-4)


def test_joining_a_running_batch_gives_the_same_output_as_alone(tiny_engine_factory, prompt_ids, greedy_reference):
    engine = tiny_engine_factory()
    engine.add_requests([request("r0", prompt_ids[0], "draft", 3)])
    engine.add_requests([request("r1", prompt_ids[1], "ngram", 5)])
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(5)}
    for step in range(40):
        if step == 3:
            engine.add_requests([request("r2", prompt_ids[2], "draft", 2)])
        if step == 6:
            engine.add_requests([request("r3", prompt_ids[3], "none")])
            engine.add_requests([request("r4", prompt_ids[4], "ngram", 8)])
        for out in engine.step().outputs:
            got[out.request_id] += out.token_ids
        if step > 6 and not engine.has_unfinished():
            break
    assert got == greedy_reference


def test_abort_frees_the_slot_at_once(tiny_engine_factory, prompt_ids):
    engine = tiny_engine_factory()
    engine.add_requests([request("a", prompt_ids[0], "draft", 3, max_tokens=50)])
    engine.add_requests([request("b", prompt_ids[1], "ngram", 3, max_tokens=50)])
    engine.step()
    engine.abort_request("a")
    assert engine.runner.rows == ["b"] and engine.proposer("draft").runner.rows == []
    assert {o.request_id for o in engine.step().outputs} == {"b"}


def test_max_tokens_and_stop_strings(tiny_engine_factory, tokenizer, prompt_ids, greedy_reference):
    engine = tiny_engine_factory()
    text = tokenizer.decode(greedy_reference["r3"])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    outs = {}
    engine.add_requests([request("len", prompt_ids[3], "draft", 8, max_tokens=5)])
    engine.add_requests([request("stop", prompt_ids[3], "ngram", 8, stop=(stop,))])
    texts = {"len": "", "stop": ""}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            texts[o.request_id] += o.text
            if o.finished:
                outs[o.request_id] = o
    assert outs["len"].finish_reason == "length" and outs["len"].stats.completion_tokens == 5
    assert outs["stop"].finish_reason == "stop"
    assert texts["stop"] == text[: text.index(stop)]
    assert stop not in texts["stop"]


def test_eos_stops_and_later_accepted_tokens_are_dropped(tiny_target, tokenizer, monkeypatch):
    from server.config import Settings
    from server.engine import engine as engine_module
    from server.engine.engine import Engine

    # Find where greedy output of a prompt lands, then build an engine whose model's EOS id is its 3rd token.
    prompt = tokenizer.encode("count: 1 2 3")
    ref = run(Engine(tiny_target, tiny_target, Settings.load()), [request("r", prompt, max_tokens=10)])["r"]
    monkeypatch.setattr(engine_module, "_eos_ids", lambda model: {ref[2]})
    engine = Engine(tiny_target, tiny_target, Settings.load())
    out = run(engine, [request("s", prompt, "draft", 8, max_tokens=10, ignore_eos=False)])["s"]
    assert out == ref[: ref.index(ref[2]) + 1]


@pytest.mark.slow
def test_seed_reproduces_sampled_output(tiny_engine_factory, prompt_ids):
    reqs = lambda: [request(f"r{i}", p, "draft", 3, temperature=1.0, seed=7 + i) for i, p in enumerate(prompt_ids)]  # noqa: E731
    first = run(tiny_engine_factory(), reqs())
    second = run(tiny_engine_factory(), reqs())
    assert first == second
    alone = run(tiny_engine_factory(), reqs()[2:3])
    assert alone["r2"] == first["r2"]


@pytest.mark.slow
def test_a_seed_samples_the_same_text_whatever_the_ngram_drafts(tiny_engine_factory, tiny_target, prompt_ids):
    """N-gram drafts never change what a seeded request samples. Exactly: the same seed, method and
    batch give the same text. Across verify widths (none, ngram at any K, auto, alone or batched) the
    target's p is computed by differently shaped matrix products, so floats differ in the last bits;
    the texts are equal up to a tie at a CDF boundary: wherever they first differ, the request's own
    uniform draw lay within float noise of the boundary between the two tokens."""
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 24}

    def sampled(method: str, k: int, batch: bool) -> list[int]:
        reqs = [request("seeded", prompt_ids[1], method, k, **params)]
        if batch:
            reqs += [request(f"other{i}", p, "ngram", 6, temperature=1.0) for i, p in enumerate(prompt_ids[2:])]
        return run(tiny_engine_factory(), reqs)["seeded"]

    reference = sampled("none", 4, batch=False)
    assert sampled("none", 4, batch=False) == reference
    assert sampled("ngram", 4, batch=True) == sampled("ngram", 4, batch=True)
    for method, k, batch in [("ngram", 1, False), ("ngram", 8, False), ("auto", 8, False),
                             ("ngram", 4, True), ("auto", 8, True)]:
        got = sampled(method, k, batch)
        assert len(got) == len(reference)
        assert_same_draws(tiny_target.model, prompt_ids[1], got, reference, params, (method, k, batch))


def test_bad_requests_are_refused_with_a_message(tiny_engine_factory, prompt_ids):
    """The engine's limits are the one check of a request (the scheduler and the API call it)."""
    limits = tiny_engine_factory(max_model_len=64).limits
    with pytest.raises(ValueError, match="maximum context length"):
        limits.check(request("long", prompt_ids[0], max_tokens=200))
    with pytest.raises(ValueError, match="empty"):
        limits.check(request("empty", []))
    with pytest.raises(ValueError, match="token ids"):
        limits.check(request("oob", [10**9]))
    no_draft = tiny_engine_factory(draft=None).limits
    assert no_draft.methods == ("none", "ngram", "suffix", "auto")
    with pytest.raises(ValueError, match="not available on this server"):
        no_draft.check(request("d", prompt_ids[0], "draft"))


@pytest.mark.parametrize("extra", [64, -16])
def test_draft_with_a_differently_padded_vocabulary(tiny_target, tokenizer, prompt_ids, greedy_reference, extra):
    """Same tokenizer, different embedding rows (as Qwen2.5 7B vs 0.5B): still exact and lossless."""
    from server.config import Settings
    from server.engine.engine import Engine
    from tests.models import as_loaded, tiny_llama

    draft = as_loaded(tiny_llama(tiny_target.model.config.vocab_size + extra, seed=3), tokenizer, "padded")
    requests = [request(f"r{i}", p, "draft", 3) for i, p in enumerate(prompt_ids)]
    out = run(Engine(tiny_target, draft, Settings.load()), requests)
    assert out == greedy_reference


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_a_lookahead_draft_ends_at_a_token_that_would_end_the_request(tiny_engine_factory, method, monkeypatch):
    """A copy of earlier text runs on past its end-of-turn (an agent's last answer, then the next turn's
    header): nothing after a token that ends the request can be emitted, so the draft stops there and
    the pass verifies no more; a request with `ignore_eos`, or whose stop token it is not, drafts on."""
    engine = tiny_engine_factory()
    eos = min(engine.eos_ids)
    text = [101, 102, 103, 104, eos, 201, 202, 203, 204, 205, 206]
    prompt = [*text, *text[:4]]  # ends like the text before its end-of-turn
    plans = {}
    for rid, sampling in (("eos", {"ignore_eos": False}), ("ignore", {}), ("stop", {"stop_token_ids": [202]})):
        engine.add_requests([request(rid, prompt, method, 8, max_tokens=16, **sampling)])
    plan = engine.planner.plan

    def first(seqs, *args):  # the first step's plan: its prompts computed, the rows draft from them
        out = plan(seqs, *args)
        for seq, row in zip(seqs, out.rows, strict=True):
            plans.setdefault(seq.request_id, row.drafts)
        return out

    monkeypatch.setattr(engine.planner, "plan", first)
    engine.step()
    assert plans["ignore"] == (text * 2)[4 : 4 + len(plans["ignore"])] and len(plans["ignore"]) > 2
    assert plans["eos"] == [eos]
    assert plans["stop"] == [eos, 201, 202] if method != "auto" else len(plans["stop"]) <= 3
