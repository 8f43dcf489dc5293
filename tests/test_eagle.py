"""The `eagle` proposer in the engine: lossless (greedy exactness, the target's distribution when
sampling, q = 0 outside the head's vocabulary), feature correction after rejections, and the
shipped/configured head resolution."""

from __future__ import annotations

import pytest
import torch

from server.config import Settings
from server.draft_head import BUILTIN_HEAD, resolve_head
from server.draft_head.model import EagleHead
from server.engine.engine import Engine
from tests.engine_helpers import final_stats, request, run


@pytest.fixture(scope="module")
def head_dir(tiny_target, tmp_path_factory):
    """An untrained head for the tiny target over 3/4 of its vocabulary (its drafts are sometimes right:
    the tiny model repeats a few tokens, and a random head guesses among those it can score)."""
    vocab = tiny_target.model.config.vocab_size
    ids = list(range(0, vocab, 4)) + list(range(1, vocab, 4)) + list(range(2, vocab, 4))
    head = EagleHead.create(tiny_target.model, ids, "tiny-target", seed=0)
    path = tmp_path_factory.mktemp("head")
    head.save_pretrained(path, dtype=torch.float32)
    return path


@pytest.fixture
def eagle_engine(tiny_target, tiny_draft, head_dir):
    def make(**overrides) -> Engine:
        return Engine(tiny_target, tiny_draft, Settings.load(draft_head=str(head_dir), **overrides))

    return make


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_eagle_equals_target_greedy(eagle_engine, prompt_ids, greedy_reference, k):
    engine = eagle_engine()
    assert "eagle" in engine.limits.methods
    stats = final_stats(engine, [request(f"r{i}", p, "eagle", k) for i, p in enumerate(prompt_ids)])
    assert all(s.by_proposer["eagle"].draft_tokens > 0 for s in stats.values())
    engine = eagle_engine()
    assert run(engine, [request(f"r{i}", p, "eagle", k) for i, p in enumerate(prompt_ids)]) == greedy_reference


def test_eagle_beside_other_methods_in_one_batch(eagle_engine, prompt_ids, greedy_reference):
    methods = ["eagle", "auto", "ngram", "draft", "eagle"]
    mixed = [request(f"r{i}", p, m, 3) for i, (p, m) in enumerate(zip(prompt_ids, methods, strict=True))]
    assert run(eagle_engine(), mixed) == greedy_reference


def test_after_rejections_the_head_cache_holds_real_features(eagle_engine, tiny_target, prompt_ids):
    """Drafted features are rolled back and replaced by the target's: after several steps the head's
    next draft equals what a fresh head computes from a clean forward over the committed tokens."""
    engine = eagle_engine()
    for i, p in enumerate(prompt_ids[:3]):
        engine.add_requests([request(f"r{i}", p, "eagle", 4, max_tokens=40)])
    for _ in range(6):
        engine.step()
    proposer = engine.proposer("eagle")
    head = proposer.head
    seqs = [engine.running[rid] for rid in engine.runner.rows]
    assert sum(s.stats.draft_tokens - s.stats.accepted_tokens for s in seqs) > 0  # rejections happened
    drafts = proposer.propose(seqs, [1] * len(seqs)).drafts
    for seq, got in zip(seqs, drafts, strict=True):
        tokens = seq.tokens
        with torch.no_grad():
            ids = torch.tensor([tokens[:-1]], device=tiny_target.device)
            feats = tiny_target.model.model(input_ids=ids).last_hidden_state  # [1, n-1, H]
            predicted, _ = head(feats, torch.tensor([tokens[1:]], device=feats.device))
            expected = int(head.vocab_ids[head.fr_logits(predicted[0, -1]).argmax()])
        assert got == [expected]


def test_sampled_drafts_never_leave_the_heads_vocabulary(eagle_engine, prompt_ids):
    """FR-Spec: q is 0 outside the head's vocabulary, so sampled drafts stay inside it (and the
    rejection sampler's residual covers the rest: lossless)."""
    engine = eagle_engine()
    for i, p in enumerate(prompt_ids):
        engine.add_requests([request(f"r{i}", p, "eagle", 4, temperature=1.5, max_tokens=30)])
    for _ in range(3):
        engine.step()
    proposer = engine.proposer("eagle")
    allowed = proposer.head.vocab_ids.tolist()
    seqs = [engine.running[rid] for rid in engine.runner.rows]
    proposal = proposer.propose(seqs, [4] * len(seqs))
    outside = torch.ones(engine.vocab_size, dtype=torch.bool)
    outside[allowed] = False
    for drafts, q in zip(proposal.drafts, proposal.q, strict=True):
        assert len(drafts) == 4 and set(drafts) <= set(allowed)
        assert q.shape == (4, engine.vocab_size) and float(q[:, outside].sum()) == 0.0


