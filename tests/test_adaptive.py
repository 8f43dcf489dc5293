"""`auto`: decisions on synthetic acceptance histories, and greedy output unchanged by it."""

from __future__ import annotations

import math
import random

import pytest

from server.speculation.acceptance import AcceptanceModel, _Counts, best_k, expected_tokens_upto, speedup
from server.speculation.budget import Room
from server.speculation.cost import CostModel
from server.speculation.draft_model import DraftModelProposer
from server.speculation.ngram import NgramProposer, confidence_level
from server.speculation.policy import PLAIN, AutoPolicy, BatchRow, Candidate, Choice, FixedPolicy, Offer, StepCosts
from server.speculation.tuning import AutoTuning
from tests.engine_helpers import FixedCosts, assert_same_draws, final_stats, request, run, run_with_stats

TRAITS = {"ngram": NgramProposer.traits, "draft": DraftModelProposer.traits}


def policy_with_costs(draft_forward_ratio: float = 0.75, token_ratio: float = 0.05) -> AutoPolicy:
    return AutoPolicy(TRAITS, FixedCosts(token_ratio, {"draft": draft_forward_ratio}), AcceptanceModel())


def choose(policy: AutoPolicy, rid: str, k_max: int, rows: int = 1, offers: dict[str, Offer] | None = None,
           sampled: bool = False) -> Choice:
    """The policy's choice for one row of a batch of `rows`, on its own (before the batch's decisions)."""
    return policy.choose(Candidate(rid, k_max, sampled, offers or {}), StepCosts(policy, rows))


def allot(policy: AutoPolicy, rows: list[BatchRow]) -> tuple[list[int], float]:
    """The batch's drafts per row and the expected tokens per second they give."""
    return policy.allot(rows, StepCosts(policy, len(rows)))


def width(policy: AutoPolicy, rows: list[BatchRow]) -> int:
    """A padded batch's width: the most drafts any row verifies."""
    return max(allot(policy, rows)[0])


def draft_history(k: int, accepted: int, sampled: bool = False, steps: int = 20) -> AcceptanceModel:
    """An acceptance model that has seen earlier requests' draft-model drafts of k, `accepted` kept."""
    acceptance = AcceptanceModel()
    for _ in range(steps):
        acceptance.observe("history", "draft", k, accepted, sampled=sampled)
    return acceptance


def same_policy(engine, cost, acceptance: AcceptanceModel) -> AutoPolicy:
    """A policy over the engine's proposers and the given models: what the engine's own would choose."""
    names = [m for m in engine.limits.methods if m not in ("none", "auto")]
    return AutoPolicy({n: engine.proposer(n).traits for n in names}, cost, acceptance)


def feed(policy: AutoPolicy, rid: str, method: str, rate: float, steps: int = 20, k: int = 4) -> None:
    for _ in range(steps):
        policy.observe(rid, method, k, round(rate * k))


def ngram(match_len: int = 1, drafts: int = 8) -> dict[str, Offer]:
    """What the n-gram lookup offers a row: `drafts` tokens after a match of `match_len`."""
    return {"ngram": Offer(drafts, confidence_level(match_len))}


def level(match_len: int) -> int:
    return confidence_level(match_len)


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
    choice = choose(policy, "r", k_max=8, rows=1, offers=ngram())
    assert choice.proposer is None and choice.k == 0


def test_high_acceptance_raises_k():
    policy = policy_with_costs()
    feed(policy, "lo", "ngram", 0.5)
    feed(policy, "hi", "ngram", 1.0)
    lo = choose(policy, "lo", k_max=8, offers=ngram())
    hi = choose(policy, "hi", k_max=8, offers=ngram())
    assert lo.proposer == hi.proposer == "ngram"
    assert hi.k > lo.k and hi.k == 8


def test_cheap_proposer_wins_at_equal_acceptance_and_no_match_falls_back():
    policy = policy_with_costs(draft_forward_ratio=0.75)
    feed(policy, "r", "ngram", 0.9)
    feed(policy, "r", "draft", 0.9)
    assert choose(policy, "r", 8, 1, offers=ngram()).proposer == "ngram"
    assert choose(policy, "r", 8, 1).proposer == "draft"  # nothing to look up: the model drafts
    expensive = policy_with_costs(draft_forward_ratio=1.2)
    feed(expensive, "r", "draft", 0.9)
    assert choose(expensive, "r", 8, 1).proposer is None


def test_k_shrinks_as_verification_stops_being_free():
    policy = policy_with_costs(token_ratio=0.1)
    rng = random.Random(0)
    for _ in range(60):  # independent per-token acceptance 0.7: leading successes out of 8
        accepted = next((j for j in range(8) if rng.random() >= 0.7), 8)
        policy.observe("r", "ngram", 8, accepted)
    alone = choose(policy, "r", k_max=8, rows=1, offers=ngram()).k
    crowded = choose(policy, "r", k_max=8, rows=8, offers=ngram()).k  # each verified token costs its share
    assert 0 < crowded < alone


