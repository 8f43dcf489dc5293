"""The contract every proposer implements, and what a proposer says about itself.

A proposer drafts tokens for the sequences that use it; the target verifies them (docs/design.md).
The planner (`planner.py`) is the only caller. Per sequence, in order:

1. `join(seqs, prompt_hidden)`: once, when the row enters the target's batch. `prompt_hidden[i]` holds
   the target's hidden states of seqs[i]'s prompt tokens computed so far (the prompt's first m, m <= all
   but the last: those its prefix-cache blocks held, stored with their features:
   server/model/prefix_cache.py), when the proposer's traits ask for them (`needs_hidden`), else None. The
   rest of the prompt (but the last token) is computed in chunks by the following steps' passes, as the
   step's token budget allows (server/speculation/budget.py): each chunk's features come to such a
   proposer as `prefilled(seq, start, hidden)`, the features of prompt positions start.., in order, except
   the last chunk's, which come with the row's first `commit` (the step that computes it also verifies the
   row's last prompt token, and drafts). A proposer that needs hidden states is not asked to draft for the
   row before that step commits. Right after `join`, a proposer that `caches_prefix` gets
   `load_prefix(request_id, states)` for a sequence whose prompt starts with prefix-cache blocks that hold
   its state (one per block, as its `prefix_state` gave them for an earlier sequence).
2. Each step, `propose(seqs, ks)`: up to ks[i] draft tokens for seqs[i] (ks[i] may be 0: the row
   drafts nothing this step but is still asked, so a batched proposer's rows stay aligned).
3. After verification, `commit(seq, drafts, emitted, hidden)`: `drafts` are the tokens this proposer
   offered for seq this step ([] when another proposer drafted or none did), `emitted` the accepted
   prefix of them plus the recovered or bonus token. `hidden` (when asked for) holds the target's hidden
   states of the fed tokens that are now committed: the step's first fed token (the sequence's last
   token before the step) and the accepted drafts, [len(emitted), hidden], after those of the prompt
   tokens this step computed, if any (the prompt's last chunk, its t tokens before the last one:
   [t + len(emitted), hidden]). Called before the tokens are appended to seq (a stop may drop some of them
   from the output afterwards).
4. `leave(request_ids)`: finished or aborted. Just before, a proposer that `caches_prefix` is asked
   `prefix_state(request_id, blocks, block)`: what it computed of the sequence's first `blocks` blocks of
   `block` tokens, one state per block (tensors of its own; fewer when it computed fewer), which the
   prefix cache keeps beside the target's keys and values for later sequences that start the same way.
   A state must be a function of the block's tokens and those before it only.

`backlog(request_ids)`, asked before `propose` by the planner when it times a proposer: how many tokens
of those sequences its model must take in before it can draft for them beyond what one step of drafting
leaves behind (a row entering its cache, or one back after steps it did not draft: a prefill, timed as
drafting it would price the proposer at several times its cost per draft token).

A step that fails is undone (server/engine/isolation.py): the planner takes every proposer's `checkpoint()`
before planning, and `restore(state)` returns the proposer to it (then the step is planned again, with
the rows that failed held back: asked with K = 0). A proposer whose `propose` changes nothing that
`restore` must undo keeps the defaults.

Hidden states are the output of the target's base model after its final norm (what its LM head reads),
so hidden row i predicts the token after fed token i.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from server.config import Settings
from server.model.loading import LoadedModel
from server.model.prefix_cache import State
from server.speculation.plan import Rule
from server.types import SamplingParams


class SequenceView(Protocol):
    """What a proposer may read of a sequence in flight (the engine's `Sequence` satisfies it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def tokens(self) -> list[int]: ...  # prompt plus committed output
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator: ...  # the request's own random stream
    @property
    def cache_salt(self) -> str | None: ...  # requests share cross-request state only with the same salt
    @property
    def rule(self) -> Rule: ...  # how the sampler judges a model's drafts for it (plan.py; engine/sequence.py)


@dataclass(frozen=True)
class Traits:
    """What a proposer says about itself; `auto` and the planner work from this alone.

    lookahead: proposing is nearly free and prefix-consistent (asking for k and keeping j equals asking
        for j), so the planner asks it for every row's most drafts before planning, and `auto` knows
        whether it has anything to offer and how confident it is. Its drafts have no q (one-hot): the
        sampler compares them (`plan.Rule.COMPARE`). A proposer that is not lookahead runs a model: its
        drafts come with q for the rows whose `rule` is `Rule.RATIO`, and without for the others.
    needs_hidden: it reads the target's hidden states (join/commit receive them).
    draft_token_cost: its cost per draft token relative to a plain target step, when declared; None
        means the planner times its `propose` calls (a model's forward).
    confidence_priors: expected acceptance of its first draft before any evidence, per confidence level
        (`Proposal.confidence` indexes this tuple; one level when the proposer reports none).
    """

    lookahead: bool = False
    needs_hidden: bool = False
    draft_token_cost: float | None = None
    confidence_priors: tuple[float, ...] = (0.5,)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for a list of sequences, in the order they were asked for.

    Example: an n-gram lookup that found "b c d" after a 12-token match for seq 0 and nothing for seq 1
    returns drafts=[[b, c, d], []], q=None, confidence=[3, 0] (level 3 = a match of 8 tokens or more).
    """

    drafts: list[list[int]]  # up to k_i tokens per sequence (fewer when it has nothing to offer)
    q: list[torch.Tensor | None] | None = None  # per sequence [k_i, vocab] for `Rule.RATIO` rows; else None
    confidence: list[int] | None = None  # per sequence: an index into `Traits.confidence_priors`


class Proposer(ABC):
    """One way of drafting. Subclasses set `traits` and implement `propose`."""

    traits: Traits
    caches_prefix: bool = False  # has a state of prompt prefixes worth keeping (`prefix_state`, `load_prefix`)
    # a reader of the target's features (`Traits.needs_hidden`) that rounds them to this dtype before anything
    # else (None: reads them as computed): the prefix cache may keep them in it, no bit of what it drafts changed
    feature_dtype: torch.dtype | None = None

    def join(self, seqs: list[SequenceView], prompt_hidden: list[torch.Tensor] | None) -> None:  # noqa: B027
        """Sequences that start using this proposer (see the module docstring)."""

    def leave(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Sequences that finished or were aborted."""

    def prefix_state(self, request_id: str, blocks: int, block: int) -> list[State]:
        """Its state of the sequence's first `blocks` blocks of `block` tokens, one per block (see the
        module docstring); [] when it computed none."""
        return []

    def load_prefix(self, request_id: str, states: list[State]) -> None:  # noqa: B027 - optional hook
        """A joined sequence's first len(states) blocks as `prefix_state` gave them for an earlier one."""

    def prefilled(self, seq: SequenceView, start: int, hidden: torch.Tensor) -> None:  # noqa: B027
        """A chunk of seq's prompt was computed: the target's features [n, hidden] of positions start..start +
        n - 1 (never the prompt's last chunk: see the module docstring). Called only on `needs_hidden`."""

    def backlog(self, request_ids: list[str]) -> int:
        """Tokens those sequences must feed before drafting beyond one step's worth (see the module
        docstring); 0 for a proposer without a model of its own."""
        return 0

    @abstractmethod
    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        """Up to ks[i] draft tokens for seqs[i]."""

    def commit(  # noqa: B027 - optional hook
        self, seq: SequenceView, drafts: list[int], emitted: list[int], hidden: torch.Tensor | None
    ) -> None:
        """What the target kept of this step (see the module docstring)."""

    def checkpoint(self) -> object:
        """The state a failed step's `propose` calls may have changed (None: propose changes nothing)."""
        return None

    def restore(self, state: object) -> None:  # noqa: B027 - optional hook
        """Return to `state` (from `checkpoint` before this step); it stays valid for another restore."""

    # ---- memory (the server's `specula_memory_bytes{part="proposers"}`: server/engine/memory.py) ----
    def weight_tensors(self) -> list[torch.Tensor]:
        """The weights of a model of its own (reordered copies included; tensors it shares with the target
        are counted once); none for a proposer without a model."""
        return []

    def cache_bytes(self, seen: set[tuple[str, int]]) -> int:
        """Bytes of what it keeps for rows or across requests (a KV cache, an index of earlier text); tensor
        storages in `seen` are counted already (server/model/memory.py `tensor_bytes`)."""
        return 0


@dataclass(frozen=True)
class BuildContext:
    """What a proposer may be built from: the loaded target, the configured draft model (if any), the
    settings, and the target's logits width (q is taken over the target's token ids)."""

    target: LoadedModel
    draft: LoadedModel | None  # the configured draft model, or None when the server has none
    settings: Settings
    vocab_size: int
