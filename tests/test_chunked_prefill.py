"""Chunked prefill: each step's one target pass computes at most `max_num_batched_tokens` tokens, running
rows' verify passes first, then prompt chunks oldest first (server/speculation/budget.py). Whatever the
budget cuts prompts at, greedy output is what computing each prompt whole gives, for every proposer and
under a grammar; a seeded request samples the same text; the prefix cache, the draft head's features and
cancellation stay right."""

from __future__ import annotations

from types import SimpleNamespace

import llguidance
import pytest
import torch

from server.config import Settings
from server.engine.engine import Engine
from server.model.prefix_cache import BLOCK
from server.speculation.budget import Room, StepBudget, attention_span, entering, fit, split
from server.types import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_helpers import assert_same_draws, request, run, run_with_stats
from tests.test_eagle import head_dir  # noqa: F401 - the fixture

K = 3
WHOLE = 10**6  # a budget no prompt here reaches: every prompt is computed by its first step
# K + 2 (one token beyond a row's K + 1), a block - 1, a block, a block + 1, and two blocks + 1
BUDGETS = [K + 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 1]
METHODS = ["none", "ngram", "suffix", "draft", "eagle", "auto"]


@pytest.fixture
def make(tiny_target, tiny_draft, head_dir):  # noqa: F811
    def engine(budget: int, **overrides) -> Engine:
        settings = dict(draft_head=str(head_dir), max_batch_size=4, num_speculative_tokens=K,
                        auto_max_speculative_tokens=K, max_num_batched_tokens=budget)
        return Engine(tiny_target, tiny_draft, Settings.load(**(settings | overrides)))

    return engine