def test_unused_proposer_is_probed_now_and_then_within_a_cost_budget():
    policy = policy_with_costs()
    feed(policy, "r", "ngram", 0.0)
    feed(policy, "r", "draft", 0.0)
    steps = 64
    choices = [choose(policy, "r", 8, 1, offers=ngram()) for _ in range(steps)]
    probes = [c for c in choices if c.proposer is not None]
    assert probes and all(c.k == 1 for c in probes)
    costs = StepCosts(policy, 1)
    spent = sum(costs.method_costs(c.proposer, 1)[0] for c in probes)
    budget = AutoTuning().probe_budget
    assert spent <= 2 * budget * steps + max(costs.method_costs(m, 1)[0] for m in ("ngram", "draft"))
    assert sum(c.proposer == "ngram" for c in probes) > sum(c.proposer == "draft" for c in probes)


@pytest.mark.slow
def test_auto_keeps_greedy_output_identical(tiny_engine_factory, prompt_ids, greedy_reference):
    engine = tiny_engine_factory()
    out = run(engine, [request(f"r{i}", p, "auto", 8) for i, p in enumerate(prompt_ids)])
    assert out == greedy_reference


def test_auto_with_a_perfect_cheap_draft_speculates(tiny_target, prompt_ids):
    """A draft that always agrees (the target itself) and, by the injected costs, costs 5% of a step
    (as a small draft would): auto must use it."""
    from server.config import Settings
    from server.engine.engine import Engine

    engine = Engine(tiny_target, tiny_target, Settings.load(), cost=FixedCosts(draft={"draft": 0.05}))
    done = final_stats(engine, [request(f"r{i}", p, "auto", 4, max_tokens=30) for i, p in enumerate(prompt_ids)])
    drafted = [s.by_proposer["draft"] for s in done.values()]
    assert all(d.draft_tokens > 0 and d.accepted_tokens > 0.9 * d.draft_tokens for d in drafted)
    assert all(s.decode_steps < 15 for s in done.values())  # 30 tokens in well under 30 passes


def test_auto_does_not_use_a_draft_that_costs_a_full_step(tiny_target, prompt_ids):
    """The same weights as draft agree on everything but cost as much as the target (measured): never pays."""
    from server.config import Settings
    from server.engine.engine import Engine

    engine = Engine(tiny_target, tiny_target, Settings.load(ngram_min=16, ngram_max=16))  # no n-gram matches
    done = final_stats(engine, [request(f"r{i}", p, "auto", 4, max_tokens=40) for i, p in enumerate(prompt_ids)])
    for stats in done.values():  # after the first measured steps, only rare K=1 probes
        assert stats.draft_tokens <= 8


def test_seeded_sampling_under_auto_reproduces_whatever_the_costs(tiny_engine_factory, tiny_target, prompt_ids):
    """Measured costs differ from run to run and steer `auto`; a seeded request's tokens must not follow
    them. A cheap draft model is used (it drafts one-hot for seeded rows, leaving the request's random
    stream alone), a costly one is not, and the texts are the same (up to a draw within float noise of
    a token boundary: the verify widths differ, see test_engine's seeded-sampling test)."""
    def sample_once(draft_cost: float) -> tuple[dict[str, list[int]], int]:
        engine = tiny_engine_factory(ngram_min=16, ngram_max=16, cost=FixedCosts(draft={"draft": draft_cost}),
                                     acceptance=draft_history(6, 6, sampled=True))  # the draft is usually right
        reqs = [request(f"r{i}", p, "auto", 6, temperature=1.0, seed=3 + i) for i, p in enumerate(prompt_ids)]
        out = run(engine, reqs)
        return out, engine.proposer("draft").forwards

    cheap, cheap_forwards = sample_once(0.01)
    costly, costly_forwards = sample_once(5.0)
    assert cheap_forwards > 0 and costly_forwards == 0
    for i, p in enumerate(prompt_ids):
        params = {"temperature": 1.0, "top_p": 1.0, "seed": 3 + i}
        assert_same_draws(tiny_target.model, p, cheap[f"r{i}"], costly[f"r{i}"], params, i)


