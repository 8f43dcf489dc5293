"""Grammar-constrained decoding stays lossless under speculation.

* Greedy: a JSON-schema-constrained request gives the same tokens with every method as with plain
  decoding, and the text validates against the schema.
* Sampled: the first two tokens under a grammar whose allowed set at position 2 depends on token 1
  follow the exact constrained distribution (chi-square), for sampled drafts (draft model, EAGLE head)
  whose unconstrained q often proposes forbidden tokens; cutting such a draft before the forbidden
  token instead of rejecting it (the wrong rule) is caught.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch
from scipy.stats import chisquare

import server.speculation.planner as planner_module
from server.api.structured import JSON_STYLE
from server.config import Settings
from server.engine.engine import Engine
from server.grammar import Grammars
from server.speculation.plan import FORCED, RowPlan, Rule
from server.types import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_helpers import request
from tests.test_distribution import P_VALUE, PROMPT, VOCAB, first_two_token_counts, pair  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["color", "count", "ok", "name"],
    "additionalProperties": False,
}


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)  # the API's style


def run_constrained(engine: Engine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], str, object]]:
    """request id -> (tokens, text, final stats); every constrained request must complete its grammar."""
    constrained = {r.request_id for r in requests if r.grammar is not None}
    engine.add_requests(requests)
    out: dict[str, tuple[list[int], str, object]] = {r.request_id: ([], "", None) for r in requests}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            tokens, text, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.token_ids, text + o.text, o.stats if o.finished else None)
            if o.finished and o.request_id in constrained:
                assert o.finish_reason == "stop", "the grammar completes well within max_tokens"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "eagle", "auto"])
def test_greedy_constrained_output_is_identical_with_speculation_and_validates(
    tiny_engine_factory, prompt_ids, method
):
    grammar = json_grammar(SCHEMA)

    def reqs(m: str) -> list[GenerationRequest]:
        return [
            GenerationRequest(f"c{i}", tuple(p), SamplingParams(max_tokens=64, temperature=0.0),
                              SpeculationParams(m, 4), grammar)
            for i, p in enumerate(prompt_ids[:3])
        ]

    plain = run_constrained(tiny_engine_factory(), reqs("none"))
    spec = run_constrained(tiny_engine_factory(), reqs(method))
    for rid, (tokens, text, _) in plain.items():
        jsonschema.validate(json.loads(text), SCHEMA)
        assert spec[rid][0] == tokens, f"{method}: constrained greedy output changed under speculation"
        assert spec[rid][1] == text
    if method != "draft" and method != "eagle":  # model proposers keep their own drafts (their caches hold them)
        forced = [s.by_proposer.get(FORCED) for _, _, s in spec.values()]
        assert all(f is not None and f.accepted_tokens > 0 for f in forced), "keys the schema forces are drafted"


@pytest.mark.slow
def test_constrained_and_free_rows_share_a_batch(tiny_engine_factory, prompt_ids):
    """A constrained row changes nothing for its neighbours, and is itself what it is alone."""
    grammar = json_grammar(SCHEMA)
    free = [request(f"f{i}", p, "ngram", max_tokens=12) for i, p in enumerate(prompt_ids)]
    constrained = GenerationRequest("c", tuple(prompt_ids[0]), SamplingParams(max_tokens=64, temperature=0.0),
                                    SpeculationParams("auto", 4), grammar)
    alone = run_constrained(tiny_engine_factory(), [constrained])
    free_alone = run_constrained(tiny_engine_factory(), free)
    together = run_constrained(tiny_engine_factory(), [*free, constrained])
    assert together["c"][0] == alone["c"][0]
    for r in free:
        assert together[r.request_id][0] == free_alone[r.request_id][0]


@pytest.mark.slow
def test_min_tokens_never_leaves_a_complete_grammar_without_a_token(tiny_engine_factory, prompt_ids):
    """The grammar allows only EOS once the JSON is complete; min_tokens cannot forbid it (p stays a
    distribution) and the request ends with the valid JSON."""
    grammar = json_grammar({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                            "additionalProperties": False})
    req = GenerationRequest("m", tuple(prompt_ids[1]), SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                            min_tokens=30), SpeculationParams("auto", 4), grammar)
    (tokens, text, _), = run_constrained(tiny_engine_factory(), [req]).values()
    assert json.loads(text) in ({"ok": True}, {"ok": False})


@pytest.mark.slow
def test_masks_leave_the_grammar_where_it_was_even_after_an_eos_draft(tokenizer):
    """Verify positions are scored by walking the grammar through the drafts and back; a draft that
    ends with EOS (n-gram and suffix drafts copy it from earlier outputs) must not shift the state."""
    eos = tokenizer.eos_token_id
    state = Grammars(tokenizer, len(tokenizer), {eos}).state(json_grammar(SCHEMA))
    text = tokenizer.encode('{"color": "red", "count": 7, "ok": true, "name": "ab"}', add_special_tokens=False)
    masks = state.masks([*text, eos])
    assert masks.shape == (len(text) + 2, len(tokenizer))
    assert all(bool(masks[j, t]) for j, t in enumerate(text)) and bool(masks[len(text), eos])
    assert int(masks[0].sum()) < len(tokenizer) // 100, "the first position allows only JSON openers"
    assert state.valid_prefix(text) == len(text), "the grammar is back at the start"
    assert state.advance(text[:5]) and state.valid_prefix(text[5:]) == len(text) - 5
    assert state.masks([99999 % len(tokenizer)])[1].all(), "after a forbidden draft: never reached, all allowed"


def test_masks_are_the_same_with_or_without_llguidances_slicer(tokenizer):
    """The slicer (precomputed token subsets, on by default, off for a CPU engine: grammar.py) only makes masks
    cheaper: every position of a schema with free strings allows exactly the same tokens either way."""
    eos = tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"bio": {"type": "string"}, "tags": {"type": "array", "items":
              {"type": "string"}}}, "required": ["bio", "tags"], "additionalProperties": False}
    text = tokenizer.encode('{"bio": "An English writer, known for \\"notes\\" on the Engine.", "tags": ["a b", ""]}',
                            add_special_tokens=False)
    states = [Grammars(tokenizer, len(tokenizer), {eos}, slicer=slicer).state(json_grammar(schema))
              for slicer in (True, False)]
    assert states[0].valid_prefix(text) == len(text)
    assert torch.equal(states[0].masks([*text, eos]), states[1].masks([*text, eos]))


# ---- the planner's rule for drafts the grammar forbids ------------------------------------------------
class Grammar:
    """The planner's view of a grammar that allows the first `valid` drafts and forces `forced`."""

    def __init__(self, valid: int, forced: list[int] | None = None) -> None:
        self.valid, self._forced = valid, forced or []

    def valid_prefix(self, drafts: list[int]) -> int:
        return min(self.valid, len(drafts))

    def forced(self, limit: int) -> list[int]:
        return self._forced[:limit]