def long_prompts(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Prompts of 37 to 65 tokens (two to four blocks), each different."""
    return [(p * 80)[: 37 + 7 * i] for i, p in enumerate(prompt_ids)]


def test_the_budget_split_serves_decoding_rows_then_prompts_oldest_first():
    """The module docstring's example: budget 64, three decoding rows, an older 1,000-token prompt (prefilling)
    and a new 20-token one that finishes beside it (a short prompt never waits behind a long one)."""
    shares = split(64, [0, 0, 1000, 0, 19])
    assert shares.verify == [True, True, False, True, True] and shares.room == Room(41, 0)
    assert shares.chunks == [0, 0, 0, 0, 19]
    assert shares.with_drafts(10) == [0, 0, 31, 0, 19]  # drafts displace the long prompt's tokens
    assert split(64, [0, 1000, 70, 19]).with_drafts(0) == [0, 43, 0, 19]  # the oldest that does not fit
    finishing = split(64, [0, 30, 0])  # a prompt that ends this step also decodes
    assert finishing.chunks == [0, 30, 0] and finishing.verify == [True, True, True]
    assert finishing.room == Room(64 - 3 - 30, 64 - 3 - 30)  # nothing waits: no draft displaces a prompt token
    assert entering(64, [0, 0, 30]) == 64 - 2 - 31 and entering(8, [0, 100]) == 7 and entering(8, [0] * 8) == 0
    assert fit([8, 2, 5], 9) == [3, 2, 4] and fit([1, 1], 0) == [0, 0]


def test_a_budget_below_k_plus_one_is_refused_at_start_up():
    with pytest.raises(ValueError, match="max_num_batched_tokens 8 is too small.*at least 9"):
        Settings.load(max_num_batched_tokens=8, num_speculative_tokens=8, auto_max_speculative_tokens=8,
                      max_batch_size=4)
    assert Settings.load(max_num_batched_tokens=9, num_speculative_tokens=8, auto_max_speculative_tokens=8,
                         max_batch_size=4).step_token_budget("cpu") == 9


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_same_whatever_the_budget_cuts_prompts_at(make, prompt_ids, method):
    prompts = long_prompts(prompt_ids)
    reqs = lambda: [request(f"r{i}", p, method, K, max_tokens=12) for i, p in enumerate(prompts)]  # noqa: E731
    want = run(make(WHOLE, prefix_cache_memory="none"), [request(f"r{i}", p, max_tokens=12)
                                                         for i, p in enumerate(prompts)])
    for budget in BUDGETS:
        assert run(make(budget), reqs()) == want, budget


def test_a_long_prompt_never_stalls_the_running_rows(make, prompt_ids):
    """A row decodes a token (or more) every step while a prompt of 300 tokens is computed in chunks beside
    it; the long prompt's first token comes in the step that computes its last chunk."""
    engine = make(BLOCK + 1)
    engine.add_requests([request("short", prompt_ids[0], "none", max_tokens=40)])
    engine.step()
    engine.add_requests([request("long", (prompt_ids[3] * 20)[:300], "none", max_tokens=4)])
    chunks, waiting = [], []
    while "long" in engine.running and not engine.running["long"].output_ids:
        result = engine.step()
        assert [o.request_id for o in result.outputs if o.request_id == "short"] == ["short"]
        chunks.append(result.prefill_tokens)
        waiting.append(result.prompt_tokens_waiting)
    assert sum(chunks) == 299 and waiting[-1] == 0 and waiting == sorted(waiting, reverse=True)
    # the budget less the short row's token, prompt tokens counted by depth (StepBudget): each chunk as long
    # as that allows (the last one also holds the prompt's last token), shorter the deeper it goes
    budget, done = engine.step_budget, 0
    for chunk in chunks[:-1]:
        assert budget.cost(done, chunk) <= BLOCK < budget.cost(done, chunk + 1)
        done += chunk
    assert budget.cost(done, chunks[-1] + 1) <= BLOCK
    assert 0 < chunks[-2] < chunks[0] <= BLOCK and chunks[:-1] == sorted(chunks[:-1], reverse=True)


def test_a_long_prompt_grows_the_batch_cache_once_when_it_enters(make, prompt_ids, monkeypatch):
    """Every step appends its width to every row, so a long prompt's chunks take its columns in every row:
    the cache grows to hold them when it enters, not by doubling chunk after chunk (each doubling moved every
    row). The text is what a cache that doubles gives."""
    from server.model.kv_cache import BatchKV

    def generate(expect: bool) -> tuple[dict[str, list[int]], list[int]]:  # both requests' tokens, growths
        engine = make(BLOCK + 1)
        grown: list[int] = []
        resize = BatchKV._resize
        monkeypatch.setattr(BatchKV, "_resize", lambda kv, cap: (
            grown.append(cap) if kv is engine.runner.kv and cap > kv.capacity else None, resize(kv, cap))[1])
        if not expect:
            monkeypatch.setattr(BatchKV, "expect", lambda kv, columns: None)
        engine.add_requests([request("short", prompt_ids[0], "none", max_tokens=40)])
        engine.step()
        engine.add_requests([request("long", (prompt_ids[3] * 20)[:300], "none", max_tokens=4)])
        out: dict[str, list[int]] = {"short": [], "long": []}
        while engine.has_unfinished():
            for o in engine.step().outputs:
                out[o.request_id] += o.token_ids
        monkeypatch.undo()
        return out, grown

    doubling, grown_doubling = generate(expect=False)
    once, grown_once = generate(expect=True)
    assert len(grown_doubling) >= 3 and len(grown_once) == 1 and grown_once[0] >= 300
    assert once == doubling


def test_a_short_prompt_never_waits_behind_a_long_one(make, prompt_ids):
    """A short request that arrives while a 300-token prompt is being computed enters the batch and computes
    its whole prompt in the next step (the long prompt's chunk is what is left): its first token comes then,
    not after the long prompt's; both give what each alone gives."""
    long_prompt, short_prompt = (prompt_ids[3] * 20)[:300], prompt_ids[0][:BLOCK // 2]
    want = run(make(WHOLE), [request("long", long_prompt, max_tokens=6)]) | run(
        make(WHOLE), [request("short", short_prompt, max_tokens=6)])
    engine = make(BLOCK + 1)
    got = {"long": [], "short": []}
    engine.add_requests([request("long", long_prompt, max_tokens=6)])
    engine.step()
    engine.add_requests([request("short", short_prompt, max_tokens=6)])
    result = engine.step()
    assert [o.request_id for o in result.outputs] == ["short"]  # its first token, the long prompt mid-way
    assert engine.running["long"].prompt_left > 0 and 0 < result.prefill_tokens
    for out in result.outputs:
        got[out.request_id] += out.token_ids
    while engine.has_unfinished():
        for out in engine.step().outputs:
            got[out.request_id] += out.token_ids
    assert got == want


def test_prompt_tokens_deep_in_a_long_context_take_more_of_the_budget():
    """A prompt token's attention reads every earlier token: past the model's attention span it costs more
    than its linear layers, so a chunk deep into a long prompt is shorter and a step costs about the same
    wherever its chunk sits (budget.py `StepBudget`)."""
    smol = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    assert attention_span(smol) == 3072 and attention_span(SimpleNamespace()) is None
    budget = StepBudget(128, 3072)
    first = split(budget, [0, 0, 8000], [0, 0, 0]).with_drafts(0)[2]  # two decoding rows take 2 tokens
    deep = split(budget, [0, 0, 100], [0, 0, 7900]).with_drafts(0)[2]
    for start, chunk in ((0, first), (7900, deep)):
        assert budget.cost(start, chunk) <= 126 < budget.cost(start, chunk + 1)
    assert first == 123 and 34 <= deep <= 36  # 8,000 tokens in: each costs 1 + 7,900 / 3,072 ~ 3.6
    # a prompt that would finish unweighted waits for its last chunk when it sits deep
    assert split(64, [0, 30], [0, 200]).verify == [True, True]
    assert split(StepBudget(64, 100), [0, 30], [0, 200]).verify == [True, False]
    # with no row decoding nobody waits: a prompt alone is computed in chunks of the whole budget
    assert split(budget, [7000], [1000]).with_drafts(0) == [128]
    # however deep a prompt, a step with room for a token computes one: it always moves
    assert StepBudget(8, 10).within(10**6, 50, 3) == 1 and StepBudget(8, 10).within(0, 50, 0.5) == 0
    assert StepBudget(64).within(5000, 50, 20) == 20  # no span: every token counts 1


def test_a_prompt_computed_in_chunks_inside_the_cached_prefix_reads_and_stores_it_exactly(make, prompt_ids):
    """A shared system prompt of three blocks and a bit: the first request computes it in chunks that end
    inside blocks and stores every whole block; later ones read exactly those blocks (`cached_tokens`) and
    compute the rest in chunks; the text is what no cache and no chunking give."""
    system = (prompt_ids[4] * 20)[: 3 * BLOCK + 5]
    reqs = [request(f"q{i}", system + (p * 4)[:9], "ngram", K, max_tokens=10) for i, p in enumerate(prompt_ids)]
    want = run(make(WHOLE, prefix_cache_memory="none"), reqs)
    for budget in (BLOCK - 3, BLOCK + 1):
        engine = make(budget)
        got, stats = run_with_stats(engine, reqs[:1])
        assert stats["q0"].cached_tokens == 0
        more, more_stats = run_with_stats(engine, reqs[1:])
        assert got | more == want, budget
        assert all(s.cached_tokens == 3 * BLOCK for s in more_stats.values()), budget  # the system prompt's blocks


def test_prompt_tokens_computed_and_read_add_up_to_every_prompt(make, prompt_ids):
    """Every prompt token but the last is computed by a step or read from the prefix cache, exactly once."""
    engine = make(BLOCK - 1)
    system = (prompt_ids[3] * 10)[: 2 * BLOCK + 3]
    reqs = [request(f"r{i}", system + p, "ngram", K, max_tokens=6) for i, p in enumerate(prompt_ids)]
    engine.add_requests(reqs)
    computed = cached = 0
    while engine.has_unfinished():
        result = engine.step()
        computed += result.prefill_tokens
        cached += result.cached_tokens
    assert computed + cached == sum(len(r.prompt_token_ids) - 1 for r in reqs)
    assert cached == (len(reqs) - 1) * 2 * BLOCK  # the others wait for the first one's blocks, then read them


@pytest.mark.slow
def test_constrained_greedy_output_is_the_same_whatever_the_budget(make, prompt_ids):
    grammar = llguidance.LLMatcher.grammar_from_regex(r"(ab|cd){2,6}x")
    prompts = long_prompts(prompt_ids)

    def reqs(method: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"c{i}", tuple(p), SamplingParams(max_tokens=16, temperature=0.0),
                                  SpeculationParams(method, K), grammar) for i, p in enumerate(prompts[:3])]

    want = run(make(WHOLE), reqs("none"))
    for method in ("ngram", "draft", "auto"):
        for budget in (K + 2, BLOCK + 1):
            assert run(make(budget), reqs(method)) == want, (method, budget)


@pytest.mark.slow
def test_a_seed_samples_the_same_text_with_and_without_chunks(make, tiny_target, prompt_ids):
    """The same seeded request, its prompt computed whole or in chunks beside other rows: the same text (up
    to a tie at a CDF boundary: a prompt computed in chunks gives p to float rounding only)."""
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 5, "max_tokens": 20}
    prompt = long_prompts(prompt_ids)[4]
    reference = run(make(WHOLE), [request("seeded", prompt, "ngram", K, **params)])["seeded"]
    for budget in (K + 2, BLOCK + 1):
        others = [request(f"o{i}", p, "ngram", K, temperature=1.0, max_tokens=8)
                  for i, p in enumerate(prompt_ids[:3])]
        got = run(make(budget), [*others, request("seeded", prompt, "ngram", K, **params)])["seeded"]
        assert len(got) == len(reference)
        assert_same_draws(tiny_target.model, prompt, got, reference, params, budget)


