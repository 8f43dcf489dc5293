"""Suffix-tree drafts (server/speculation/suffix.py): the implicit tree's matches, continuation
frequencies and draft lengths, the global index's FIFO bound, greedy exactness in the engine, drafts
from an earlier request's output, and `auto` using the proposer with no edits of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from server.speculation.registry import BUILTIN, Registry
from server.speculation.suffix import (
    MATCH_CAP,
    SEPARATOR,
    SPEC_FACTOR,
    WALK_OCCURRENCES,
    GlobalIndex,
    RequestIndex,
    SharedIndex,
    SuffixProposer,
    best_match,
    confidence_level,
    walk,
)
from tests.engine_helpers import FixedCosts, final_stats, request, run


@dataclass
class FakeSeq:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    cache_salt: str | None = None


def lookup(tokens: list[int], k: int = 8):
    return RequestIndex(tokens, len(tokens)).lookup(k)


# ---- the per-request tree ------------------------------------------------------------------------
def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "1 2 3" is followed by 7 once; "3" alone was followed by 9 more recently.
    m = lookup([1, 2, 3, 7, 8, 5, 3, 9, 6, 1, 2, 3])
    assert m.length == 3 and m.drafts[0] == 7 and m.source == "request"


def test_the_most_frequent_continuation_wins_and_its_frequency_is_reported():
    # after "5": 6 twice, 7 once (most recent) -> 6, with frequency 2/3
    m = lookup([5, 6, 0, 5, 6, 1, 5, 7, 2, 5])
    assert m.length == 1 and m.drafts[0] == 6 and m.probs[0] == pytest.approx(2 / 3)
    # then the walk follows only the occurrences that continued with 6: 0 and 1 once each (tie -> recent)
    assert m.drafts[1] == 1 and m.probs[1] == pytest.approx(1 / 2)


def test_equal_frequencies_go_to_the_most_recent_occurrence():
    assert lookup([4, 1, 4, 2, 4]).drafts[0] == 2


def test_draft_length_follows_the_match_length():
    text = list(range(100, 140))  # no repeats: one occurrence of anything is the text itself
    short = lookup([*text, 7, 100], k=16)  # "100" matches once (1 token): at most SPEC_FACTOR drafts
    assert short.length == 1 and short.drafts == text[1 : 1 + int(SPEC_FACTOR)]
    long = lookup([*text, *text[:10]], k=16)  # a 10-token match: K, not the match, limits the drafts
    assert long.length == 10 and long.drafts == text[10:26]
    assert lookup([*text, *text[:10]], k=3).drafts == text[10:13]


def test_match_length_is_capped_and_nothing_matches_in_fresh_text():
    text = list(range(50))
    assert lookup([*text, *text]).length == MATCH_CAP
    assert lookup(list(range(30))).drafts == []
    assert lookup([3], k=4).drafts == [] and lookup([3, 3], k=0).drafts == []


def test_a_continuation_may_overlap_the_suffix_but_stops_at_the_end_of_the_text():
    m = lookup([9, 9, 9, 9], k=3)  # deepest node "9 9 9" ends at position 2; only position 3 follows it
    assert (m.length, m.drafts) == (3, [9])
    assert lookup([1, 2, 1, 2, 1, 2], k=4).drafts == [1, 2]  # "1 2 1 2" ends at 3: then 1 2, the end


def test_sync_follows_the_engines_text():
    index = RequestIndex([1, 2, 3], 3)
    index.extend([4, 5])
    index.sync([1, 2, 3, 4])  # a stop dropped the last emitted token
    assert index.text.tolist() == [1, 2, 3, 4]
    index.sync([1, 2, 3, 4, 6, 7])
    assert index.text.tolist() == [1, 2, 3, 4, 6, 7]
    index.sync([8, 8])
    assert index.text.tolist() == [8, 8]


def test_confidence_levels_order_match_length_then_dominance():
    assert confidence_level(1, 0.2) == 0 and confidence_level(1, 1.0) == 1
    assert confidence_level(5, 0.5) == 4 and confidence_level(20, 0.9) == 7
    levels = [confidence_level(m, p) for m in (1, 2, 4, 9) for p in (0.3, 0.9)]
    assert levels == sorted(levels) == list(range(8))


def reference_walk(hay: list[int], ends: list[int], limit: int, stop: int) -> tuple[list[int], list[float]]:
    """The suffix tree's walk spelled out: from the node's most recent `WALK_OCCURRENCES` occurrences,
    repeatedly take the most frequent next token (ties: the one in the most recent occurrence) while it
    follows at least MIN_PROB of the occurrences still followed, then keep the occurrences it follows."""
    from server.speculation.suffix import MIN_PROB

    followed = sorted(ends)[-WALK_OCCURRENCES:]
    drafts: list[int] = []
    probs: list[float] = []
    for j in range(limit):
        nexts = [(e, hay[e + 1 + j]) for e in followed if e + 1 + j < stop and hay[e + 1 + j] != SEPARATOR]
        nexts = [(e, t) for e, t in nexts if all(hay[e + 1 + i] == drafts[i] for i in range(j))]
        if not nexts:
            break
        counts = {t: sum(1 for _, u in nexts if u == t) for _, t in nexts}
        top = max(counts.values())
        token = max((e, t) for e, t in nexts if counts[t] == top)[1]
        if top < MIN_PROB * len(nexts):
            break
        drafts.append(token)
        probs.append(top / len(nexts))
        followed = [e for e, t in nexts if t == token]
    return drafts, probs


@settings(max_examples=300, deadline=None)
@example(hay=[0, 1] * 20 + [0, 2] * 20 + [0], token=0, limit=3, cut=1.0)  # a tie among 40 occurrences
@example(hay=[0, 2] * 20 + [0, 1] * 20 + [0], token=0, limit=3, cut=1.0)
@example(hay=[0, 1, 2, SEPARATOR] * 20, token=0, limit=6, cut=1.0)  # one copied run, up to a separator
@given(
    hay=st.lists(st.integers(0, 5) | st.just(SEPARATOR), min_size=2, max_size=400),
    token=st.integers(0, 5),
    limit=st.integers(0, 9),
    cut=st.floats(0.0, 1.0),
)
@pytest.mark.slow
def test_the_walk_follows_the_most_frequent_child_as_a_suffix_tree_would(hay, token, limit, cut):
    # A small alphabet over up to 400 tokens: nodes with hundreds of occurrences (counted with numpy),
    # a few (counted in Python), copied runs, ties and separators.
    stop = max(1, int(len(hay) * cut))
    ends = [i for i in range(stop) if hay[i] == token]
    got = walk(np.array(hay, dtype=np.int64), np.array(ends, dtype=np.int64), limit, stop)
    assert got == reference_walk(hay, ends, limit, stop)


def test_a_remembered_walk_follows_the_index_when_a_request_joins_it():
    g = GlobalIndex()
    g.add(np.array([1, 2, 3, 10]))
    assert g.lookup(np.array([2, 3]), 4).drafts == [10]
    g.add(np.array([1, 2, 3, 20]))
    g.add(np.array([1, 2, 3, 20]))
    assert g.lookup(np.array([2, 3]), 4).drafts == [20]  # not the walk remembered before


# ---- the global tree -------------------------------------------------------------------------------
def test_global_index_drafts_an_earlier_output_and_counts_continuations():
    g = GlobalIndex()
    g.add(np.array([1, 2, 3, 10, 11, 12]))
    g.add(np.array([1, 2, 3, 10, 20, 21]))
    g.add(np.array([1, 2, 3, 10, 11, 13]))
    m = g.lookup(np.array([7, 2, 3]), 8)
    assert m.source == "global" and m.length == 2
    assert m.drafts[:2] == [10, 11] and m.probs[:2] == (1.0, pytest.approx(2 / 3))
    assert m.drafts[2] == 13  # 12 and 13 once each: the most recent request's


def test_global_matches_never_cross_requests():
    g = GlobalIndex()
    g.add(np.array([5, 6]))
    g.add(np.array([7, 8]))
    assert g.lookup(np.array([6]), 4).drafts == []  # 6 ends its request: nothing follows it
    assert g.lookup(np.array([5, 6, 7]), 4).drafts == [8]  # 7 matches alone, not "6 7"
    assert g.lookup(np.array([5, 6, 7]), 4).length == 1


def test_global_index_evicts_the_oldest_requests_within_its_bound():
    shared = SharedIndex(max_tokens=10)
    for start in range(0, 60, 4):
        shared.add(np.arange(start, start + 4))
        assert shared.tokens <= 10
    g = shared.partitions[None]  # the unsalted pool
    assert [int(p[0]) for p in g.parts] == [52, 56]  # the newest requests that fit, in arrival order
    assert shared.lookup(np.array([0]), 4).drafts == []  # evicted
    assert shared.lookup(np.array([56]), 4).drafts == [57, 58, 59]
    assert len(g.hay) == g.tokens + len(g.parts) + 1  # separators around every request
    shared.add(np.arange(1000, 1050))  # longer than the bound alone: only its last tokens are kept
    g = shared.partitions[None]
    assert shared.tokens == g.tokens == 10 and g.parts[-1][0] == 1040


def test_the_longer_match_wins_between_the_request_and_the_global_tree():
    proposer = SuffixProposer()
    proposer.join([FakeSeq("a", [1, 2, 3])], None)
    proposer.commit(FakeSeq("a", [1, 2, 3]), [], [4, 5, 6, 7], None)
    proposer.leave({"a"})
    assert proposer.shared.tokens == 7  # the prompt's tail (up to MATCH_CAP tokens) and the output
    seq = FakeSeq("b", [9, 1, 2, 3, 4, 8, 3])  # own text: "3" -> 4 (1 token); global: "3" too
    proposer.join([seq], None)
    assert proposer.match(seq, 2).source == "request"  # same length and score (2 sure drafts): the request's own
    assert proposer.match(seq, 4).source == "global"  # same length, but the global continuation is longer
    seq.tokens += [4, 5]  # "3 4 5": global "3 4 5" is a longer match than the request's "5" (none)
    m = proposer.match(seq, 4)
    assert (m.source, m.drafts[:2], m.length) == ("global", [6, 7], 3)
    assert best_match(m, m.__class__([])) is m


def test_leaving_without_output_adds_nothing_and_unknown_ids_are_ignored():
    proposer = SuffixProposer(global_tokens=100)
    proposer.join([FakeSeq("a", [1, 2, 3])], None)
    proposer.leave({"a", "never-joined"})
    assert proposer.shared.tokens == 0 and not proposer.requests


# ---- in the engine ---------------------------------------------------------------------------------
def test_suffix_registered_once_and_lookahead():
    assert BUILTIN.proposers.count("suffix") == 1
    assert SuffixProposer.traits.lookahead
    assert len(SuffixProposer.traits.confidence_priors) == 8


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_equals_target_only_greedy(tiny_engine_factory, prompt_ids, greedy_reference, k):
    engine = tiny_engine_factory(draft=None)
    reqs = [request(f"r{i}", p, "suffix", k) for i, p in enumerate(prompt_ids)]
    assert run(engine, reqs) == greedy_reference
    # the same prompts again: now the global tree holds the first answers, the text is still the target's
    again = [request(f"r{i}", p, "suffix", k) for i, p in enumerate(prompt_ids)]
    assert run(engine, again) == greedy_reference


def test_a_repeated_request_drafts_from_the_global_tree_from_its_first_token(tiny_engine_factory, prompt_ids):
    only = Registry(tuple(e for e in BUILTIN.entries if e.name == "suffix"))
    engine = tiny_engine_factory(registry=only, draft=None)
    prompt = prompt_ids[0]  # "Hello world, this is": nothing in it repeats, so its own tree offers nothing
    engine.add_requests([request("first", prompt, "suffix", 8, max_tokens=24)])
    outs = []
    while engine.has_unfinished():
        outs += engine.step().outputs
    assert outs[0].sources[0].origin == "plain"  # the first request's first step had nothing to draft
    answer = [t for o in outs for t in o.token_ids]
    engine.add_requests([request("second", prompt, "suffix", 8, max_tokens=24)])
    step = engine.step().outputs[0]
    assert [s.origin for s in step.sources] == ["accepted"] * 8 + ["bonus"]  # drafted from its first token
    assert step.token_ids == answer[:9]


def test_auto_uses_suffix_drafts_with_no_edits_to_auto(tiny_engine_factory, prompt_ids):
    # Fixed step costs (a verify pass's width nearly free, as for a small model's drafts on a GPU): what
    # `auto` chooses then rests on the drafts, not on how fast this machine runs the tiny model just now.
    engine = tiny_engine_factory(draft=None, cost=FixedCosts())
    first = final_stats(engine, [request("a", prompt_ids[0], "auto", 8, max_tokens=40)])["a"]
    second = final_stats(engine, [request("b", prompt_ids[0], "auto", 8, max_tokens=40)])["b"]
    assert "suffix" in second.by_proposer and second.by_proposer["suffix"].accepted_tokens > 0
    assert second.decode_steps < first.decode_steps


# ---- cache salts: cross-request drafts only within a tenant ------------------------------------------
def test_a_salted_request_drafts_only_from_outputs_with_its_salt():
    proposer = SuffixProposer()
    answer = [40, 41, 42, 43, 44, 45]
    for rid, salt in (("a", "tenant-1"), ("b", None)):
        seq = FakeSeq(rid, [1, 2, 3], salt)
        proposer.join([seq], None)
        proposer.commit(seq, [], answer if salt else [50, 51, 52], None)
        proposer.leave({rid})
    probe = [9, 1, 2, 3]
    same, other, unsalted = (FakeSeq(r, list(probe), s) for r, s in (("c", "tenant-1"), ("d", "tenant-2"), ("e", None)))
    proposer.join([same, other, unsalted], None)
    assert proposer.match(same, 8).drafts[:3] == [40, 41, 42]  # its own tenant's earlier answer
    assert proposer.match(other, 8).drafts == []  # another tenant: nothing, not even the unsalted pool
    assert proposer.match(unsalted, 8).drafts[:3] == [50, 51, 52]  # the unsalted pool only
    direct = FakeSeq("f", [1, 2, 3], "tenant-3")  # proposed for without a join (a direct caller)
    proposer.propose([direct], [8])
    proposer.commit(direct, [], [60, 61, 62], None)
    proposer.leave({"f"})
    assert proposer.shared.lookup(np.array([2, 3]), 8, "tenant-3").drafts[:3] == [60, 61, 62]
    assert proposer.match(unsalted, 8).drafts[:3] == [50, 51, 52]  # still not in the unsalted pool


def test_one_bound_holds_across_salts_and_evicts_the_oldest_request_first():
    shared = SharedIndex(max_tokens=10)
    for i in range(20):  # 20 salts, 4 tokens each: memory stays within the one bound
        shared.add(np.arange(100 * i, 100 * i + 4), salt=f"s{i}")
        assert shared.tokens <= 10 and shared.tokens == sum(p.tokens for p in shared.partitions.values())
    assert sorted(shared.partitions) == ["s18", "s19"]  # the two newest requests, whatever their salt
    assert shared.lookup(np.array([1900]), 4, salt="s19").drafts == [1901, 1902, 1903]
    assert shared.lookup(np.array([1900]), 4, salt="s18").drafts == []
    shared.add(np.arange(5000, 5012), salt="s0")  # longer than the bound alone: its last tokens only
    assert list(shared.partitions) == ["s0"] and shared.tokens == 10