def test_seeded_rows_under_auto_draft_what_the_sampler_will_draw(tiny_target, prompt_ids):
    """A draft model equal to the target, seeded sampling at T = 1 under `auto`: each draft is drawn from q
    with the uniform the sampler then draws p's token with, so (q = p) nearly every draft is kept, and the
    text is plain decoding's with the same seed. Drafting q's argmax instead would keep a draft only with
    probability p(argmax), small for this model's flat distributions."""
    from server.config import Settings
    from server.engine.engine import Engine

    engine = Engine(tiny_target, tiny_target, Settings.load(ngram_min=16, ngram_max=16),
                    cost=FixedCosts(draft={"draft": 0.01}), acceptance=draft_history(4, 4, sampled=True))
    reqs = [request(f"r{i}", p, "auto", 4, temperature=1.0, seed=7 + i, max_tokens=24)
            for i, p in enumerate(prompt_ids)]
    got, stats = run_with_stats(engine, reqs)
    drafted = sum(s.by_proposer["draft"].draft_tokens for s in stats.values() if "draft" in s.by_proposer)
    kept = sum(s.by_proposer["draft"].accepted_tokens for s in stats.values() if "draft" in s.by_proposer)
    assert drafted > 50 and kept >= 0.9 * drafted
    plain = Engine(tiny_target, None, Settings.load())
    want = run(plain, [request(r.request_id, r.prompt_token_ids, "none", temperature=1.0, seed=7 + i, max_tokens=24)
                       for i, r in enumerate(reqs)])
    for i, p in enumerate(prompt_ids):
        params = {"temperature": 1.0, "top_p": 1.0, "seed": 7 + i}
        assert_same_draws(tiny_target.model, p, got[f"r{i}"], want[f"r{i}"], params, i)


@pytest.mark.slow
def test_unseeded_auto_follows_the_costs(tiny_engine_factory, prompt_ids):
    """The counterpart of the test above: without a seed, the costs do steer the choice."""
    used = {}
    for cost in (0.01, 5.0):
        engine = tiny_engine_factory(ngram_min=16, ngram_max=16, cost=FixedCosts(draft={"draft": cost}),
                                     acceptance=draft_history(6, 6, sampled=True))  # the draft is usually right
        stats = final_stats(engine, [request(f"r{i}", p, "auto", 6, temperature=1.0) for i, p in enumerate(prompt_ids)])
        used[cost] = sum(s.draft_tokens for s in stats.values())
    assert used[0.01] > 4 * max(used[5.0], 1)


def test_a_proposer_that_cannot_pay_is_never_probed():
    policy = policy_with_costs(draft_forward_ratio=1.3)  # the bf16 copy on one CPU thread, measured
    feed(policy, "r", "draft", 0.1)
    choices = [choose(policy, "r", 8, 1) for _ in range(64)]
    assert all(c.proposer is None for c in choices)


def test_auto_sequences_never_using_the_draft_never_prefill_it(tiny_engine_factory, prompt_ids):
    engine = tiny_engine_factory(ngram_min=16, ngram_max=16, cost=FixedCosts(draft={"draft": 5.0}))  # never pays
    run(engine, [request(f"r{i}", p, "auto", 4) for i, p in enumerate(prompt_ids)])
    assert engine.proposer("draft").forwards == 0  # no draft forward ever ran, not even a prefill


def test_runs_of_copying_favour_long_drafts():
    """Same overall acceptance (50%), different shape: all-or-nothing runs (copying) pay for a long
    K, independent coin flips don't."""
    bursty, coins = policy_with_costs(token_ratio=0.1), policy_with_costs(token_ratio=0.1)
    for step in range(40):
        bursty.observe("r", "ngram", 8, 8 if step % 2 else 0)
        coins.observe("r", "ngram", 8, 1)  # first accepted, second rejected: 1 of 2 reached
        coins.observe("r", "ngram", 8, 0)
    assert choose(bursty, "r", 8, 1, offers=ngram()).k >= 6
    assert choose(coins, "r", 8, 1, offers=ngram()).k <= 2


def test_in_a_batch_rows_do_not_probe_alone():
    policy = policy_with_costs(draft_forward_ratio=1.5)  # a draft model slower than the target
    feed(policy, "r", "ngram", 0.0)
    choices = [choose(policy, "r", 8, rows=8, offers=ngram()) for _ in range(64)]
    assert all(c.proposer is None for c in choices)  # alone it would probe; in a batch it waits


def copying(policy: AutoPolicy, rid: str, match_len: int = 12) -> None:
    for _ in range(20):
        policy.observe(rid, "ngram", 8, 8, level(match_len))


def test_batch_width_pays_for_padding_only_when_enough_rows_gain():
    """The verify pass is padded to its widest row: one copying row among eight does not pay for
    widening everyone; eight copying rows do."""
    policy = policy_with_costs(token_ratio=0.1)
    copying(policy, "c0")
    for i in range(1, 8):
        policy.observe(f"c{i}", "ngram", 4, 0, level(1))
    rows = [BatchRow("c0", "ngram", level=level(12), flexible=8)] + [BatchRow(f"c{i}") for i in range(1, 8)]
    assert width(policy, rows) == 0
    for i in range(8):
        copying(policy, f"c{i}")
    assert width(policy, [BatchRow(f"c{i}", "ngram", level=level(12), flexible=8) for i in range(8)]) >= 4


