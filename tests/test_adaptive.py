"""`auto`: decisions on synthetic acceptance histories, and greedy output unchanged by it."""

from __future__ import annotations

import random

import pytest

from server.speculation.adaptive import (
    PROBE_OVERHEAD,
    AdaptivePolicy,
    BatchRow,
    CostModel,
    _Acceptance,
    _SeqState,
    best_k,
    speedup,
)
from tests.engine_helpers import request, run


def policy_with_costs(draft_forward_ratio: float = 0.75, token_ratio: float = 0.05) -> AdaptivePolicy:
    cost = CostModel()
    for n in (1, 2, 4, 8, 1, 2, 4, 8):  # T(n) = 1 + token_ratio * (n - 1)
        cost.observe_verify(n, 1.0 + token_ratio * (n - 1))
    cost.observe_draft(4, 4 * draft_forward_ratio)
    return AdaptivePolicy(["ngram", "draft"], draft_token_cost={"ngram": 0.002}, cost=cost)


def feed(policy: AdaptivePolicy, rid: str, method: str, rate: float, steps: int = 20, k: int = 4) -> None:
    for _ in range(steps):
        policy.observe(rid, method, k, round(rate * k))


def test_speedup_formula():
    assert speedup(0.0, 4, 0.5) == pytest.approx(1 / 3)
    assert speedup(1.0, 4, 0.0) == 5.0
    assert speedup(0.8, 3, 0.1) == pytest.approx((1 - 0.8**4) / (0.2 * 1.3))
    assert best_k(0.1, 0.5, 8) == (0, 1.0)  # nothing beats plain decoding
    assert best_k(0.95, 0.01, 8)[0] == 8


def test_low_acceptance_turns_speculation_off():
    policy = policy_with_costs()
    feed(policy, "r", "ngram", 0.0)
    feed(policy, "r", "draft", 0.1)
    choice = policy.choose("r", k_max=8, rows=1, has_match=True)
    assert choice.method == "none" and choice.k == 0


def test_high_acceptance_raises_k():
    policy = policy_with_costs()
    feed(policy, "lo", "ngram", 0.5)
    feed(policy, "hi", "ngram", 1.0)
    lo = policy.choose("lo", k_max=8)
    hi = policy.choose("hi", k_max=8)
    assert lo.method == hi.method == "ngram"
    assert hi.k > lo.k and hi.k == 8


def test_cheap_proposer_wins_at_equal_acceptance_and_no_match_falls_back():
    policy = policy_with_costs(draft_forward_ratio=0.75)
    feed(policy, "r", "ngram", 0.9)
    feed(policy, "r", "draft", 0.9)
    assert policy.choose("r", 8, 1, has_match=True).method == "ngram"
    assert policy.choose("r", 8, 1, has_match=False).method == "draft"
    expensive = policy_with_costs(draft_forward_ratio=1.2)
    feed(expensive, "r", "draft", 0.9)
    assert expensive.choose("r", 8, 1, has_match=False).method == "none"


def test_k_shrinks_as_verification_stops_being_free():
    policy = policy_with_costs(token_ratio=0.1)
    rng = random.Random(0)
    for _ in range(60):  # independent per-token acceptance 0.7: leading successes out of 8
        accepted = next((j for j in range(8) if rng.random() >= 0.7), 8)
        policy.observe("r", "ngram", 8, accepted)
    alone = policy.choose("r", k_max=8, rows=1).k
    crowded = policy.choose("r", k_max=8, rows=8).k  # each verified token costs its share
    assert 0 < crowded < alone


def test_unused_proposer_is_probed_now_and_then_within_a_cost_budget():
    policy = policy_with_costs()
    feed(policy, "r", "ngram", 0.0)
    feed(policy, "r", "draft", 0.0)
    steps = 64
    choices = [policy.choose("r", 8, 1, has_match=True) for _ in range(steps)]
    probes = [c for c in choices if c.method != "none"]
    assert probes and all(c.k == 1 for c in probes)
    spent = sum(policy.method_cost(c.method, 1) for c in probes)
    assert spent <= 2 * PROBE_OVERHEAD * steps + max(policy.method_cost(m, 1) for m in ("ngram", "draft"))
    assert sum(c.method == "ngram" for c in probes) > sum(c.method == "draft" for c in probes)


def test_auto_keeps_greedy_output_identical(tiny_engine_factory, prompt_ids, greedy_reference):
    engine = tiny_engine_factory()
    out = run(engine, [request(f"r{i}", p, "auto", 8) for i, p in enumerate(prompt_ids)])
    assert out == greedy_reference


