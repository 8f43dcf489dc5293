"""EAGLE-style proposer: a one-layer draft head that drafts from the target's own hidden states.

The head (server/draft_head/model.py) reads pairs (f_t, x_{t+1}): the target's final-norm hidden
state at position t and the token after it, and predicts f_{t+1}, whose LM-head logits (over the
head's frequent-token vocabulary; q = 0 elsewhere) give the next draft token. Its one decoder layer
has its own batched KV cache, driven by a `ModelRunner` like any model.

The head's cache holds pairs built from *real* target features only. Per sequence, the pairs not
yet fed wait in `pending` (features [m, hidden] and their next tokens): at join those of the prompt's
cached prefix, with each chunk of the prompt the target computes those of the chunk (`prefilled`: taken
in at once, so the head's cache keeps up with a long prompt and its first draft has no backlog of it),
after each step those of the committed tokens (the hidden states `commit` receives, paired with the
emitted tokens). Drafting k tokens feeds the pending pairs, then k - 1 pairs made of the head's own
predicted features and its drafts; after verification those k - 1 are rolled back, and the accepted
tokens come back as pending pairs with the target's real features (EAGLE's feature correction).
The cache is filled lazily: a sequence that never drafts with the head never pays for it.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from server.draft_head.model import EagleHead
from server.model.attention import use_gqa_attention
from server.model.lean_forward import PackedLinear, linear_kernel, packs_linears
from server.model.memory import tensor_bytes
from server.model.runner import ModelRunner
from server.speculation.model_proposer import ModelProposer
from server.speculation.proposer import BuildContext, Proposal, SequenceView, Traits

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    """Pairs (feature, next token) not yet in the head's cache."""

    features: list[torch.Tensor]  # pieces [n_i, hidden]
    tokens: list[int]  # one per feature row

    def take(self) -> tuple[torch.Tensor | None, list[int]]:
        feats = torch.cat(self.features) if self.features else None
        tokens, self.features, self.tokens = self.tokens, [], []
        return feats, tokens


def measured_prior(head: EagleHead) -> float | None:
    """The head's greedy first-draft acceptance on held-out prompts, as `distill` measured it after
    training (`training.heldout_acceptance[0]`), or None when the head records none. `auto` starts
    from it, so a weak head is not tried as if it were a good one, nor a good one left untried (the
    CPU-trained head: 0.39, the GPU-distilled one shipped now: 0.59; 0.6 was assumed for any head)."""
    measured = head.config.training.get("heldout_acceptance") or []
    first = measured[0] if isinstance(measured, list) and measured else None
    return float(first) if isinstance(first, int | float) and 0.0 < first <= 1.0 else None