def test_packed_passes_give_drafts_to_the_rows_that_copy():
    """When a pass computes only real tokens (packed), one copying row among eight drafts long on its
    own, where padding would have kept the whole batch plain; rows whose drafts are rarely accepted
    draft nothing."""
    padded = policy_with_costs(token_ratio=0.1)
    packed = AutoPolicy(TRAITS, FixedCosts(0.1, {}), AcceptanceModel(), packed=True)
    for policy in (padded, packed):
        copying(policy, "c0")
        for i in range(1, 8):
            policy.observe(f"c{i}", "ngram", 4, 0, level(1))
    rows = [BatchRow("c0", "ngram", level=level(12), flexible=8)]
    rows += [BatchRow(f"c{i}", "ngram", level=level(1), flexible=8) for i in range(1, 8)]
    assert allot(padded, rows)[0] == [0] * 8
    ks, _ = allot(packed, rows)
    assert ks[0] >= 6 and ks[1:] == [0] * 7
    # rows with fixed drafts keep them; the batch's score counts them
    fixed = [BatchRow("f", "ngram", 3, level(3)), *rows[1:]]
    assert allot(packed, fixed)[0] == [3] + [0] * 7


def test_rows_fill_a_pass_another_row_already_widened():
    """A row with fixed drafts (a request that asked for ngram K=6) widens the pass anyway, so the
    auto rows' n-gram drafts up to that width cost nothing: they are taken, however unlikely."""
    policy = policy_with_costs(token_ratio=0.1)
    policy.observe("a", "ngram", 4, 0, level(1))
    rows = [BatchRow("fixed", "ngram", 6, level(3)), BatchRow("a", "ngram", level=level(1), flexible=3)]
    assert allot(policy, rows)[0] == [6, 3]


def plan_once(policy: AutoPolicy, rid: str, rows: int) -> None:
    """A step that plans `rid` among `rows` rows (the others not the policy's to plan)."""
    policy.decide([Candidate(rid), *(Candidate(f"other{i}", fixed=PLAIN) for i in range(rows - 1))])


def planned_steps(policy: AutoPolicy, rid: str, steps: int, rows: int, accepted: int = 0) -> list[int]:
    """Steps (of `steps`) at which `rid`, one of `rows` rows, is planned, its drafts gaining `accepted`."""
    planned = []
    for step in range(steps):
        if policy.due(rid):
            planned.append(step)
            plan_once(policy, rid, rows)
            policy.observe(rid, "ngram" if accepted else None, 4 if accepted else 0, accepted)
        else:
            policy.observe(rid, None, 0, 0)  # committed as a plain row
    return planned


def test_rows_whose_plans_gain_nothing_are_planned_within_a_budget_and_copying_rows_every_step():
    """In a full batch, planning a row costs a share of its step whatever the plan: a row whose drafts
    stopped gaining is planned only every `idle_gap` steps (planning within `idle_planning` of a step),
    a row whose drafts are accepted every step, and alone, where planning is cheap, every row is."""
    tuning = AutoTuning()
    policy = AutoPolicy(TRAITS, FixedCosts(0.05, {}), AcceptanceModel(), True)  # a plain 8-row pass: 1.35 s
    policy.observe_planning(0.08, 8)  # 10 ms a row: 8 rows' planning is ~6% of their step
    share = policy.planning_share(8)
    assert share == pytest.approx(0.08 / 1.35)
    gap = policy.idle_gap(8)
    assert gap == min(tuning.max_idle_gap, math.ceil(share / tuning.idle_planning)) > 1
    for i in range(50):  # rows whose plans gained nothing: a new row starts from their gain
        planned_steps(policy, f"warm{i}", 10, rows=8)
    idle = planned_steps(policy, "chat", 80, rows=8)
    assert len(idle) <= 80 / gap + 2 and all(b - a <= gap for a, b in zip(idle, idle[1:], strict=False))
    assert planned_steps(policy, "copy", 80, rows=8, accepted=4) == list(range(80))
    # a row that starts copying is noticed within the gap and planned every step from then on
    plan_once(policy, "chat", 8)
    policy.observe("chat", "ngram", 4, 4)
    assert planned_steps(policy, "chat", 20, rows=8, accepted=4) == list(range(20))
    alone = AutoPolicy(TRAITS, FixedCosts(0.05, {}), AcceptanceModel(), True)
    alone.observe_planning(0.002, 1)  # 2 ms of a 1 s step: 0.2%
    assert alone.idle_gap(1) == 1
    assert planned_steps(alone, "r", 40, rows=1) == list(range(40))