def test_auto_with_a_perfect_cheap_draft_speculates(tiny_target, prompt_ids):
    """A draft that always agrees and (as if it were small) costs 5% of a step: auto must use it."""
    from server.config import Settings
    from server.engine.engine import Engine

    engine = Engine(tiny_target, tiny_target, Settings.load())
    engine.policy.fixed_cost["draft"] = 0.05  # the same weights cost a full step; pretend it is small
    for i, p in enumerate(prompt_ids):
        engine.add_request(request(f"r{i}", p, "auto", 4, max_tokens=30))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.stats for o in engine.step().outputs if o.finished})
    assert all(s.draft_tokens > 0 and s.acceptance_rate > 0.9 for s in done.values())
    assert all(s.decode_steps < 15 for s in done.values())  # 30 tokens in well under 30 passes


def test_auto_does_not_use_a_draft_that_costs_a_full_step(tiny_target, prompt_ids):
    """The same weights as draft agree on everything but cost as much as the target: never pays."""
    from server.config import Settings
    from server.engine.engine import Engine

    engine = Engine(tiny_target, tiny_target, Settings.load(ngram_min=16, ngram_max=16))  # no n-gram matches
    for i, p in enumerate(prompt_ids):
        engine.add_request(request(f"r{i}", p, "auto", 4, max_tokens=40))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.stats for o in engine.step().outputs if o.finished})
    for stats in done.values():  # after the first measured steps, only rare K=1 probes
        assert stats.draft_tokens <= 8


def test_seeded_sampling_under_auto_reproduces_whatever_the_timings(tiny_engine_factory, prompt_ids):
    def sample_once(draft_cost: float) -> dict[str, list[int]]:
        engine = tiny_engine_factory()
        # Measured costs differ from run to run; a seeded request's tokens must not follow them.
        engine.policy.cost.draft_cost = lambda rows: draft_cost
        reqs = [request(f"r{i}", p, "auto", 6, temperature=1.0, seed=3 + i) for i, p in enumerate(prompt_ids)]
        out = run(engine, reqs)
        # the draft model samples from the request's stream, so seeded requests never use it
        assert not engine.proposers["draft"].kv.cache.layers[0].is_initialized
        return out

    assert sample_once(0.01) == sample_once(5.0)


def test_unseeded_auto_follows_the_measured_costs(tiny_engine_factory, prompt_ids):
    """The counterpart of the test above: without a seed, the timings do steer the choice."""
    used = {}
    for cost in (0.01, 5.0):
        engine = tiny_engine_factory(ngram_min=16, ngram_max=16)
        engine.policy.cost.draft_cost = lambda rows, c=cost: c
        engine.policy.prior["draft"] = 0.9
        for i, p in enumerate(prompt_ids):
            engine.add_request(request(f"r{i}", p, "auto", 6, temperature=1.0))
        drafted = 0
        while engine.has_unfinished():
            drafted += sum(s.draft_tokens for s in engine.step().seq_stats)
        used[cost] = drafted
    assert used[0.01] > 4 * max(used[5.0], 1)


def test_a_proposer_that_cannot_pay_is_never_probed():
    policy = policy_with_costs(draft_forward_ratio=1.3)  # the bf16 copy on one CPU thread, measured
    feed(policy, "r", "draft", 0.1)
    choices = [policy.choose("r", 8, 1, has_match=False) for _ in range(64)]
    assert all(c.method == "none" for c in choices)


def test_auto_sequences_never_using_the_draft_never_prefill_it(tiny_engine_factory, prompt_ids):
    engine = tiny_engine_factory(ngram_min=16, ngram_max=16)
    engine.policy.cost.draft_cost = lambda rows: 5.0  # far too slow to ever pay
    run(engine, [request(f"r{i}", p, "auto", 4) for i, p in enumerate(prompt_ids)])
    draft_kv = engine.proposers["draft"].kv
    assert not draft_kv.cache.layers[0].is_initialized  # no draft forward ever ran


def test_runs_of_copying_favour_long_drafts():
    """Same overall acceptance (50%), different shape: all-or-nothing runs (copying) pay for a long
    K, independent coin flips don't."""
    bursty, coins = policy_with_costs(token_ratio=0.1), policy_with_costs(token_ratio=0.1)
    for step in range(40):
        bursty.observe("r", "ngram", 8, 8 if step % 2 else 0)
        coins.observe("r", "ngram", 8, 1)  # first accepted, second rejected: 1 of 2 reached
        coins.observe("r", "ngram", 8, 0)
    assert bursty.choose("r", 8, 1).k >= 6
    assert coins.choose("r", 8, 1).k <= 2


