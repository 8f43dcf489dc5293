"""Draft-model proposer: a smaller causal LM drafts K tokens autoregressively with its own KV cache.

Its cache holds every committed token except `pending[rid]` (tokens committed since it last fed:
the target's recovered/bonus token, and after a full accept also the last draft). Each step feeds
pending + d_1..d_{k-1}; after verification the rejected drafts are rolled back in its KV cache.
"""

from __future__ import annotations

import dataclasses

import torch

from server.model.loading import LoadedModel
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, probabilities, sample
from server.speculation.proposer import BuildContext, Proposal, Proposer, SequenceView, Traits


class DraftModelProposer(Proposer):
    # Its cost is timed (a model forward per draft token); a bf16 copy of the target accepts ~0.6+.
    traits = Traits(deterministic=False, confidence_priors=(0.6,))

    @classmethod
    def build(cls, ctx: BuildContext) -> DraftModelProposer | None:
        return cls(ctx.draft, ctx.vocab_size) if ctx.draft is not None else None

    def __init__(self, draft: LoadedModel, vocab_size: int) -> None:
        """`vocab_size`: the target's logits width. Checkpoints that share a tokenizer may pad their
        embeddings differently (Qwen2.5 7B: 152064 rows, 0.5B: 151936); q is taken over the
        target's ids, so tokens the target cannot score are never drafted."""
        self.draft = draft
        self.vocab_size = vocab_size
        self.runner = ModelRunner(draft.model)
        self.forwards = 0  # draft-model forwards run so far (tests and the bench read it)
        self.pending: dict[str, list[int]] = {}

    def join(self, seqs: list[SequenceView], prompt_hidden: list[torch.Tensor] | None) -> None:
        """Nothing is computed yet: a sequence is prefilled into the draft cache the first time it
        asks for drafts (an `auto` sequence may never do so, and then never pays for it)."""
        for s in seqs:
            self.pending[s.request_id] = list(s.tokens)

    def _prefill(self, request_ids: list[str]) -> None:
        """Bring sequences into the draft cache: all their tokens but the last become cached."""
        self.runner.join(request_ids, [self.pending[rid][:-1] for rid in request_ids])
        self.forwards += 1
        for rid in request_ids:
            self.pending[rid] = self.pending[rid][-1:]

    def leave(self, request_ids: set[str]) -> None:
        self.runner.leave(request_ids)
        for rid in request_ids:
            self.pending.pop(rid, None)

    @torch.no_grad()
    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        by_id = {s.request_id: (s, k) for s, k in zip(seqs, ks, strict=True)}
        cached = set(self.runner.rows)
        starting = [s.request_id for s, k in zip(seqs, ks, strict=True) if k > 0 and s.request_id not in cached]
        if starting:
            self._prefill(starting)
        rows = self.runner.rows  # every cached row is asked each step (the engine guarantees it)
        row_k = [by_id[rid][1] for rid in rows]
        k_max = max(row_k, default=0)
        vocab = self.vocab_size
        drafts: list[list[int]] = [[] for _ in rows]
        device = self.runner.device
        q = torch.zeros(len(rows), max(k_max, 1), vocab, device=device)  # [rows, K, vocab]
        if k_max == 0:
            return self._in_order(seqs, drafts, q[:, :0])
        params = [dataclasses.replace(by_id[rid][0].sampling, presence_penalty=0.0, frequency_penalty=0.0,
                                      repetition_penalty=1.0) for rid in rows]
        sampling = BatchSampling.from_params(params, device)
        gens = [by_id[rid][0].generator for rid in rows]
        greedy = [p.greedy for p in params]

        feed = [self.pending[rid] if k > 0 else [] for rid, k in zip(rows, row_k, strict=True)]
        for j in range(k_max):
            logits = self.runner.forward(feed).logits  # [rows, W, vocab]
            self.forwards += 1
            last = torch.tensor([max(len(f) - 1, 0) for f in feed], device=device)
            step_logits = _to_width(logits[torch.arange(len(rows), device=device), last][:, None], vocab)
            probs = probabilities(step_logits, sampling)[:, 0]  # [rows, vocab]
            q[:, j] = probs  # rows that fed nothing keep garbage here, past their own k
            greedy_tokens = probs.argmax(dim=-1).tolist()  # one-hot rows: no randomness needed
            for b in range(len(rows)):
                if feed[b]:
                    drafts[b].append(greedy_tokens[b] if greedy[b] else sample(probs[b], gens[b]))
            # The last draft token is sampled but not fed: the target's verdict decides what follows.
            feed = [[d[-1]] if len(d) < k else [] for d, k in zip(drafts, row_k, strict=True)]
            if not any(feed):
                break
        for rid, k in zip(rows, row_k, strict=True):
            if k > 0:
                self.pending[rid] = []  # fed: now in the draft cache
        return self._in_order(seqs, drafts, q[:, :k_max])

    def _in_order(self, seqs: list[SequenceView], drafts: list[list[int]], q: torch.Tensor) -> Proposal:
        """Reorder from this proposer's cache rows to the caller's sequence order (sequences not in
        the cache drafted nothing); each row's q is cut to its own drafts."""
        rows = {rid: i for i, rid in enumerate(self.runner.rows)}
        out_drafts = [drafts[rows[s.request_id]] if s.request_id in rows else [] for s in seqs]
        return Proposal(
            drafts=out_drafts,
            q=[q[rows[s.request_id], : len(d)] if d else None for s, d in zip(seqs, out_drafts, strict=True)],
        )

    def commit(self, seq: SequenceView, drafts: list[int], emitted: list[int], hidden: torch.Tensor | None) -> None:
        rid = seq.request_id
        accepted = len(emitted) - 1
        if not drafts:  # it drafted nothing this step (or is not in the cache yet): catch up later
            self.pending[rid] += emitted
            return
        # The cache now holds d_1..d_{k-1}; keep the accepted ones, roll back the rest.
        in_cache = len(drafts) - 1
        kept = min(accepted, in_cache)
        self.runner.rollback(self.runner.kv.index(rid), in_cache - kept)
        self.pending[rid] = emitted[kept:]  # [x] after a rejection; [d_k, bonus] after a full accept


def _to_width(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [..., draft_vocab] over the target's `vocab` ids: cut, or padded with -inf."""
    width = logits.shape[-1]
    if width >= vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
