"""The interface every proposer implements (draft model, n-gram; later EAGLE/Medusa-style heads).

A proposer is told when sequences join and leave, asked for up to k_i draft tokens per sequence
each step, and told what the target accepted so it can resynchronise its own state. Proposers that
need the target's last hidden states can be added by extending `propose`'s inputs; the engine owns
the target forward and would pass them along.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from server.engine.sequence import Sequence


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for a list of sequences, in the order they were asked for."""

    drafts: list[list[int]]  # up to k_i tokens per sequence (fewer when it has nothing to offer)
    probs: torch.Tensor | None  # q: [n, K, vocab] for model proposers; None = deterministic (one-hot q)
    match_lengths: list[int] | None = None  # n-gram proposers: tokens of context each draft's source matched


class Proposer(ABC):
    method: str

    def join(self, seqs: list[Sequence]) -> None:  # noqa: B027 - optional hook
        """Sequences that start using this proposer (called once, before their first step)."""

    def leave(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Sequences that finished or were aborted."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        """Up to ks[i] draft tokens for seqs[i]."""

    def commit(self, seq: Sequence, drafts: list[int], emitted: list[int]) -> None:  # noqa: B027
        """After verification: `emitted` = the accepted prefix of `drafts` plus the recovered/bonus
        token. Called before the tokens are appended to `seq` (stop truncation may drop some after)."""