def test_the_draft_head_gets_the_features_of_every_chunk(make, prompt_ids):
    """The head takes in each chunk's pairs as the target computes it (its cache keeps up with a long prompt:
    no backlog of it at its first draft); once it has drafted, its cache over the prompt holds what a whole
    prefill gives it: none of the chunks' features is lost or repeated."""
    prompt = long_prompts(prompt_ids)[3]
    caches = {}
    for budget in (WHOLE, BLOCK + 1, K + 2):
        engine = make(budget, prefix_cache_memory="none")
        engine.add_requests([request("r", prompt, "eagle", K, max_tokens=8)])
        while not engine.running["r"].output_ids:
            engine.step()
        head = engine.proposer("eagle")
        # a pair per prompt token but the last, and the first output's: all waiting after a whole prefill, only
        # the last chunk's after chunks
        backlog = head.backlog(["r"])
        assert backlog == len(prompt) if budget == WHOLE else backlog < budget
        engine.step()  # the head drafts: it takes in what it had not
        assert engine.running["r"].stats.by_proposer["eagle"].draft_tokens > 0
        keys, values = head.runner.live("r")(0, len(prompt) - 1)
        caches[budget] = (keys.clone(), values.clone())
    for budget in (BLOCK + 1, K + 2):
        for got, want in zip(caches[budget], caches[WHOLE], strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_cancelling_mid_prefill_frees_everything_and_keeps_the_blocks_computed(make, prompt_ids):
    engine = make(BLOCK + 1)
    prompt = (prompt_ids[3] * 20)[:200]
    engine.add_requests([request("gone", prompt, "eagle", K, max_tokens=8)])
    for _ in range(3):
        engine.step()
    assert engine.running["gone"].prompt_left > 0  # mid-prefill
    computed = engine.running["gone"].prompt_computed
    assert computed >= 2 * BLOCK
    engine.abort_request("gone")
    assert not engine.running and engine.runner.rows == [] and engine.kv_cache_usage() == 0  # no KV left held
    assert all(not ids for ids in engine.planner.members.values())
    assert engine.admission.prompt_waiting() == 0
    engine.add_requests([request("retry", prompt, "eagle", K, max_tokens=8)])
    engine.step()
    assert engine.running["retry"].stats.cached_tokens == computed // BLOCK * BLOCK  # the whole blocks computed