class Seq:
    def __init__(self, grammar: Grammar, method: str = "auto") -> None:
        self.grammar, self.method, self.k_max = grammar, method, 4


def constrain(row: RowPlan, seq: Seq, lookahead: bool = True) -> RowPlan:
    planner = planner_module.Planner.__new__(planner_module.Planner)
    planner.proposers = {"p": type("P", (), {"traits": type("T", (), {"lookahead": lookahead})()})()}
    return planner._constrain(seq, row)


def test_a_compared_draft_is_cut_before_the_forbidden_token_and_a_ratio_one_after_it():
    q = torch.full((4, 8), 1 / 8)
    cut = constrain(RowPlan("p", [1, 2, 3, 4]), Seq(Grammar(2)))
    assert cut.drafts == [1, 2] and cut.own_drafts == [1, 2, 3, 4]
    kept = constrain(RowPlan("p", [1, 2, 3, 4], Rule.RATIO, q), Seq(Grammar(2)), lookahead=False)
    assert kept.drafts == [1, 2, 3] and kept.q.shape[0] == 3 and kept.own_drafts == [1, 2, 3, 4]


def test_forced_tokens_replace_shorter_lookahead_drafts_but_never_a_model_proposers():
    assert constrain(RowPlan(None, []), Seq(Grammar(0, [7, 8]))) == RowPlan(FORCED, [7, 8])
    assert constrain(RowPlan("p", [5]), Seq(Grammar(1, [7, 8]))).drafts == [7, 8]
    assert constrain(RowPlan("p", [5, 6, 9]), Seq(Grammar(3, [7, 8]))).drafts == [5, 6, 9]
    model_row = constrain(RowPlan("p", [5], Rule.RATIO, torch.ones(1, 8) / 8), Seq(Grammar(1, [7, 8])),
                          lookahead=False)
    assert model_row.drafts == [5]
    assert constrain(RowPlan(None, []), Seq(Grammar(0, [7, 8]), method="none")).drafts == []


