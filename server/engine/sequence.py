"""The engine's state for one sequence in flight, and what committing one step does to it."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch

from server.engine.detokenizer import IncrementalDetokenizer
from server.grammar import Grammars, GrammarState
from server.speculation.plan import RowPlan, Rule
from server.speculation.registry import AUTO, PLAIN
from server.types import (
    Fallback,
    FinishReason,
    GenerationRequest,
    ProposerTally,
    RequestOutput,
    RequestStats,
    SamplingParams,
    SeqStepStats,
    TokenLogprob,
    TokenSource,
)


@dataclass
class Sequence:
    request: GenerationRequest
    generator: torch.Generator  # the request's own randomness (seeded when the request says so)
    detokenizer: IncrementalDetokenizer
    stats: RequestStats
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    grammar: GrammarState | None = None  # the request's grammar, after its committed output (constrained only)
    # The target's final-norm features of the fed tokens, in pieces, kept for the prefix cache when a
    # proposer reads them (admission.py `remember`); None otherwise.
    features: list[torch.Tensor] | None = None
    # Prompt tokens the target has not computed yet (between those computed or read from the prefix cache, and
    # the last): each step's pass computes a chunk of them as its token budget allows, the last chunk before
    # `last_token` in the row's first verify pass (server/speculation/budget.py); admission.py `prefilled`.
    prefill: list[int] = field(default_factory=list)
    # Token ids that end the request when it emits one: its `stop_token_ids`, and the model's EOS ids
    # unless `ignore_eos`.
    stop_ids: frozenset[int] = frozenset()

    @classmethod
    def start(
        cls, request: GenerationRequest, tokenizer: object, grammars: Grammars, eos_ids: set[int],
        device: torch.device, seeds: random.Random,
    ) -> Sequence:
        """A joining request's sequence: its random stream (its seed, else one from `seeds`), detokenizer,
        grammar, the token ids that end it, and its whole prompt but the last token still to compute."""
        sampling = request.sampling
        gen = torch.Generator(device=device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else seeds.randrange(2**63))
        k = 0 if request.speculation.method == PLAIN else request.speculation.num_tokens
        stats = RequestStats(method=request.speculation.method, prompt_tokens=len(request.prompt_token_ids),
                             accepted_per_position=[0] * k)
        detok = IncrementalDetokenizer.for_request(tokenizer, list(request.prompt_token_ids), sampling)
        grammar = grammars.state(request.grammar) if request.grammar is not None else None
        stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else frozenset(eos_ids))
        return cls(request=request, generator=gen, detokenizer=detok, stats=stats, grammar=grammar, stop_ids=stops,
                   prefill=list(request.prompt_token_ids[:-1]))  # nothing computed yet

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def method(self) -> str:
        """The request's speculation method: "none", a proposer's name, or "auto"."""
        return self.request.speculation.method

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def tokens(self) -> list[int]:
        """Prompt plus generated tokens."""
        return [*self.request.prompt_token_ids, *self.output_ids]

    @property
    def last_token(self) -> int:
        """The newest token: committed, but not yet fed to the target (each step feeds it first)."""
        return self.output_ids[-1] if self.output_ids else self.request.prompt_token_ids[-1]

    @property
    def prefilling(self) -> bool:
        """Some of the prompt is not computed yet: the target has no features of it yet."""
        return bool(self.prefill)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens (before the last) the target has not computed yet."""
        return len(self.prefill)

    @property
    def prompt_computed(self) -> int:
        """Prompt tokens (before the last) computed or read from the prefix cache so far."""
        return len(self.request.prompt_token_ids) - 1 - len(self.prefill)

    @property
    def remaining(self) -> int:
        return self.request.sampling.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampled(self) -> bool:
        """Temperature > 0 (not greedy)."""
        return not self.request.sampling.greedy

    @property
    def k_max(self) -> int:
        """The most drafts this step may carry: the request's K, never drafting past max_tokens."""
        if self.method == PLAIN:
            return 0
        return max(0, min(self.request.speculation.num_tokens, self.remaining - 1))

    @property
    def rule(self) -> Rule:
        """How the sampler judges a model's drafts for this row (server/speculation/plan.py). Compared for
        greedy rows (p is one-hot: the argmax is the one draft that can be kept, and comparing spares the
        ratio rule's work over q) and for seeded sampling under `auto`: its text must not depend on which
        proposer `auto` picked, which follows measured timings, so a model drafts with the uniforms the
        sampler will use and hands it no q. A fixed method keeps sampled drafts and the ratio rule: its
        seeded text reproduces for the same method and K."""
        seeded = self.sampled and self.request.sampling.seed is not None
        return Rule.COMPARE if not self.sampled or (seeded and self.method == AUTO) else Rule.RATIO

    # ---- committing one step ------------------------------------------------------------------------
    def fell_back(self, fallbacks: list[Fallback]) -> list[Fallback]:
        """Record the proposers this request lost to their failure (the planner's account of it, in order: this
        step's output reports them, `usage.speculation.fallbacks`); returns those not recorded before."""
        new = fallbacks[len(self.stats.fallbacks):]
        self.stats.fallbacks.extend(new)
        return new

    def commit(
        self, row: RowPlan, emitted: list[int], logprobs: list[TokenLogprob] | None
    ) -> tuple[RequestOutput, SeqStepStats]:
        """What the row's verified step emitted (accepted drafts, then the recovered or bonus token): its
        stats, the grammar followed, the tokens appended until a stop, and the step's output."""
        accepted = len(emitted) - 1
        sources = self._sources(row, accepted)
        self._record(row, accepted)
        step = SeqStepStats(self.request_id, self.method, row.proposer or "none", row.k, accepted, len(emitted),
                            row.k > 0 and accepted == row.k)
        if self.grammar is not None:
            emitted = self._follow_grammar(emitted)
        kept = self._append(emitted)
        logprobs = logprobs[:kept] if logprobs is not None else None
        return self._output(emitted[:kept], logprobs, sources[:kept]), step

    def _sources(self, row: RowPlan, accepted: int) -> list[TokenSource]:
        """Where each of a step's accepted + 1 emitted tokens came from."""
        step = self.stats.decode_steps
        if not row.drafts:
            return [TokenSource("plain", None, step)]
        last = "bonus" if accepted == row.k else "recovered"
        return [TokenSource("accepted", row.proposer, step)] * accepted + [TokenSource(last, row.proposer, step)]

    def _record(self, row: RowPlan, accepted: int) -> None:
        st = self.stats
        st.decode_steps += 1
        st.draft_tokens += row.k
        st.accepted_tokens += accepted
        for j in range(accepted):
            st.accepted_per_position[j] += 1
        if row.k:
            tally = st.by_proposer.setdefault(row.proposer, ProposerTally())
            tally.draft_tokens += row.k
            tally.accepted_tokens += accepted
            if accepted == row.k:
                st.bonus_tokens += 1
            else:
                st.recovered_tokens += 1

    def _follow_grammar(self, emitted: list[int]) -> list[int]:
        """Advance the grammar through the step's tokens. The output ends at the token that completes the
        grammar (finish "stop"); what the step drew after it is dropped, so the output is the one plain
        constrained decoding gives."""
        assert self.grammar is not None
        for i, token in enumerate(emitted):
            if not self.grammar.advance([token]):  # p was 0 outside the grammar: a limit hit, never a wrong draw
                raise self.grammar.failure()
            if self.grammar.done:
                if token not in self.stop_ids:  # complete: nothing but EOS could follow
                    self.finish_reason = "stop"
                return emitted[: i + 1]
        return emitted

    def _append(self, emitted: list[int]) -> int:
        """Commit tokens in order until a stop; how many reached the output (the rest are dropped)."""
        sp = self.request.sampling
        for i, token in enumerate(emitted):
            self.output_ids.append(token)
            if token in self.stop_ids:
                if sp.include_stop_str_in_output:
                    self.detokenizer.add(token)  # the stop token's text (none if skip_special_tokens)
                self.finish_reason = "stop"
                return i + 1
            self.detokenizer.add(token)
            if self.detokenizer.stopped:
                self.finish_reason = "stop"
                return i + 1
            if self.remaining <= 0:
                self.finish_reason = "length"
                return i + 1
        return len(emitted)

    def _output(self, tokens: list[int], logprobs: list[TokenLogprob] | None,
                sources: list[TokenSource]) -> RequestOutput:
        self.stats.completion_tokens = len(self.output_ids)
        stats = copy.copy(self.stats)
        stats.accepted_per_position = list(self.stats.accepted_per_position)
        stats.by_proposer = {name: copy.copy(t) for name, t in self.stats.by_proposer.items()}
        stats.fallbacks = list(self.stats.fallbacks)
        return RequestOutput(request_id=self.request_id, token_ids=tokens,
                             text=self.detokenizer.take(final=self.finished), logprobs=logprobs,
                             finished=self.finished, finish_reason=self.finish_reason, stats=stats, sources=sources)
