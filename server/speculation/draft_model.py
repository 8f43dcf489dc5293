"""Draft-model proposer: a smaller causal LM drafts K tokens autoregressively with its own KV cache.

Its cache holds every committed token except `pending[rid]` (tokens committed since it last fed:
the target's recovered/bonus token, and after a full accept also the last draft). Each step feeds
pending + d_1..d_{k-1}; after verification the rejected drafts are rolled back in its KV cache.
"""

from __future__ import annotations

import torch

from server.model.loading import LoadedModel
from server.model.runner import ModelRunner
from server.speculation.model_proposer import ModelProposer
from server.speculation.proposer import BuildContext, Proposal, SequenceView, Traits


class DraftCannotRun(ValueError):
    """The draft model cannot run on this server (its dtype, weights or device): the server does not start."""


def check_runs(draft: LoadedModel, runner: ModelRunner) -> None:
    """Run the draft once as drafting runs it (a prefill, then a step and a 2-token pass over that cache) on a
    scratch cache of its runner's kind: a pairing whose draft cannot compute (a dtype its kernels or attention do
    not take on this device) raises `DraftCannotRun` here, at start-up, naming the draft, instead of failing safe
    at every step and leaving the method to draft nothing."""
    probe = ModelRunner(draft.model, kv_dtype=runner.kv_dtype)  # the same forward (shared kernels), its own cache
    try:
        probe.join(["probe"], [[0, 1, 2]])
        for feed in ([[1]], [[2, 3]]):
            logits = probe.forward(feed).logits
            if logits is None or not torch.isfinite(logits).all():
                raise FloatingPointError("its logits are not finite numbers")
    except Exception as exc:
        raise DraftCannotRun(
            f"draft model {draft.name!r} ({draft.weights} weights, computing in "
            f"{str(runner.dtype).removeprefix('torch.')}, on {draft.device}) cannot run here: "
            f"{type(exc).__name__}: {exc}; pick another --draft-dtype (auto serves it as a target would be)"
        ) from exc


class DraftModelProposer(ModelProposer):
    # Its cost is timed (a model forward per draft token); a bf16 copy of the target accepts ~0.6+.
    traits = Traits(confidence_priors=(0.6,))

    @classmethod
    def build(cls, ctx: BuildContext) -> DraftModelProposer | None:
        return cls(ctx.draft, ctx.vocab_size) if ctx.draft is not None else None

    def __init__(self, draft: LoadedModel, vocab_size: int) -> None:
        """`vocab_size`: the target's logits width (q is taken over the target's ids). Raises `DraftCannotRun`
        when the draft cannot run here (`check_runs`): a start-up error, not a method that fails at every step."""
        self.draft = draft
        self.vocab_size = vocab_size
        self.runner = ModelRunner(draft.model)
        check_runs(draft, self.runner)
        self.forwards = 0
        self.pending: dict[str, list[int]] = {}
        self._drafted_last = set()
        self._loaded = {}

    def join(self, seqs: list[SequenceView], prompt_hidden: list[torch.Tensor] | None) -> None:
        """Nothing is computed yet: a sequence is prefilled into the draft cache the first time it
        asks for drafts (an `auto` sequence may never do so, and then never pays for it)."""
        for s in seqs:
            self.pending[s.request_id] = list(s.tokens)

    def _start(self, request_ids: list[str]) -> None:
        """Prefill: all of a sequence's tokens but the last become cached (a prefix the prefix cache kept
        is loaded, the rest computed)."""
        self.runner.join(request_ids, [self.pending[rid][:-1] for rid in request_ids],
                         prefixes=self._entering(request_ids))
        self.forwards += 1
        for rid in request_ids:
            self.pending[rid] = self.pending[rid][-1:]

    @staticmethod
    def _copy_pending(pending: dict[str, list[int]]) -> dict[str, list[int]]:
        return {rid: list(tokens) for rid, tokens in pending.items()}

    def _pending_count(self, request_id: str) -> int:
        return len(self.pending[request_id])

    def leave(self, request_ids: set[str]) -> None:
        self.runner.leave(request_ids)
        self._forget(request_ids)
        for rid in request_ids:
            self.pending.pop(rid, None)

    @torch.no_grad()
    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        rows = self._rows(seqs, ks)
        ids = self.runner.rows
        drafts: list[list[int]] = [[] for _ in ids]
        q_rows: list[list[torch.Tensor]] = [[] for _ in ids]
        feed = [self.pending[rid] if k > 0 else [] for rid, k in zip(ids, rows.ks, strict=True)]
        while any(feed):
            logits = self.runner.forward(feed).logits  # [rows, W, model_vocab]
            self.forwards += 1
            last = torch.tensor([max(len(f) - 1, 0) for f in feed], device=logits.device)
            q, tokens = self._draw(logits[torch.arange(len(ids), device=logits.device), last], rows,
                                   [bool(f) for f in feed])
            for b, token in enumerate(tokens):
                if token is not None:
                    drafts[b].append(token)
                    q_rows[b].append(q[b])
            # The last draft token is sampled but not fed: the target's verdict decides what follows.
            feed = [[d[-1]] if len(d) < k else [] for d, k in zip(drafts, rows.ks, strict=True)]
        for rid, k in zip(ids, rows.ks, strict=True):
            if k > 0:
                self.pending[rid] = []  # fed: now in the draft cache
        return self._in_order(seqs, drafts, q_rows)

    def commit(self, seq: SequenceView, drafts: list[int], emitted: list[int], hidden: torch.Tensor | None) -> None:
        rid = seq.request_id
        accepted = len(emitted) - 1
        self._committed(rid, bool(drafts))
        if not drafts:  # it drafted nothing this step (or is not in the cache yet): catch up later
            self.pending[rid] += emitted
            return
        # The cache now holds d_1..d_{k-1}; keep the accepted ones, roll back the rest.
        in_cache = len(drafts) - 1
        kept = min(accepted, in_cache)
        self.runner.rollback(self.runner.kv.index(rid), in_cache - kept)
        self.pending[rid] = emitted[kept:]  # [x] after a rejection; [d_k, bonus] after a full accept