def test_idle_rows_are_not_looked_up_and_greedy_output_stays_identical(
    tiny_engine_factory, prompt_ids, greedy_reference, monkeypatch
):
    """With planning costly (as in a full CPU batch), rows whose plans gained nothing sit out steps: the
    lookahead proposers are not asked for them, and the text is still plain greedy decoding's."""
    timed = AutoPolicy.observe_planning  # planning a row: 20% of a step
    monkeypatch.setattr(AutoPolicy, "observe_planning", lambda self, seconds, rows: timed(self, 0.2 * rows, rows))
    engine = tiny_engine_factory(cost=FixedCosts(token_ratio=0.5))  # verifying costs: drafts rarely pay
    run(engine, [request(f"w{i}", p, "auto", 8, max_tokens=48) for i, p in enumerate(prompt_ids)])
    asked = []
    ngram = engine.proposer("ngram")
    propose = ngram.propose
    ngram.propose = lambda seqs, ks: asked.append(len(seqs)) or propose(seqs, ks)
    for i, p in enumerate(prompt_ids):
        engine.add_requests([request(f"r{i}", p, "auto", 8)])
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    row_steps = 0
    while engine.has_unfinished():
        result = engine.step()
        row_steps += len(result.seq_stats)
        for o in result.outputs:
            out[o.request_id] += o.token_ids
    assert out == greedy_reference
    assert 0 < sum(asked) < row_steps / 2


def test_auto_in_a_batch_keeps_greedy_output_identical(tiny_engine_factory, prompt_ids, greedy_reference):
    engine = tiny_engine_factory(cost=FixedCosts(token_ratio=0.01))  # verifying is nearly free
    for i, p in enumerate(prompt_ids):
        engine.add_requests([request(f"r{i}", p, "auto", 8)])
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    widened = False
    while engine.has_unfinished():
        result = engine.step()
        widened |= len(result.seq_stats) > 1 and any(s.draft_tokens for s in result.seq_stats)
        for o in result.outputs:
            out[o.request_id] += o.token_ids
    assert out == greedy_reference
    assert widened  # some step of the batch drafted


def test_acceptance_is_tracked_per_confidence_level():
    """The same sequence copies (long matches, drafts accepted) and writes freely (one-token
    matches, drafts rejected): long matches get long drafts, one-token matches none."""
    policy = policy_with_costs(token_ratio=0.1)
    for _ in range(20):
        policy.observe("r", "ngram", 8, 8, level(12))
        policy.observe("r", "ngram", 4, 0, level(1))
    assert choose(policy, "r", 8, 1, offers=ngram(12)).k == 8
    assert choose(policy, "r", 8, 1, offers=ngram(1)).proposer is None
    # a new sequence starts from what the whole engine has seen at that confidence level
    assert choose(policy, "new", 8, 1, offers=ngram(9)).k >= 6


def test_acceptance_is_estimated_per_position_from_the_comparisons_made_there():
    """Drafts of 16 whose first 3 tokens are kept and the 4th rejected: positions 0-2 were compared and
    kept every time, position 3 compared and rejected every time, and the 12 after it never compared.
    A new row after such a history (the engine-wide figures are its prior) drafts about 3 tokens: not
    fewer (3/16 per drafted token would say drafting barely pays) and not 16 (3/4 per compared token,
    the same at every position, would say the fourth is as safe as the first)."""
    policy = policy_with_costs(token_ratio=0.02)
    for i in range(30):
        policy.observe(f"old{i}", "ngram", 16, 3, level(3))
    rates = policy.rates("new", "ngram", 16, level(3))
    assert min(rates[:3]) > 0.9 and rates[3] < 0.2
    assert 3 <= choose(policy, "new", 16, 1, offers=ngram(3, 16)).k <= 4
    # a first guess that is right one time in five, then runs: the first position is not lifted by the runs
    for i in range(40):
        policy.observe(f"guess{i}", "ngram", 8, 8 if i % 5 == 0 else 0, level(1))
    first, *later = policy.rates("next", "ngram", 8, level(1))
    assert first == pytest.approx(0.2, abs=0.05) and min(later) > 0.8


def test_positions_never_drafted_inherit_the_last_known_rate():
    """A sequence drafting K=2 whose first draft is right half the time, and whose second always is
    when the first was, is offered a long K next: positions 3+ have no evidence yet, and copying
    comes in runs (falling back to the overall 50% would keep K at 3)."""
    policy = policy_with_costs(token_ratio=0.1)
    for step in range(40):
        policy.observe("r", "ngram", 2, 2 if step % 2 else 0)
    assert choose(policy, "r", 8, 1, offers=ngram()).k >= 6