# ---- the constrained distribution -------------------------------------------------------------------
DIGITS = list(range(32, 42))  # '0'..'9' in SmolLM2's vocabulary (single-character tokens)
LETTERS = list(range(49, 64))  # 'A'..'O'
ALTERNATING = r"([0-9][A-O]|[A-O][0-9])[0-9A-O]*"  # the second token's set depends on the first


def exact_constrained_marginals(target) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x1), p(x2) under the target with the ALTERNATING grammar's masks."""

    def masked(logits: torch.Tensor, allowed: list[int]) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[..., allowed] = 0
        return torch.softmax(logits + keep, -1)

    with torch.no_grad():
        first = masked(target(input_ids=torch.tensor([PROMPT])).logits[0, -1], DIGITS + LETTERS)
        second = torch.zeros(VOCAB)
        for x1 in DIGITS + LETTERS:
            logits = target(input_ids=torch.tensor([[*PROMPT, x1]])).logits[0, -1]
            second += first[x1] * masked(logits, LETTERS if x1 in DIGITS else DIGITS)
    return first, second


def constrained_counts(pair, method: str) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: F811
    target, draft, head_dir = pair
    engine = Engine(target, draft, Settings.load(max_batch_size=256, draft_head=str(head_dir)))
    grammar = llguidance.LLMatcher.grammar_from_regex(ALTERNATING)
    return first_two_token_counts(
        engine, PROMPT, method, lambda i: SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True),
        grammar,
    )


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    support = expected_probs > 0
    assert observed[~support].sum() == 0, "a token the grammar forbids was sampled"
    expected = expected_probs[support] / expected_probs[support].sum() * observed.sum()
    return float(chisquare(observed[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "draft", "eagle"])
def test_constrained_sampling_matches_the_constrained_target_distribution(pair, method):  # noqa: F811
    first, second = exact_constrained_marginals(pair[0].model)
    c1, c2 = constrained_counts(pair, method)
    assert chi_square_p(c1, first) > P_VALUE
    assert chi_square_p(c2, second) > P_VALUE


@pytest.mark.slow
def test_cutting_a_sampled_draft_before_its_forbidden_token_is_caught(pair, monkeypatch):  # noqa: F811
    """Negative control: cut the draft model's ratio-rule drafts like compared ones (before the first
    forbidden token, so that position is drawn from p instead of the residual): the test sees it."""
    original = planner_module.Planner._constrain

    def wrong(self, seq, row):
        if row.rule is Rule.RATIO:
            row = row.cut(seq.grammar.valid_prefix(row.drafts))
        return original(self, seq, row)

    monkeypatch.setattr(planner_module.Planner, "_constrain", wrong)
    first, second = exact_constrained_marginals(pair[0].model)
    c1, c2 = constrained_counts(pair, "draft")
    assert min(chi_square_p(c1, first), chi_square_p(c2, second)) < P_VALUE