def test_in_a_batch_rows_do_not_probe_alone():
    policy = policy_with_costs()
    policy.fixed_cost["draft"] = 1.5  # a draft model slower than the target
    feed(policy, "r", "ngram", 0.0)
    choices = [policy.choose("r", 8, rows=8, has_match=True) for _ in range(64)]
    assert all(c.method == "none" for c in choices)  # alone it would probe; in a batch it waits


def copying(policy: AdaptivePolicy, rid: str, match_len: int = 12) -> None:
    for _ in range(20):
        policy.observe(rid, "ngram", 8, 8, match_len=match_len)


def test_batch_width_pays_for_padding_only_when_enough_rows_gain():
    """The verify pass is padded to its widest row: one copying row among eight does not pay for
    widening everyone; eight copying rows do."""
    policy = policy_with_costs(token_ratio=0.1)
    copying(policy, "c0")
    for i in range(1, 8):
        policy.observe(f"c{i}", "ngram", 4, 0, match_len=1)
    rows = [BatchRow("c0", flexible=8, match_len=12)] + [BatchRow(f"c{i}") for i in range(1, 8)]
    assert policy.batch_width(rows)[0] == 0
    for i in range(8):
        copying(policy, f"c{i}")
    assert policy.batch_width([BatchRow(f"c{i}", flexible=8, match_len=12) for i in range(8)])[0] >= 4


def test_rows_fill_a_pass_another_row_already_widened():
    """A row with fixed drafts (a request that asked for ngram K=6) widens the pass anyway, so the
    auto rows' n-gram drafts up to that width cost nothing: they are taken, however unlikely."""
    policy = policy_with_costs(token_ratio=0.1)
    policy.observe("a", "ngram", 4, 0, match_len=1)
    rows = [BatchRow("fixed", "ngram", 6, match_len=3), BatchRow("a", flexible=3, match_len=1)]
    assert policy.batch_width(rows)[0] >= 6
    assert AdaptivePolicy(["ngram"], {"ngram": 0.002}).batch_width(rows) is None  # no timings: no opinion


def test_auto_in_a_batch_keeps_greedy_output_identical(tiny_engine_factory, prompt_ids, greedy_reference):
    engine = tiny_engine_factory()
    for n in (5, 10, 20, 40):
        engine.policy.cost.observe_verify(n, 1.0 + 0.01 * n)  # verifying is nearly free
    engine.policy.cost.observe_verify = lambda tokens, seconds: None  # keep these costs fixed
    seen = []
    original = engine.policy.batch_width
    engine.policy.batch_width = lambda rows: seen.append(w := original(rows)) or w
    out = run(engine, [request(f"r{i}", p, "auto", 8) for i, p in enumerate(prompt_ids)])
    assert out == greedy_reference
    assert any(w[0] for w in seen if w is not None)  # the batch did widen at some step


def test_acceptance_is_tracked_per_match_length():
    """The same sequence copies (long matches, drafts accepted) and writes freely (one-token
    matches, drafts rejected): long matches get long drafts, one-token matches none."""
    policy = policy_with_costs(token_ratio=0.1)
    for _ in range(20):
        policy.observe("r", "ngram", 8, 8, match_len=12)
        policy.observe("r", "ngram", 4, 0, match_len=1)
    assert policy.choose("r", 8, 1, has_match=True, match_len=12).k == 8
    assert policy.choose("r", 8, 1, has_match=True, match_len=1).method == "none"
    # a new sequence starts from what the whole engine has seen at that match length
    assert policy.choose("new", 8, 1, has_match=True, match_len=9).k >= 6


def test_positions_never_drafted_inherit_the_last_known_rate():
    """A sequence drafting K=2 whose first draft is right half the time, and whose second always is
    when the first was, is offered a long K next: positions 3+ have no evidence yet, and copying
    comes in runs (falling back to the overall 50% would keep K at 3)."""
    policy = policy_with_costs(token_ratio=0.1)
    for step in range(40):
        policy.observe("r", "ngram", 2, 2 if step % 2 else 0)
    assert policy.choose("r", 8, 1).k >= 6