def test_ngram_outcomes_are_recorded_by_confidence_level(tiny_engine_factory, prompt_ids, greedy_reference):
    acceptance = AcceptanceModel()
    engine = tiny_engine_factory(acceptance=acceptance)
    out = run(engine, [request(f"r{i}", p, "ngram", 4) for i, p in enumerate(prompt_ids)])
    assert out == greedy_reference
    kinds = acceptance.seen()
    assert len(kinds) > 1 and all(name == "ngram" for name, _, _ in kinds)  # several match lengths were seen


def test_auto_rows_fill_the_width_a_fixed_row_pays_for(tiny_engine_factory, tokenizer):
    """Next to a request that asked for ngram K=6, an auto request that would not draft on its own
    (verifying is expensive and its history says n-gram drafts fail) still verifies its n-gram
    drafts: the pass is that wide anyway."""
    cost, acceptance = FixedCosts(token_ratio=0.3), AcceptanceModel()
    for lv in range(4):
        for _ in range(10):
            acceptance.observe("auto", "ngram", 4, 0, lv)
    engine = tiny_engine_factory(cost=cost, acceptance=acceptance)
    prompt = tokenizer.encode("a b c a b c a b c a b c a b c a b")
    assert choose(same_policy(engine, cost, acceptance), "auto", 6, rows=2, offers=ngram(3, 6)).proposer is None
    stats = final_stats(engine, [request("fixed", prompt, "ngram", 6), request("auto", prompt, "auto", 6)])
    assert stats["fixed"].draft_tokens > 0 and stats["auto"].draft_tokens > 0


def test_a_draft_model_chosen_row_by_row_is_dropped_when_the_batch_loses(tiny_engine_factory, prompt_ids):
    """Each row weighs the draft model against its own share of a step, but the draft forward and the
    wider verify pass are paid by the whole batch: alone, a row the draft model predicts well uses it;
    in a batch of 4 where the other rows' drafts fail, it does not."""

    cost = FixedCosts(token_ratio=0.1, draft={"draft": 0.5})
    alone = tiny_engine_factory(cost=cost, acceptance=draft_history(8, 8))  # the draft model is always right
    run(alone, [request("a", prompt_ids[2], "auto", 8, max_tokens=8)])
    assert alone.proposer("draft").forwards > 0  # the draft model ran

    acceptance = draft_history(8, 8)
    batch = tiny_engine_factory(cost=cost, acceptance=acceptance)
    assert choose(same_policy(batch, cost, acceptance), "probe", 8, rows=4).proposer == "draft"  # row by row: yes
    acceptance.forget("probe")
    for i in (1, 2, 3):  # these rows' own history (not the engine's): the draft model is always wrong for them
        failing = _Counts()
        for _ in range(20):
            failing.update(8, 0, decay=0.9)
        acceptance._rows[f"r{i}"] = {("draft", 0, False): failing}
    run(batch, [request(f"r{i}", prompt_ids[2], "auto", 8, max_tokens=8) for i in range(4)])
    assert batch.proposer("draft").forwards == 0  # the batch: no


def test_a_batch_does_not_draft_with_a_model_whose_backlog_costs_more_than_its_drafts_gain(
    tiny_engine_factory, prompt_ids
):
    """Four rows entering a draft model that is always right: each row chooses it, and the batch keeps
    it while taking in the rows' prompts costs nothing; priced at its measured time (here half a plain
    step a token: four prompts to feed first), the batch decodes plainly."""
    for backlog, drafts in ((0.0, True), (0.5, False)):
        costs = FixedCosts(token_ratio=0.05, draft={"draft": 0.05}, backlog={"draft": backlog})
        # the draft model is always right; no prefix cache: the four rows enter the batch together (with one,
        # the others would wait a step for the first one's blocks and read them)
        engine = tiny_engine_factory(cost=costs, acceptance=draft_history(8, 8), prefix_cache_memory="none")
        run(engine, [request(f"r{i}", prompt_ids[3], "auto", 8, max_tokens=8) for i in range(4)])  # 18 tokens
        assert (engine.proposer("draft").forwards > 0) is drafts, backlog


def test_greedy_and_sampled_acceptance_are_kept_apart():
    """Under sampling a right draft survives only with probability p(x): what greedy requests
    accepted says little about sampled ones, so each learns from its own kind."""
    policy = policy_with_costs(token_ratio=0.1)
    for _ in range(20):
        policy.observe("g", "ngram", 8, 8, level(12))
        policy.observe("s", "ngram", 4, 0, level(12), sampled=True)
    assert choose(policy, "new-greedy", 8, 1, offers=ngram(12)).k == 8
    assert choose(policy, "new-sampled", 8, 1, offers=ngram(12), sampled=True).proposer is None