def test_greedy_rows_draft_the_heads_argmax_without_q(eagle_engine, prompt_ids):
    """Greedy rows get no q (the sampler compares with p's argmax: rejection.py shows the verdict is
    the same), sampled rows of a fixed method keep theirs, in one batch."""
    engine = eagle_engine()
    for i, p in enumerate(prompt_ids[:4]):
        engine.add_requests([request(f"r{i}", p, "eagle", 3, temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=30)])
    engine.step()
    proposer = engine.proposer("eagle")
    seqs = [engine.running[rid] for rid in engine.runner.rows]
    proposal = proposer.propose(seqs, [3] * len(seqs))
    for seq, drafts, q in zip(seqs, proposal.drafts, proposal.q, strict=True):
        assert len(drafts) == 3
        if seq.sampling.greedy:
            assert q is None
        else:
            assert q is not None and q.shape == (3, engine.vocab_size)


def test_a_named_head_must_fit_the_target_but_auto_steps_aside(tiny_target, tiny_draft):
    engine = Engine(tiny_target, tiny_draft, Settings.load(draft_head="auto"))
    assert "eagle" not in engine.limits.methods  # SmolLM2's head does not fit the tiny target
    with pytest.raises(ValueError, match="does not fit this target"):
        Engine(tiny_target, tiny_draft, Settings.load(draft_head=str(BUILTIN_HEAD)))


def test_no_head_means_no_eagle_method(tiny_target, tiny_draft):
    engine = Engine(tiny_target, tiny_draft, Settings.load(draft_head="none"))
    assert "eagle" not in engine.limits.methods
    with pytest.raises(ValueError, match="cannot run on this server"):  # configured, not silently replaced
        Engine(tiny_target, tiny_draft, Settings.load(draft_head="none", speculation="eagle"))
    assert resolve_head("auto", "some/other-model") is None  # the shipped head fits the built-in target only
    assert resolve_head(None, None) is None
    assert resolve_head("auto", None) == BUILTIN_HEAD and (BUILTIN_HEAD / "config.json").is_file()


@pytest.mark.slow
def test_a_prompt_whose_prefix_is_cached_still_drafts_with_the_head(eagle_engine, prompt_ids):
    """A prompt read from the prefix cache drafts with the head, and the output is the target's greedy
    output all the same."""
    prompt = prompt_ids[3] + prompt_ids[4] + prompt_ids[3]
    engine = eagle_engine()
    first = final_stats(engine, [request("a", prompt, "eagle", 4, max_tokens=24)])["a"]
    want = run(eagle_engine(prefix_cache_memory="none"), [request("a", prompt, "eagle", 4, max_tokens=24)])["a"]
    again = request("b", prompt, "eagle", 4, max_tokens=24)
    engine.add_requests([again])
    seq = engine.running["b"]
    got: list[int] = []
    while engine.has_unfinished():
        got += [t for o in engine.step().outputs for t in o.token_ids]
    assert first.cached_tokens == 0 and seq.stats.cached_tokens >= 16
    assert seq.stats.by_proposer["eagle"].draft_tokens > 0
    assert got == want


@pytest.mark.slow
def test_a_cached_conversation_hands_the_head_the_pairs_a_prefill_gives(eagle_engine, prompt_ids):
    """Chat clients resend the conversation every turn, so most of a prompt comes from the prefix cache
    (the last turn's prompt, stored at join, and its answer, stored at leave). The cache keeps the
    target's features beside keys and values: the head takes in every pair of the prompt, equal to a
    full prefill's to float rounding, not just those of the uncached tail (on the bench's multi-turn
    agent prompts, a head seeing only the tail accepted 0.42 of its drafts instead of 0.49)."""
    first = prompt_ids[3] + prompt_ids[4]
    engine = eagle_engine()
    answer = run(engine, [request("a", first, "eagle", 4, max_tokens=40)])["a"]
    turn = first + answer + prompt_ids[2]
    engine.add_requests([request("b", turn, "eagle", 4, max_tokens=8)])
    fresh = eagle_engine(prefix_cache_memory="none")
    fresh.add_requests([request("b", turn, "eagle", 4, max_tokens=8)])
    # the first step computes the uncached tail and verifies the last prompt token: the head cannot draft yet
    nxt = [[t for o in e.step().outputs for t in o.token_ids] for e in (engine, fresh)]
    assert nxt[0] == nxt[1] and len(nxt[0]) == 1
    assert engine.running["b"].stats.cached_tokens > len(first)  # part of the answer came from the cache too
    got, want = (e.proposer("eagle").pending["b"] for e in (engine, fresh))
    # a pair (x_t's feature, x_t+1) per prompt token but the last, then (last's feature, the first output),
    # but for those whose keys and values the head computed for the first turn (kept in the prefix cache)
    loaded = sum(s[0].shape[2] for s in engine.proposer("eagle")._loaded["b"])
    assert want.tokens == [*turn[1:], *nxt[0]] and got.tokens == want.tokens[loaded:]
    torch.testing.assert_close(torch.cat(got.features), torch.cat(want.features)[loaded:], atol=1e-4, rtol=1e-4)


