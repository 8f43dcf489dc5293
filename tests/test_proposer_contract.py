"""The proposer contract: a new proposer is one class plus one registry entry, and proposers that ask
for them receive the target's hidden states of exactly the committed tokens."""

from __future__ import annotations

import torch

from server.speculation.proposer import BuildContext, Proposal, Proposer, SequenceView, Traits
from server.speculation.registry import BUILTIN, Entry, Registry
from tests.engine_helpers import final_stats, request, run


class RepeatLast(Proposer):
    """Test-only: drafts the last token k times (right on runs like "a a a a", wrong elsewhere)."""

    traits = Traits(lookahead=True, draft_token_cost=0.001)

    @classmethod
    def build(cls, ctx: BuildContext) -> RepeatLast:
        return cls()

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        return Proposal(drafts=[[s.tokens[-1]] * k for s, k in zip(seqs, ks, strict=True)])


# Without `suffix`, whose lookups also land on repeated tokens: these tests switch n-gram off to see
# `auto` turn to the new proposer, and suffix would compete with it.
WITH_REPEAT = Registry(tuple(e for e in BUILTIN.entries if e.name != "suffix")).with_entry(
    Entry("repeat", RepeatLast, "repeat the last token")
)


def test_a_new_proposer_plugs_in_with_one_registry_entry(tiny_engine_factory, prompt_ids, greedy_reference):
    engine = tiny_engine_factory(registry=WITH_REPEAT)
    assert engine.limits.methods == ("none", "ngram", "draft", "repeat", "auto")
    stats = final_stats(engine, [request(f"r{i}", p, "repeat", 3) for i, p in enumerate(prompt_ids)])
    assert all(s.by_proposer["repeat"].draft_tokens > 0 for s in stats.values())
    methods = ["repeat", "auto", "ngram", "repeat", "none"]
    mixed = [request(f"r{i}", p, m, 4) for i, (p, m) in enumerate(zip(prompt_ids, methods, strict=True))]
    assert run(tiny_engine_factory(registry=WITH_REPEAT), mixed) == greedy_reference  # lossless, mixed batch too


def test_auto_weighs_a_new_proposer_from_its_traits_alone(tiny_engine_factory, tokenizer):
    """On a text that repeats one token, `auto` finds that the new proposer pays and uses it."""
    engine = tiny_engine_factory(registry=WITH_REPEAT, ngram_min=16, ngram_max=16)  # n-gram never matches
    prompt = tokenizer.encode("7 7 7 7 7 7 7 7 7 7 7 7")
    outputs = []
    engine.add_requests([request("r", prompt, "auto", 8, max_tokens=40)])
    steps = []
    while engine.has_unfinished():
        result = engine.step()
        steps += result.seq_stats
        outputs += result.outputs
    used = {s.proposer for s in steps}
    assert "repeat" in used
    sources = [src for o in outputs for src in o.sources]
    assert len(sources) == 40 and {s.origin for s in sources} <= {"accepted", "recovered", "bonus", "plain"}
    assert all(src.proposer == "repeat" for src in sources if src.origin == "accepted")


class HiddenRecorder(Proposer):
    """Test-only: drafts nothing useful, records the hidden states it is handed."""

    traits = Traits(lookahead=True, needs_hidden=True, draft_token_cost=0.001)

    def __init__(self) -> None:
        self.received: dict[str, list[torch.Tensor]] = {}

    @classmethod
    def build(cls, ctx: BuildContext) -> HiddenRecorder:
        return cls()

    def join(self, seqs: list[SequenceView], prompt_hidden: list[torch.Tensor] | None) -> None:
        assert prompt_hidden is not None
        for seq, hidden in zip(seqs, prompt_hidden, strict=True):
            self.received[seq.request_id] = [hidden]

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        return Proposal(drafts=[[s.tokens[-1]] * min(k, 2) for s, k in zip(seqs, ks, strict=True)])

    def commit(self, seq: SequenceView, drafts: list[int], emitted: list[int], hidden: torch.Tensor | None) -> None:
        assert hidden is not None and hidden.shape[0] >= len(emitted)  # more: prompt tokens the step computed
        self.received[seq.request_id].append(hidden)


def test_proposers_receive_the_hidden_states_of_exactly_the_committed_tokens(tiny_engine_factory, tiny_target,
                                                                               prompt_ids):
    """Join gives the prefilled prompt tokens' states, each commit those of the fed tokens the step
    committed (the first step's, those of a prompt tail it computed too); together, in order, they are a
    clean forward's final-norm states of every committed token but the newest (which no pass has fed yet)."""
    engine = tiny_engine_factory(registry=BUILTIN.with_entry(Entry("hidden", HiddenRecorder)))
    recorder = engine.proposer("hidden")
    out = run(engine, [request(f"r{i}", p, "hidden", 3, max_tokens=12) for i, p in enumerate(prompt_ids)])
    for i, prompt in enumerate(prompt_ids):
        tokens = prompt + out[f"r{i}"]
        got = torch.cat(recorder.received[f"r{i}"])
        with torch.no_grad():
            ids = torch.tensor([tokens[:-1]], device=tiny_target.device)
            clean = tiny_target.model.model(input_ids=ids).last_hidden_state[0]
        assert got.shape == clean.shape
        torch.testing.assert_close(got, clean, atol=1e-4, rtol=1e-4)