class EagleProposer(ModelProposer):
    # Its cost is timed (one head forward per draft token); first-draft acceptance before evidence:
    # the head's own held-out figure when its training recorded one (`measured_prior`), else this.
    traits = Traits(needs_hidden=True, confidence_priors=(0.6,))

    @classmethod
    def build(cls, ctx: BuildContext) -> EagleProposer | None:
        path = ctx.settings.resolved_draft_head()
        if path is None:
            return None
        try:
            head = EagleHead.from_pretrained(path, ctx.target.model)
        except ValueError:
            if ctx.settings.draft_head != "auto":
                raise  # a head the user named must fit: say why it does not
            log.info("the shipped draft head does not fit target %s: method eagle is off", ctx.target.name)
            return None
        return cls(head, ctx.vocab_size)

    def __init__(self, head: EagleHead, vocab_size: int) -> None:
        prior = measured_prior(head)
        if prior is not None:
            self.traits = dataclasses.replace(EagleProposer.traits, confidence_priors=(prior,))
        self.head = head.eval()
        self.feature_dtype = head.fc.weight.dtype  # `_pairs` rounds every feature to it first
        use_gqa_attention(head.decoder)
        self.vocab_size = vocab_size
        self.runner = ModelRunner(head.decoder)
        # fc and the FR output matrix multiply as the decoder's layers do (oneDNN on CPU: lean_forward.py)
        pack = packs_linears(head.decoder)
        self.fc = linear_kernel(head.fc, pack)
        self.fr_logits = linear_kernel(head, pack, weight="lm_head_fr", bias=None)  # [..., H] -> [..., N]
        self.pending: dict[str, _Pending] = {}
        self._drafted_last = set()
        self._loaded = {}
        self.forwards = 0
        self._empty = torch.zeros(0, head.config.hidden_size, device=head.vocab_ids.device)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The head's weights (its embedding is the target's), fc's and the FR matrix's reordered copies too."""
        packed = [k.packed for k in (self.fc, self.fr_logits) if isinstance(k, PackedLinear)]
        return [*super().weight_tensors(), *self.head.parameters(), *self.head.buffers(), *packed]

    def release_dense(self) -> int:
        """Its decoder's dense weights, and fc's and the FR matrix's (only their packed kernels run them here)."""
        dropped = [k.release() for k in (self.fc, self.fr_logits) if isinstance(k, PackedLinear)]
        return super().release_dense() + sum(w.numel() * w.element_size() for w in dropped if w is not None)

    def cache_bytes(self, seen: set[tuple[str, int]]) -> int:
        """Its KV cache, and the target's features rows hold until they feed them."""
        pending = [f for p in list(self.pending.values()) for f in list(p.features)]
        return super().cache_bytes(seen) + tensor_bytes(pending, seen)

    # The pair at cache position t holds the feature at t and token t + 1 (a prefix-cache block's pairs
    # are those its tokens determine, from the one before its first token's).
    reads_ahead = 1

    def _start(self, request_ids: list[str]) -> None:
        # rows with their loaded pairs only (`load_prefix`): their pending pairs feed next
        self.runner.join(request_ids, [[] for _ in request_ids], prefixes=self._entering(request_ids))

    def _skip(self, request_id: str, positions: int) -> None:
        pending = self.pending[request_id]
        feats, tokens = pending.take()
        assert feats is not None and len(tokens) > positions, "a loaded prefix leaves the prompt's last pairs"
        pending.features, pending.tokens = [feats[positions:]], tokens[positions:]

    # ---- membership --------------------------------------------------------------------------
    def join(self, seqs: list[SequenceView], prompt_hidden: list[torch.Tensor] | None) -> None:
        assert prompt_hidden is not None, "the eagle proposer needs the target's hidden states"
        for seq, hidden in zip(seqs, prompt_hidden, strict=True):
            tokens = seq.tokens  # at join, the prompt
            # hidden row t is the target's feature at prompt token t (t < m <= n - 1, cached prefix included):
            # its pair is token t + 1; the features of a tail computed with the first step come at commit
            m = hidden.shape[0]
            assert m <= len(tokens) - 1, "a feature for each prefilled prompt token, at most"
            self.pending[seq.request_id] = _Pending([hidden], list(tokens[1 : m + 1]))

    @torch.no_grad()
    def prefilled(self, seq: SequenceView, start: int, hidden: torch.Tensor) -> None:
        """The chunk's pairs (the feature at position t, token t + 1: all in the prompt) join the row's
        pending pairs, and the head takes them in now (the row enters its cache if it was not in yet)."""
        rid = seq.request_id
        pending = self.pending[rid]
        pending.features.append(hidden)
        pending.tokens += seq.tokens[start + 1 : start + 1 + hidden.shape[0]]
        if rid not in self.runner.rows:
            self._start([rid])
        taken = [self.pending[r].take() if r == rid else (None, []) for r in self.runner.rows]
        self.runner.forward(self._pairs([f for f, _ in taken], [t for _, t in taken]), logits=False)
        self.forwards += 1

    @staticmethod
    def _copy_pending(pending: dict[str, _Pending]) -> dict[str, _Pending]:
        return {rid: _Pending(list(p.features), list(p.tokens)) for rid, p in pending.items()}

    def _pending_count(self, request_id: str) -> int:
        return len(self.pending[request_id].tokens)

    def leave(self, request_ids: set[str]) -> None:
        self.runner.leave(request_ids)
        self._forget(request_ids)
        for rid in request_ids:
            self.pending.pop(rid, None)

    # ---- drafting ------------------------------------------------------------------------------
    def _pairs(self, features: list[torch.Tensor | None], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Per row, the decoder's inputs [n_b, hidden] for its pairs (f_t, x_{t+1}): fc([embed(x) ; f]), one
        product for every row's pairs (a row with none gets [0, hidden])."""
        head = self.head
        counts = [len(t) for t in tokens]
        if not any(counts):
            return [self._empty] * len(tokens)
        ids = torch.tensor([t for row in tokens for t in row], device=head.vocab_ids.device)
        embeds = head.embed(ids)
        feats = torch.cat([f for f, n in zip(features, counts, strict=True) if n]).to(embeds.dtype)
        return list(self.fc(torch.cat([embeds, feats], dim=-1)).split(counts))

    @torch.no_grad()
    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        rows = self._rows(seqs, ks)
        ids = self.runner.rows
        ks = [k if self.pending[rid].tokens else 0 for rid, k in zip(ids, rows.ks, strict=True)]
        drafts: list[list[int]] = [[] for _ in ids]
        q_rows: list[list[torch.Tensor]] = [[] for _ in ids]
        taken = [self.pending[rid].take() if k else (None, []) for rid, k in zip(ids, ks, strict=True)]
        feed = self._pairs([f for f, _ in taken], [t for _, t in taken])  # per row: its pending pairs when it drafts
        rows_at = torch.arange(len(ids), device=self.runner.device)
        while any(len(f) for f in feed):
            out = self.runner.forward(feed, logits=False, hidden=True).hidden  # [rows, W, hidden]
            self.forwards += 1
            last = torch.tensor([max(len(f) - 1, 0) for f in feed], device=out.device)
            predicted = out[rows_at, last]  # [rows, hidden]: f̂ of the next token
            logits = self.head.full_logits(self.fr_logits(predicted))  # [rows, vocab], -inf outside FR
            q, tokens = self._draw(logits, rows, [bool(len(f)) for f in feed])
            # The last draft is not fed: the target's verdict decides what follows it.
            more = []
            for b, token in enumerate(tokens):
                if token is not None:
                    drafts[b].append(token)
                    q_rows[b].append(q[b])
                more.append(token is not None and len(drafts[b]) < ks[b])
            feed = self._pairs([predicted[b : b + 1] if m else None for b, m in enumerate(more)],
                               [[tokens[b]] if m else [] for b, m in enumerate(more)])
        return self._in_order(seqs, drafts, q_rows)

    # ---- after verification ----------------------------------------------------------------------
    def commit(self, seq: SequenceView, drafts: list[int], emitted: list[int], hidden: torch.Tensor | None) -> None:
        # hidden: the committed fed tokens' features; a step that also computed the prompt's tail has its
        # features first, each paired with the prompt token after it (the prompt's last `tail` tokens)
        tail = hidden.shape[0] - len(emitted) if hidden is not None else -1
        assert tail >= 0 and (tail == 0 or len(seq.tokens) > tail)
        rid = seq.request_id
        if drafts:  # the cache holds the pairs of d_1..d_{k-1} with predicted features: replace them
            self.runner.rollback(self.runner.kv.index(rid), len(drafts) - 1)
        self._committed(rid, bool(drafts))
        pending = self.pending[rid]
        pending.features.append(hidden)  # real features of the fed tokens that were committed, each paired
        pending.tokens += [*seq.tokens[len(seq.tokens) - tail :], *emitted] if tail else emitted  # with the next token