def test_a_batch_widens_only_when_the_measured_pass_pays():
    """Four rows whose first draft is kept with probability a: widening to one draft each costs T(8) / T(4)
    = 1.37 plain passes here, so it pays at a = 0.5 and not at a = 0.3."""
    for rate, widens in ((0.3, False), (0.5, True)):
        cost = CostModel()
        for _ in range(3):
            cost.observe_verify(4, 4, 0.095)
            cost.observe_verify(4, 8, 0.130)
        policy = AutoPolicy({"ngram": NgramProposer.traits}, cost, AcceptanceModel())
        for i in range(400):  # earlier requests: one draft per step, kept in `rate` of the steps
            policy.observe(f"old{i}", "ngram", 1, int(i % 10 < 10 * rate), level(3))
        rows = [BatchRow(f"r{i}", "ngram", level=level(3), flexible=1) for i in range(4)]
        assert policy.rates("r0", "ngram", 1, level(3))[0] == pytest.approx(rate, abs=0.03)
        assert (width(policy, rows) > 0) is widens, rate


class _DraftTimings(CostModel):
    """A cost model that also keeps every traffic timing of a model proposer's drafting."""

    def __init__(self) -> None:
        super().__init__()
        self.drafts: list[tuple[str, int, int]] = []

    def observe_draft(self, proposer: str, rows: int, forwards: int, seconds: float, prior: bool = False) -> None:
        if not prior:
            self.drafts.append((proposer, forwards, rows))
        super().observe_draft(proposer, rows, forwards, seconds, prior)


def test_a_model_proposer_is_timed_drafting_not_taking_in_a_backlog(tiny_engine_factory, prompt_ids):
    """A model proposer's cost per draft token comes from calls that only draft. The call in which a row
    enters its cache (a prefill of the whole context) is not timed as drafting: it would price the model
    at several times its cost per draft token, and `auto` would never draft with it again."""
    cost = _DraftTimings()
    engine = tiny_engine_factory(cost=cost)
    draft = engine.proposer("draft")
    calls = []
    propose = draft.propose

    def recording(seqs, ks):
        calls.append(draft.backlog([s.request_id for s, k in zip(seqs, ks, strict=True) if k]))
        return propose(seqs, ks)

    draft.propose = recording
    final_stats(engine, [request("r", prompt_ids[3], "draft", 4, max_tokens=16)])
    assert calls[0] == len(prompt_ids[3])  # the first call prefilled the prompt
    assert len(calls) > 2 and calls[1:] == [0] * (len(calls) - 1)  # then each call only drafted
    assert len(cost.drafts) == len(calls) - 1 and all(name == "draft" for name, _, _ in cost.drafts)


def test_a_row_back_from_steps_it_did_not_draft_has_a_backlog(tiny_engine_factory, prompt_ids):
    """Each step's commit leaves a row's emitted tokens pending; a row that drafted at its last step takes
    them in with its first draft forward (no backlog), one that did not has them all to catch up on."""
    engine = tiny_engine_factory()
    draft = engine.proposer("draft")
    engine.add_requests([request("r", prompt_ids[3], "draft", 4, max_tokens=32)])
    engine.step()
    assert draft.backlog(["r"]) == 0
    seq = engine.running["r"]
    draft.commit(seq, [], [11], None)  # two steps in which the row did not draft with it
    draft.commit(seq, [], [12], None)
    assert draft.backlog(["r"]) == len(draft.pending["r"]) >= 2
    assert draft.backlog(["unknown"]) == 0


def test_a_busy_calibration_scaled_to_todays_speed_still_lets_auto_draft():
    """A calibration timed 20x too slow (several servers starting at once), scaled by today's plain passes:
    a long confident n-gram draft is still worth drafting."""
    cost = CostModel()
    for _ in range(2):
        for n, seconds in {1: 0.060, 4: 0.095, 9: 0.155, 36: 0.204}.items():
            cost.observe_verify(1, n, 20 * seconds, prior=True)
    for _ in range(20):
        cost.observe_verify(1, 1, 0.060)
    policy = AutoPolicy({"ngram": NgramProposer.traits}, cost, AcceptanceModel())
    assert choose(policy, "r", 8, offers={"ngram": Offer(8, level(3))}).k > 0


