"""The prefix cache: prompts that start like earlier ones reuse their keys and values instead of a prefill,
and what follows is exactly what a full prefill gives (to float rounding)."""

from __future__ import annotations

import pytest
import torch

from server.config import Settings
from server.engine.engine import Engine
from server.model.prefix_cache import BLOCK, PrefixCache, concat, concat_features, leading_states
from server.model.runner import ModelRunner
from tests.engine_helpers import final_stats, request, run
from tests.test_kv_cache import clean_logits


def _store(cache: PrefixCache, runner: ModelRunner, rid: str, tokens: list[int], salt: str | None = None) -> None:
    cache.store(tokens[: runner.cached(rid)], salt, runner.live(rid))


def test_a_cached_prefix_gives_the_logits_of_a_full_prefill(tiny_target):
    model = tiny_target.model
    cache = PrefixCache(64 << 20)
    runner = ModelRunner(model)
    system = list(range(100, 100 + 3 * BLOCK + 5))  # 53 tokens: three full blocks
    first = system + [7, 8, 9]
    runner.join(["a"], [first])
    # drafts, some rejected: the stored tokens are the live ones only
    runner.forward([[10, 11, 12, 13]])
    runner.rollback(0, 2)  # keeps 10, 11
    _store(cache, runner, "a", first + [10, 11])
    runner.leave({"a"})
    assert len(cache) == (len(first) + 2) // BLOCK

    second = system + [40, 41, 42, 43]
    blocks = cache.match(second, None)
    assert len(blocks) == 3  # the shared system prompt; the fourth block differs
    hidden = runner.join(["b"], [second], hidden=True, prefixes=[concat(blocks)])
    assert hidden[0].shape[0] == len(second) - 3 * BLOCK  # only the computed tokens have hidden states
    assert [runner.cached(rid) for rid in runner.rows] == [len(second)]
    logits = runner.forward([[44, 45]]).logits
    torch.testing.assert_close(logits[0, 1], clean_logits(model, second + [44, 45]), atol=1e-4, rtol=1e-4)