def test_auto_records_ngram_outcomes_by_match_length(tiny_engine_factory, prompt_ids, greedy_reference):
    engine = tiny_engine_factory()
    out = run(engine, [request(f"r{i}", p, "ngram", 4) for i, p in enumerate(prompt_ids)])
    assert out == greedy_reference
    keys = set(engine.policy.global_rate)
    assert keys and all(k.startswith("ngram@") for k in keys)


def test_auto_rows_fill_the_width_a_fixed_row_pays_for(tiny_engine_factory, tokenizer):
    """Next to a request that asked for ngram K=6, an auto request that would not draft on its own
    (verifying is expensive and its history says n-gram drafts fail) still verifies its n-gram
    drafts: the pass is that wide anyway."""
    engine = tiny_engine_factory()
    for n in (2, 4, 8, 16):
        engine.policy.cost.observe_verify(n, 1.0 + 0.3 * n)
    engine.policy.cost.observe_verify = lambda tokens, seconds: None
    for match_len in (1, 2, 3, 8):
        for _ in range(10):
            engine.policy.observe("auto", "ngram", 4, 0, match_len=match_len)
    prompt = tokenizer.encode("a b c a b c a b c a b c a b c a b")
    assert engine.policy.choose("auto", 6, rows=2, has_match=True, match_len=3).method == "none"
    for r in (request("fixed", prompt, "ngram", 6), request("auto", prompt, "auto", 6)):
        engine.add_request(r)
    drafted = {"fixed": 0, "auto": 0}
    while engine.has_unfinished():
        for s in engine.step().seq_stats:
            drafted[s.request_id] += s.draft_tokens
    assert drafted["fixed"] > 0 and drafted["auto"] > 0


def test_a_draft_model_chosen_row_by_row_is_dropped_when_the_batch_loses(tiny_engine_factory, prompt_ids):
    """Each row weighs the draft model against its own share of a step, but the draft forward and the
    wider verify pass are paid by the whole batch: alone, a row the draft model predicts well uses it;
    in a batch of 4 where the other rows' drafts fail, it does not."""

    def engine_with_costs():
        engine = tiny_engine_factory()
        cost = engine.policy.cost
        for n in (1, 4, 9, 36):
            cost.observe_verify(n, 1.0 + 0.1 * n)
        cost.observe_draft(1, 0.5)
        cost.observe_verify = cost.observe_draft = lambda *args: None
        for _ in range(20):
            engine.policy.observe("history", "draft", 8, 8)  # the draft model is always right
        return engine

    alone = engine_with_costs()
    run(alone, [request("a", prompt_ids[2], "auto", 8, max_tokens=8)])
    assert alone.proposers["draft"].kv.cache.layers[0].is_initialized  # the draft model ran

    batch = engine_with_costs()
    assert batch.policy.choose("probe", 8, rows=4, has_match=False).method == "draft"  # row by row: yes
    batch.policy.forget("probe")
    for i in (1, 2, 3):  # these rows' own history: the draft model is always wrong for them
        failing = _Acceptance()
        for _ in range(20):
            failing.update(8, 0, decay=0.9)
        batch.policy.seqs[f"r{i}"] = _SeqState(by_method={"draft": failing})
    run(batch, [request(f"r{i}", prompt_ids[2], "auto", 8, max_tokens=8) for i in range(4)])
    assert not batch.proposers["draft"].kv.cache.layers[0].is_initialized  # the batch: no


def test_greedy_and_sampled_acceptance_are_kept_apart():
    """Under sampling a right draft survives only with probability p(x): what greedy requests
    accepted says little about sampled ones, so each learns from its own kind."""
    policy = policy_with_costs(token_ratio=0.1)
    for _ in range(20):
        policy.observe("g", "ngram", 8, 8, match_len=12)
        policy.observe("s", "ngram", 4, 0, match_len=12, sampled=True)
    assert policy.choose("new-greedy", 8, 1, has_match=True, match_len=12).k == 8
    assert policy.choose("new-sampled", 8, 1, has_match=True, match_len=12, sampled=True).method == "none"


def test_a_batch_where_nobody_drafted_still_has_a_cost_model():
    """Every pass of a batch where nobody drafts has the same width, so no slope can be fitted; the
    prior slope through the measured mean stands in, and the batch-level choices keep working."""
    cost = CostModel()
    for _ in range(8):
        cost.observe_verify(8, 0.08)  # batch of 8, one token each
    assert cost.fitted
    assert cost.verify_time(8) == pytest.approx(0.08)
    assert cost.verify_time(16) > cost.verify_time(8)