def test_the_heads_backlog_is_its_prompt_pairs_then_nothing_while_it_drafts(eagle_engine, prompt_ids):
    """What the planner reads before timing the head (`Proposer.backlog`): a joining row has every pair of
    its prompt to take in (a short prompt's, once the first step computed it with the row's last token);
    once it drafts every step, only the pairs of the step before, which the first draft forward takes in
    anyway; after a step without the head, those pairs are a backlog again."""
    engine = eagle_engine()
    proposer = engine.proposer("eagle")
    engine.add_requests([request("r", prompt_ids[3], "eagle", 4, max_tokens=40)])
    assert engine.running["r"].prefill and proposer.backlog(["r"]) == 0  # its prompt is computed by the first step
    engine.step()  # no draft yet: the target had no features of the prompt
    assert engine.running["r"].stats.by_proposer.get("eagle") is None
    assert proposer.backlog(["r"]) == len(prompt_ids[3])  # one pair per prompt token but the last, and the output's
    engine.step()  # the first draft took them in
    assert engine.running["r"].stats.by_proposer["eagle"].draft_tokens > 0
    assert proposer.backlog(["r"]) == 0
    seq = engine.running["r"]
    hidden = torch.zeros(1, proposer.head.config.hidden_size)
    proposer.commit(seq, [], [5], hidden)  # a step in which the row did not draft with the head
    assert proposer.backlog(["r"]) == len(proposer.pending["r"].tokens) >= 2


@pytest.mark.slow
def test_the_heads_keys_and_values_of_a_cached_prompt_come_back_from_the_prefix_cache(eagle_engine, prompt_ids):
    """An agent's system prompt and tools, or a chat's earlier turns, come with every request. The prefix
    cache keeps the head's own keys and values of them beside the target's (stored when a request that
    drafted with the head leaves), so the next request's head takes in only the pairs after them: on two
    CPU cores a 460-token prompt's pairs took the head ~50 ms, against ~1 s for an agent's whole answer.
    The head then holds what computing them would have given it, and drafts the same."""
    shared = prompt_ids[3] + prompt_ids[4] + prompt_ids[3]
    engine = eagle_engine()
    run(engine, [request("a", shared + prompt_ids[1], "eagle", 4, max_tokens=12)])
    turn = shared + prompt_ids[2]
    fresh = eagle_engine(prefix_cache_memory="none")
    got, want = [], []
    for e in (engine, fresh):
        e.add_requests([request("b", turn, "eagle", 4, max_tokens=24)])
    heads = [e.proposer("eagle") for e in (engine, fresh)]
    for e, out in ((engine, got), (fresh, want)):
        out += [t for o in e.step().outputs for t in o.token_ids]  # the tail computed: no draft from the head yet
    blocks = len(shared) // 16
    loaded = sum(s[0].shape[2] for s in heads[0]._loaded["b"])
    assert blocks >= 2 and loaded == 16 * blocks - 1  # the pairs those blocks' tokens determine
    assert heads[0].backlog(["b"]) == heads[1].backlog(["b"]) - loaded
    for e, out in ((engine, got), (fresh, want)):
        out += [t for o in e.step().outputs for t in o.token_ids]  # the head's first draft
    rows = [h.runner.live("b") for h in heads]
    for cached, computed in zip(rows[0](0, len(turn) - 1), rows[1](0, len(turn) - 1), strict=True):
        torch.testing.assert_close(cached, computed, atol=1e-4, rtol=1e-4)
    for e, out in ((engine, got), (fresh, want)):
        while e.has_unfinished():
            out += [t for o in e.step().outputs for t in o.token_ids]
    assert got == want
    assert engine.running == {} and heads[0]._loaded == {}