def test_rows_with_and_without_a_prefix_join_together(tiny_target):
    model = tiny_target.model
    cache = PrefixCache(64 << 20)
    runner = ModelRunner(model)
    shared = list(range(300, 300 + 2 * BLOCK))
    runner.join(["a"], [shared + [1, 2, 3]])
    _store(cache, runner, "a", shared + [1, 2, 3])
    runner.leave({"a"})
    prompts = [shared + [5, 6], [9, 10, 11], shared]  # the last is all cached: nothing is computed for it
    prefixes = [concat(b) if b else None for b in (cache.match(p, None) for p in prompts)]
    assert [p is not None for p in prefixes] == [True, False, True]
    runner.join(["x", "y", "z"], prompts, prefixes=prefixes)
    logits = runner.forward([[20], [21, 22], [23]]).logits
    torch.testing.assert_close(logits[0, 0], clean_logits(model, prompts[0] + [20]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, 1], clean_logits(model, prompts[1] + [21, 22]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[2, 0], clean_logits(model, prompts[2] + [23]), atol=1e-4, rtol=1e-4)


def test_salts_never_share_and_blocks_are_named_by_their_whole_prefix(tiny_target):
    runner = ModelRunner(tiny_target.model)
    cache = PrefixCache(64 << 20)
    tokens = list(range(500, 500 + 2 * BLOCK))
    runner.join(["a"], [tokens])
    _store(cache, runner, "a", tokens, salt="tenant-1")
    assert len(cache.match(tokens, "tenant-1")) == 2
    assert cache.match(tokens, "tenant-2") == [] and cache.match(tokens, None) == []
    # the same second block after a different first block is a different prefix: no reuse of block 2 alone
    other = [1] * BLOCK + tokens[BLOCK:]
    assert cache.match(other, "tenant-1") == []


def test_the_budget_evicts_least_recently_used_leaves_first(tiny_target):
    runner = ModelRunner(tiny_target.model)
    probe = PrefixCache(1 << 30)
    runner.join(["a", "b"], [list(range(10, 10 + 3 * BLOCK)), list(range(900, 900 + 3 * BLOCK))])
    _store(probe, runner, "a", list(range(10, 10 + 3 * BLOCK)))
    per_block = probe.used_bytes // 3
    cache = PrefixCache(4 * per_block)  # room for four blocks
    a, b = list(range(10, 10 + 3 * BLOCK)), list(range(900, 900 + 3 * BLOCK))
    _store(cache, runner, "a", a)
    _store(cache, runner, "b", b)  # six blocks wanted: a's two deepest go first
    assert cache.used_bytes <= cache.budget_bytes and len(cache) == 4
    assert len(cache.match(a, None)) == 1 and len(cache.match(b, None)) == 3


def test_features_stored_with_a_prefix_come_back_with_it_and_a_block_without_them_ends_the_match(tiny_target):
    """A draft head reads the target's feature at every prompt position: a prefix served to it must carry
    them, or the head drafts from the uncached tail only."""
    runner = ModelRunner(tiny_target.model)
    cache = PrefixCache(64 << 20)
    tokens = list(range(40, 40 + 3 * BLOCK + 3))
    hidden = runner.join(["a"], [tokens], hidden=True)[0]
    cache.store(tokens[: 2 * BLOCK], None, runner.live("a"))  # two blocks stored without features
    before = cache.used_bytes
    assert len(cache.match(tokens, None)) == 2 and cache.match(tokens, None, features=True) == []
    cache.store(tokens, None, runner.live("a"), hidden[: 2 * BLOCK + 5])  # features cover two blocks of three
    assert len(cache) == 3 and cache.used_bytes > before * 3 // 2  # the two gained features, the third was added
    with_features = cache.match(tokens, None, features=True)
    assert len(with_features) == 2 and len(cache.match(tokens, None)) == 3
    torch.testing.assert_close(concat_features(with_features), hidden[: 2 * BLOCK])
    cache.store(tokens, None, runner.live("a"), hidden)  # now the third block gets its features
    torch.testing.assert_close(concat_features(cache.match(tokens, None, features=True)), hidden[: 3 * BLOCK])


def test_a_proposers_state_is_kept_per_block_and_added_to_blocks_stored_without_it(tiny_target):
    """What a proposer computed of a prefix (a draft head's own keys and values) rides in the same blocks:
    stored when it has it, added to blocks cached before it had, and handed back for the leading blocks
    that hold it; its reader is not called when every block holds its state already."""
    runner = ModelRunner(tiny_target.model)
    cache = PrefixCache(64 << 20)
    tokens = list(range(40, 40 + 3 * BLOCK + 3))
    runner.join(["a"], [tokens])
    cache.store(tokens, None, runner.live("a"))  # the prompt, before the proposer computed anything
    assert all(not b.states for b in cache.match(tokens, None))
    before = cache.used_bytes
    calls = []

    def head(n: int) -> list[tuple[torch.Tensor, ...]]:  # it computed two blocks' worth of three
        calls.append(n)
        return [(torch.full((1, 2, BLOCK), float(i)),) for i in range(min(n, 2))]

    assert cache.store(tokens, None, runner.live("a"), states={"head": head}) == 0  # no block added
    assert calls == [3] and cache.used_bytes == before + 2 * 2 * BLOCK * 4
    blocks = cache.match(tokens, None)
    assert len(blocks) == 3 and [s[0][0, 0, 0].item() for s in leading_states(blocks, "head")] == [0.0, 1.0]
    assert leading_states(blocks, "draft") == []
    cache.store(tokens[: 2 * BLOCK], None, runner.live("a"), states={"head": head})
    assert calls == [3]  # both blocks hold it: not read again


@pytest.mark.slow
def test_a_draft_model_starts_from_the_keys_and_values_it_computed_for_an_earlier_prompt(tiny_target, tiny_draft,
                                                                                       prompt_ids):
    """The draft model's cache is filled when a row first drafts with it: a prompt's blocks that an earlier
    request's draft computed are loaded, not computed again, and it drafts what it would have."""
    shared = prompt_ids[3] + prompt_ids[4] + prompt_ids[3]
    engine = Engine(tiny_target, tiny_draft, Settings.load())
    run(engine, [request("a", shared + prompt_ids[1], "draft", 4, max_tokens=12)])
    fresh = Engine(tiny_target, tiny_draft, Settings.load(prefix_cache_memory="none"))
    turn = shared + prompt_ids[2]
    for e in (engine, fresh):
        e.add_requests([request("b", turn, "draft", 4, max_tokens=24)])
        e.admission.enter(e.step_budget.tokens)  # the row enters the batch (the first step's start): prefix loaded
    drafts = [e.proposer("draft") for e in (engine, fresh)]
    assert sum(s[0].shape[2] for s in drafts[0]._loaded["b"]) == len(shared) // BLOCK * BLOCK
    out: list[list[int]] = [[], []]
    for e, got in zip((engine, fresh), out, strict=True):
        got += [t for o in e.step().outputs for t in o.token_ids]
        d = e.proposer("draft")
        assert d.runner.cached("b") >= len(turn) - 1
    rows = [d.runner.live("b") for d in drafts]
    for cached, computed in zip(rows[0](0, len(turn) - 1), rows[1](0, len(turn) - 1), strict=True):
        torch.testing.assert_close(cached, computed, atol=1e-4, rtol=1e-4)
    for e, got in zip((engine, fresh), out, strict=True):
        while e.has_unfinished():
            got += [t for o in e.step().outputs for t in o.token_ids]
    assert out[0] == out[1]


def _engine(tiny_target, **overrides) -> Engine:
    return Engine(tiny_target, None, Settings.load(**overrides))


def test_engine_outputs_are_unchanged_and_usage_counts_the_cached_tokens(tiny_target, tokenizer):
    system = tokenizer.encode(
        "You are a careful assistant for a home automation system. Answer with one JSON tool call, nothing "
        "else. Tools: lights(room, on), thermostat(celsius), blinds(room, open)."
    )
    assert len(system) > 2 * BLOCK
    questions = [tokenizer.encode(q) for q in (" Turn on the kitchen lights.", " Make it 21 degrees.")]
    reqs = [request(f"q{i}", system + q, method="ngram", k=4, max_tokens=12) for i, q in enumerate(questions)]

    plain = _engine(tiny_target, prefix_cache_memory="none")
    assert plain.admission.prefixes is None
    want = {rid: toks for r in reqs for rid, toks in run(plain, [r]).items()}

    cached = _engine(tiny_target)
    first = final_stats(cached, [reqs[0]])["q0"]
    assert first.cached_tokens == 0
    second = final_stats(cached, [reqs[1]])["q1"]
    assert second.cached_tokens == (len(system) // BLOCK) * BLOCK  # the system prompt's full blocks
    # the same request again: every full block of its prompt (but the last token, which a step feeds) now
    again = request("q0-again", system + questions[0], method="ngram", k=4, max_tokens=12)
    prefilled = len(again.prompt_token_ids) - 1
    assert final_stats(cached, [again])["q0-again"].cached_tokens == prefilled // BLOCK * BLOCK > len(system) - BLOCK

    replay = _engine(tiny_target)
    got = {}
    for r in (*reqs, again):
        got.update(run(replay, [r]))
    assert got["q0"] == want["q0"] and got["q1"] == want["q1"] and got["q0-again"] == want["q0"]


async def test_a_repeated_conversation_reports_cached_tokens_in_usage_and_metrics(tiny_engine_factory):
    from tests.api_helpers import MODEL, running_app

    system = ("You are the assistant of a hardware store. Answer in one short sentence. The store opens at "
              "eight, closes at six, and sells tools, paint, garden supplies and screws of every size.")
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}]}
    async with running_app(tiny_engine_factory) as (_, client):
        first = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
        again = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
        salted = (await client.post("/v1/chat/completions", json={**body, "cache_salt": "other"})).json()["usage"]
        page = (await client.get("/metrics")).text
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens"] == first["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (first["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0  # another salt shares nothing
    hits = next(line for line in page.splitlines() if line.startswith("specula_prefix_cache_hits_total{"))
    assert float(hits.split()[-1]) == again["prompt_tokens_details"]["cached_tokens"]


def test_a_request_arriving_while_another_runs_shares_its_prompt(tiny_target):
    """Prompt blocks are stored once prefilled, not only when the request leaves: clients that send the
    same system prompt at once (continuous batching) reuse it while the first request still decodes."""
    engine = _engine(tiny_target)
    system = list(range(2000, 2000 + 3 * BLOCK + 4))
    engine.add_requests([request("first", system + [5, 6, 7], max_tokens=8)])
    engine.step()
    engine.add_requests([request("second", system + [9, 9], max_tokens=8)])
    engine.step()  # it enters the batch: its prompt's blocks are read from the cache
    assert engine.running["first"].stats.cached_tokens == 0
    assert engine.running["second"].stats.cached_tokens == 3 * BLOCK
    while engine.has_unfinished():
        engine.step()


def test_an_aborted_request_leaves_what_it_computed(tiny_target):
    """A client that disconnects mid-answer still leaves its prompt and the answer so far: a retry that
    sends the partial answer back (as chat clients do on "continue") reuses them."""
    engine = _engine(tiny_target)
    prompt = list(range(3000, 3000 + BLOCK + 3))
    engine.add_requests([request("gone", prompt, max_tokens=64)])
    for _ in range(2 * BLOCK):
        engine.step()
    seq = engine.running["gone"]
    computed = seq.tokens[: engine.runner.cached("gone")]
    engine.abort_request("gone")
    assert not engine.has_unfinished()
    retry = request("retry", computed + [7], max_tokens=2)
    engine.add_requests([retry])
    engine.step()  # it enters the batch: what the aborted request computed is read from the cache
    assert engine.running["retry"].stats.cached_tokens == len(computed) // BLOCK * BLOCK >= 2 * BLOCK


def test_requests_joining_together_with_one_prompt_prefill_it_once(tiny_target):
    """The `n` choices of one request (or clients sending one system prompt at once) join in one call:
    the first computes the shared blocks, the others wait for them (one step) and read them, together; the
    text is what no cache gives."""
    prompt = list(range(4000, 4000 + 2 * BLOCK + 5))
    reqs = [request(f"c{i}", prompt + [i], method="ngram", k=3, max_tokens=10) for i in range(3)]
    reqs.append(request("other", list(range(7000, 7000 + BLOCK + 2)), max_tokens=10))
    want = run(_engine(tiny_target, prefix_cache_memory="none"), reqs)
    engine = _engine(tiny_target)
    engine.add_requests(reqs)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    entered = []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            got[out.request_id] += out.token_ids
        entered.append(list(engine.runner.rows))
        assert list(engine.running)[: len(engine.runner.rows)] == engine.runner.rows  # the cache's row order
        if len(entered) == 2:
            assert [engine.running[r.request_id].stats.cached_tokens for r in reqs] == [0, 2 * BLOCK, 2 * BLOCK, 0]
    assert entered[:2] == [["c0", "other"], ["c0", "other", "c1", "c2"]]
    assert got == want


def test_a_row_that_cannot_enter_the_batch_fails_alone_and_leaves_nothing_behind(tiny_target, monkeypatch):
    """Requests join without computing anything; a row that cannot enter the target's batch (the target
    cannot take it, with its cached prefix or without) fails alone at that step: its neighbour goes on,
    nothing of it stays behind, and the same request id can be sent again."""
    engine = _engine(tiny_target)
    prompt = list(range(5000, 5000 + BLOCK + 3))
    join = ModelRunner.join
    calls = []

    def fails_for_bad(self, request_ids, *args, **kwargs):  # noqa: ANN001
        calls.append(request_ids)
        if "bad" in request_ids:
            raise RuntimeError("the target's forward failed")
        return join(self, request_ids, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "join", fails_for_bad)
    engine.add_requests([request("good", prompt, "ngram"), request("bad", prompt + [1], "ngram")])
    assert calls == [] and set(engine.running) == {"good", "bad"}  # joining computes nothing
    engine.step()
    assert calls == [["good"]] and engine.runner.rows == ["good"]  # "bad" waits for the block "good" computes
    result = engine.step()
    assert calls == [["good"], ["bad"], ["bad"]]  # with its cached prefix, then with none
    assert "bad" in result.failed and [o.request_id for o in result.outputs] == ["good"]
    assert list(engine.running) == ["good"] and engine.runner.rows == ["good"]
    assert all("bad" not in ids for ids in engine.planner.members.values())
    monkeypatch.setattr(ModelRunner, "join", join)
    engine.add_requests([request("bad", prompt + [1], "ngram")])  # nothing of the failed row stays behind
    while engine.has_unfinished():
        engine.step()


def test_a_proposer_that_cannot_join_a_row_leaves_it_to_decode_without_it(tiny_target):
    """A proposer's join is optional (server/failsafe.py): the rows join without it, decode plain, and
    give plain decoding's text; the failure is counted."""
    from server.speculation.ngram import NgramProposer
    from server.speculation.registry import BUILTIN, Entry

    class Picky(NgramProposer):
        def join(self, seqs, prompt_hidden):  # noqa: ANN001
            if any(s.request_id == "bad" for s in seqs):
                raise RuntimeError("this proposer refuses request 'bad'")
            super().join(seqs, prompt_hidden)

    registry = BUILTIN.with_entry(Entry("picky", Picky))
    prompt = list(range(5000, 5000 + BLOCK + 3)) * 2
    reqs = [request("good", prompt, "picky"), request("bad", prompt + [1], "picky")]
    want = run(_engine(tiny_target), [request(r.request_id, r.prompt_token_ids, "none") for r in reqs])
    engine = Engine(tiny_target, None, Settings.load(), registry=registry)
    assert run(engine, reqs) == want
    assert engine.parts.failures == {"proposer:picky": 1}
    assert not engine.planner.members["picky"]
