"""The engine's state for one sequence in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from server.engine.detokenizer import IncrementalDetokenizer
from server.grammar import GrammarState
from server.types import FinishReason, GenerationRequest, RequestStats, SamplingParams


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
    # proposer reads them (engine.py `_remember`); None otherwise.
    features: list[torch.Tensor] | None = None
    # Prompt tokens the target has not computed yet (between the cached or prefilled ones and the last): a
    # short prompt tail rides with the row's first step, fed before `last_token` in its verify pass
    # (engine.py `_join`), and is cleared when that step commits.
    prefill: list[int] = field(default_factory=list)
    # Token ids that end the request when it emits one: its `stop_token_ids`, and the model's EOS ids
    # unless `ignore_eos` (engine.py `_sequence`).
    stop_ids: frozenset[int] = frozenset()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def mode(self) -> str:
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
        """The row's next step also computes prompt tokens: the target has no features of them yet."""
        return bool(self.prefill)

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
    def reproducible(self) -> bool:
        """Seeded sampling: the same seed must draw the same text."""
        return self.sampled and self.request.sampling.seed is not None

    @property
    def one_hot_drafts(self) -> bool:
        """Seeded sampling under `auto`: a model proposer hands the sampler no q and takes nothing from the
        request's random stream (it drafts with a copy of it: model_proposer.py `_coupled`), so the
        sampler draws every token as plain decoding would and only compares
        (server/speculation/rejection.py). The text then cannot depend on which proposer `auto` picked,
        which follows measured timings. A fixed method keeps sampled drafts: its seeded text reproduces
        for the same method and K."""
        return self.reproducible and self.mode == "auto"

    def num_drafts(self) -> int:
        """The most drafts this step may carry: the request's K, but never drafting past max_tokens."""
        return max(0, min(self.request.speculation.k, self.remaining - 1))