def test_a_model_rows_backlog_is_priced_once_it_has_been_timed():
    """A row that starts drafting with a model proposer (or comes back to it after steps it did not) first
    feeds it every pair it missed, its prompt's included; that decided whether head drafts paid at four
    chat rows on a CPU (docs/bench.md). The batch's choice prices it at its measured time per token; before
    any timing, at nothing (no first draft is refused for a cost nobody has measured)."""
    cost = CostModel()
    for _ in range(3):
        cost.observe_verify(4, 4, 0.095)
        cost.observe_verify(4, 8, 0.130)
    cost.observe_draft("draft", 4, 1, 0.004)
    policy = AutoPolicy({"draft": DraftModelProposer.traits}, cost, AcceptanceModel(), packed=True)
    for i in range(100):
        policy.observe(f"old{i}", "draft", 1, 1)  # its drafts are kept
    caught_up = [BatchRow(f"r{i}", "draft", 1) for i in range(4)]
    behind = [BatchRow(f"r{i}", "draft", 1, backlog=60) for i in range(4)]
    tokens = sum(expected_tokens_upto(policy.rates(r.request_id, "draft", 1), 1)[-1] for r in caught_up)
    rate = allot(policy, caught_up)[1]
    assert allot(policy, behind)[1] == pytest.approx(rate)  # nothing timed yet

    cost.observe_backlog("draft", 100, 0.012)  # 0.12 ms a token, then 0.1 and 0.08: the median
    cost.observe_backlog("draft", 50, 0.005)
    cost.observe_backlog("draft", 10, 0.0008)
    assert cost.backlog_time("draft", 240) == pytest.approx(0.024)
    assert tokens / allot(policy, behind)[1] - tokens / rate == pytest.approx(0.024)
    assert allot(policy, caught_up)[1] == pytest.approx(rate)  # rows with nothing to take in pay nothing


def test_the_trivial_policy_drafts_a_fixed_k_or_nothing(tiny_engine_factory, prompt_ids, greedy_reference):
    """`FixedPolicy` answers the same protocol: `auto` rows draft K with one proposer, or decode as `none`;
    greedy text is the same either way."""
    plain = tiny_engine_factory(policy=FixedPolicy())
    tokens, stats = run_with_stats(plain, [request(f"r{i}", p, "auto", 8) for i, p in enumerate(prompt_ids)])
    assert tokens == greedy_reference and all(s.draft_tokens == 0 for s in stats.values())
    ngram = tiny_engine_factory(policy=FixedPolicy("ngram", 3))
    tokens, stats = run_with_stats(ngram, [request(f"r{i}", p, "auto", 8) for i, p in enumerate(prompt_ids)])
    assert tokens == greedy_reference and sum(s.draft_tokens for s in stats.values()) > 0
    assert all(set(s.by_proposer) <= {"ngram"} for s in stats.values())
    rows = [Candidate("a", 8, offers={"ngram": Offer(2)}), Candidate("b", 8), Candidate("c", 8, fixed=PLAIN)]
    assert FixedPolicy("ngram", 3).decide(rows) == [Choice("ngram", 2), PLAIN, PLAIN]


def test_tuning_constants_are_overridden_by_the_setting_and_unknown_names_refused(tiny_engine_factory, monkeypatch):
    from server.config import Settings

    monkeypatch.setenv("SPECULA_AUTO_TUNING", '{"min_gain": 1.5, "max_idle_gap": 4}')
    assert Settings.load().auto_tuning == {"min_gain": 1.5, "max_idle_gap": 4}
    engine = tiny_engine_factory(auto_tuning={"min_gain": 1.5, "max_idle_gap": 4})
    assert engine.cost.tuning == AutoTuning(min_gain=1.5, max_idle_gap=4)
    with pytest.raises(ValueError, match="auto_tuning: unknown constant"):
        tiny_engine_factory(auto_tuning={"min_gian": 1.5})


class FlatThenSteep(FixedCosts):
    """A pass costs almost nothing more up to 16 more tokens, then a lot (a CPU's curve, exaggerated)."""

    def ratios(self, rows: int) -> tuple[list[int], list[float]]:
        return [rows, rows + 16, rows + 128], [1.0, 1.01, 4.0]


def test_drafts_that_displace_prompt_tokens_cost_what_those_tokens_cost():
    """Within the step's free room a draft token adds nearly nothing to the pass; once drafts displace a
    prompt chunk's tokens (budget.py), each costs a prompt token computed later: `auto` drafts less."""
    policy = AutoPolicy(TRAITS, FlatThenSteep(), AcceptanceModel())
    for rid in ("free", "roomy", "displacing"):
        feed(policy, rid, "ngram", 0.25)

    def k(rid: str, room: Room | None) -> int:
        return policy.decide([Candidate(rid, 8, offers=ngram(3))], room)[0].k

    free = k("free", None)
    assert free > 0
    assert k("roomy", Room(tokens=60, free=60)) == free  # a room that displaces nothing changes nothing
    assert k("displacing", Room(tokens=60, free=0)) < free
