"""What proposers that run a model of their own share (a draft model, a draft head): a batched KV
cache entered lazily (starting from keys and values the prefix cache kept of an earlier sequence's
prompt, when it has them), the rows' order, the draft distribution q and one draft token per row."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from server.model.memory import tensor_bytes
from server.model.prefix_cache import State
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, probabilities, sample
from server.speculation.plan import Rule
from server.speculation.proposer import Proposal, Proposer, SequenceView
from server.types import SamplingParams

_IDLE = SamplingParams(temperature=0.0)  # what rows that draft nothing this step are "sampled" with (q unused)


@dataclasses.dataclass(frozen=True)
class DraftRows:
    """A propose call in the proposer's cache-row order: every cached row is asked each step (the
    planner guarantees it), with K = 0 where it drafts nothing."""

    seqs: list[SequenceView]
    ks: list[int]
    sampling: BatchSampling  # the requests' sampling, penalties off (q need only be a distribution)
    rules: list[Rule]  # per row, how the sampler will judge its drafts (`SequenceView.rule`)
    coupled: list[torch.Generator | None]  # a copy of a compared sampled row's random stream (`_coupled`)


class ModelProposer(Proposer):
    """Base of model proposers. Subclasses set `runner` and `vocab_size` (the target's logits width:
    q is over the target's ids) and implement `_start` (bring rows into the cache) and `propose`."""

    runner: ModelRunner
    vocab_size: int
    forwards: int = 0  # forwards of the proposer's model so far (tests and the bench read it)
    pending: dict[str, Any]  # per request: what the cache has not been fed yet (the subclass's shape)
    _drafted_last: set[str]  # requests whose last committed step drafted with it (`backlog`; set in __init__)
    # Per block, keys and values of a prompt prefix computed for an earlier sequence (the prefix cache's
    # own tensors: nothing is copied until the row enters the cache).
    _loaded: dict[str, list[State]]
    # How many tokens past its own position a cache position depends on (the head's pair at position t
    # holds token t + 1): the prefix cache's block b then holds positions [b B - reads_ahead, (b + 1) B - reads_ahead).
    reads_ahead: int = 0
    caches_prefix = True

    # ---- memory (proposer.py) ----------------------------------------------------------------------
    def weight_tensors(self) -> list[torch.Tensor]:
        return self.runner.weight_tensors()

    def release_dense(self) -> int:
        """Drop the dense weights its packed kernels replace, for a server's proposer (`ModelRunner.release_dense`);
        bytes dropped."""
        return self.runner.release_dense()

    def cache_bytes(self, seen: set[tuple[str, int]]) -> int:
        return tensor_bytes(self.runner.kv.storage(), seen)

    # ---- checkpoints (a failed step is undone: proposer.py) -----------------------------------------
    def checkpoint(self) -> object:
        return self.runner.kv.checkpoint(), self._copy_pending(self.pending), self.forwards, dict(self._loaded)

    def restore(self, state: object) -> None:
        kv, pending, forwards, loaded = state  # type: ignore[misc]
        self.runner.kv.restore(kv)
        self.pending, self.forwards, self._loaded = self._copy_pending(pending), forwards, dict(loaded)

    # ---- the prefix cache (proposer.py: `prefix_state`, `load_prefix`) --------------------------------
    def prefix_state(self, request_id: str, blocks: int, block: int) -> list[State]:
        """Keys and values of the row's first `blocks` blocks that its cache holds, one pair per block:
        block b's positions are those its tokens and the earlier blocks' determine (`reads_ahead`)."""
        if request_id not in self.runner.rows:
            return []
        n = min(blocks, (self.runner.cached(request_id) + self.reads_ahead) // block)
        if n == 0:
            return []
        keys, values = self.runner.live(request_id)(0, n * block - self.reads_ahead)
        cuts = [0, *(b * block - self.reads_ahead for b in range(1, n + 1))]
        return [(keys[:, :, a:z].clone(), values[:, :, a:z].clone()) for a, z in itertools.pairwise(cuts)]

    def load_prefix(self, request_id: str, states: list[State]) -> None:
        """The row enters the cache with these positions loaded instead of computed (`_entering`)."""
        self._loaded[request_id] = states
        self._skip(request_id, sum(s[0].shape[2] for s in states))

    def _skip(self, request_id: str, positions: int) -> None:
        """Drop from `pending` what the row's first `positions` cache positions would have been fed."""

    def _entering(self, request_ids: list[str]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """The loaded prefixes of rows entering the cache now, keys and values (for `ModelRunner.join`)."""
        states = [self._loaded.pop(rid, None) for rid in request_ids]
        return [(torch.cat([b[0] for b in s], dim=2), torch.cat([b[1] for b in s], dim=2)) if s else None
                for s in states]

    @staticmethod
    def _copy_pending(pending: dict[str, Any]) -> dict[str, Any]:
        """A copy of `pending` that `propose` cannot change through (the subclass knows its shape)."""
        raise NotImplementedError

    def _pending_count(self, request_id: str) -> int:
        """How many tokens (or pairs) `pending` holds for the request."""
        raise NotImplementedError

    def _committed(self, request_id: str, drafted: bool) -> None:
        """Subclasses' `commit` calls this: whether the row drafted with this proposer at this step."""
        if drafted:
            self._drafted_last.add(request_id)
        else:
            self._drafted_last.discard(request_id)

    def _forget(self, request_ids: set[str]) -> None:
        """Subclasses' `leave` calls this."""
        self._drafted_last.difference_update(request_ids)
        for rid in request_ids:
            self._loaded.pop(rid, None)

    def backlog(self, request_ids: list[str]) -> int:
        """The pending tokens of rows that did not draft with this proposer at their last step (entering
        rows: their whole context). A row that drafted then holds only that step's emitted tokens, which
        the first draft forward takes in anyway."""
        behind = [rid for rid in request_ids if rid not in self._drafted_last and rid in self.pending]
        return sum(self._pending_count(rid) for rid in behind)

    def _start(self, request_ids: list[str]) -> None:
        """Bring sequences that draft for the first time into the cache (lazily: a sequence that never
        drafts with this proposer never pays for it)."""
        raise NotImplementedError

    def _rows(self, seqs: list[SequenceView], ks: list[int]) -> DraftRows:
        by_id = {s.request_id: (s, k) for s, k in zip(seqs, ks, strict=True)}
        cached = set(self.runner.rows)
        starting = [s.request_id for s, k in zip(seqs, ks, strict=True) if k > 0 and s.request_id not in cached]
        if starting:
            self._start(starting)
        rows = [by_id[rid][0] for rid in self.runner.rows]
        # Rows that draft nothing this step are sampled with neutral params: their q is never used, and a
        # row held back after a failed step (engine/isolation.py) must not make its neighbours' drafting fail.
        params = [
            dataclasses.replace(s.sampling, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
            if by_id[s.request_id][1] > 0 else _IDLE
            for s in rows
        ]
        return DraftRows(
            seqs=rows,
            ks=[by_id[s.request_id][1] for s in rows],
            sampling=BatchSampling.from_params(params, self.runner.device),
            rules=[s.rule for s in rows],
            coupled=[_coupled(s) if by_id[s.request_id][1] > 0 else None for s in rows],
        )

    def _draw(
        self, logits: torch.Tensor, rows: DraftRows, drafting: list[bool]
    ) -> tuple[torch.Tensor, list[int | None]]:
        """q [rows, vocab] from the model's next-token logits [rows, model_vocab], and a draft token for
        each row that is `drafting`: for `Rule.RATIO` rows sampled from q with the request's own stream;
        for compared rows q's argmax (greedy: p is one-hot, so the argmax is the one draft that can be
        kept) or drawn from q with the uniform the sampler will draw p's token with at this position
        (`_coupled`), which leaves the request's stream alone."""
        q = probabilities(_to_width(logits, self.vocab_size)[:, None], rows.sampling)[:, 0]  # [rows, vocab]
        argmax = q.argmax(dim=-1).tolist()
        tokens = []
        for b in range(len(drafting)):
            coupled = rows.coupled[b]
            if not drafting[b]:
                tokens.append(None)
            elif coupled is not None:
                tokens.append(sample(q[b], coupled))
            else:
                tokens.append(argmax[b] if rows.rules[b] is Rule.COMPARE else sample(q[b], rows.seqs[b].generator))
        return q, tokens

    def _in_order(
        self, seqs: list[SequenceView], drafts: list[list[int]], q_rows: list[list[torch.Tensor]]
    ) -> Proposal:
        """From cache-row order to the caller's order (sequences not in the cache drafted nothing); q only
        for `Rule.RATIO` rows (the sampler compares the others' drafts)."""
        index = {rid: i for i, rid in enumerate(self.runner.rows)}
        out_drafts, out_q = [], []
        for s in seqs:
            i = index.get(s.request_id)
            out_drafts.append(drafts[i] if i is not None else [])
            ratio = i is not None and q_rows[i] and s.rule is Rule.RATIO
            out_q.append(torch.stack(q_rows[i]) if ratio else None)
        return Proposal(drafts=out_drafts, q=out_q)


def _coupled(seq: SequenceView) -> torch.Generator | None:
    """For a compared sampled row (seeded, under `auto`: `SequenceView.rule`), a copy of its random stream:
    the sampler draws this step's tokens from p with the stream's next uniforms, one per position by
    inverse CDF, and compares them with the drafts (rejection.py). Drafting position j from q with the
    same j-th uniform gives the token the sampler will draw whenever q and p agree about it, and the text
    stays exactly plain decoding's (the request's stream is only read ahead, not drawn from). Drafting the
    argmax instead would keep a draft only with probability p(argmax) (docs/bench.md, "Seeded sampled rows
    draft what the sampler will draw"). None for other rows."""
    if seq.rule is not Rule.COMPARE or seq.sampling.greedy:
        return None
    copy = torch.Generator(device=seq.generator.device)
    copy.set_state(seq.generator.get_state())
    return copy


def _to_width(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits [..., model_vocab] over the target's `vocab` ids: cut, or padded with -inf. Checkpoints
    that share a tokenizer may pad their embeddings differently (Qwen2.5 7B: 152064 rows, 0.5B:
    151936); tokens the target cannot score are never drafted."""
    width = logits.shape[-1]
    if width >= vocab:
        return logits[..., :vocab]
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))], dim=-1)
