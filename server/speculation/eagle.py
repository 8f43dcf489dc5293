"""EAGLE-style proposer: a one-layer draft head that drafts from the target's own hidden states.

The head (server/draft_head/model.py) reads pairs (f_t, x_{t+1}): the target's final-norm hidden
state at position t and the token after it, and predicts f_{t+1}, whose LM-head logits (over the
head's frequent-token vocabulary; q = 0 elsewhere) give the next draft token. Its one decoder layer
has its own batched KV cache, driven by a `ModelRunner` like any model.

The head's cache holds pairs built from *real* target features only. Per sequence, the pairs not
yet fed wait in `pending` (features [m, hidden] and their next tokens): at join those of the prompt,
after each step those of the committed tokens (the hidden states `commit` receives, paired with the
emitted tokens). Drafting k tokens feeds the pending pairs, then k - 1 pairs made of the head's own
predicted features and its drafts; after verification those k - 1 are rolled back, and the accepted
tokens come back as pending pairs with the target's real features (EAGLE's feature correction).
The cache is filled lazily: a sequence that never drafts with the head never pays for it.
"""

from __future__ import annotations

import dataclasses

import torch

from server.draft_head.model import EagleHead
from server.draft_head.shipped import resolve_draft_head
from server.model.attention import use_gqa_attention
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, probabilities, sample
from server.speculation.proposer import BuildContext, Proposal, Proposer, SequenceView, Traits


@dataclasses.dataclass
class _Pending:
    """Pairs (feature, next token) not yet in the head's cache."""

    features: list[torch.Tensor]  # pieces [n_i, hidden]
    tokens: list[int]  # one per feature row

    def take(self) -> tuple[torch.Tensor | None, list[int]]:
        feats = torch.cat(self.features) if self.features else None
        tokens, self.features, self.tokens = self.tokens, [], []
        return feats, tokens


class EagleProposer(Proposer):
    # Its cost is timed (one head forward per draft token); first-draft acceptance before evidence.
    traits = Traits(deterministic=False, needs_hidden=True, confidence_priors=(0.6,))

    @classmethod
    def build(cls, ctx: BuildContext) -> EagleProposer | None:
        path = resolve_draft_head(ctx.settings.draft_head, ctx.settings.target)
        if path is None:
            return None
        return cls(EagleHead.from_pretrained(path, ctx.target.model), ctx.vocab_size)

    def __init__(self, head: EagleHead, vocab_size: int) -> None:
        self.head = head.eval()
        use_gqa_attention(head.decoder)
        self.vocab_size = vocab_size
        self.runner = ModelRunner(head.decoder)
        self.pending: dict[str, _Pending] = {}
        self.forwards = 0  # head forwards run so far (tests and the bench read it)

    # ---- membership --------------------------------------------------------------------------
    def join(self, seqs: list[SequenceView], prompt_hidden: list[torch.Tensor] | None) -> None:
        assert prompt_hidden is not None, "the eagle proposer needs the target's hidden states"
        for seq, hidden in zip(seqs, prompt_hidden, strict=True):
            tokens = seq.tokens
            # hidden row t is the target's feature at prompt token t (t < n - 1); its pair is token t + 1
            self.pending[seq.request_id] = _Pending([hidden], list(tokens[1 : 1 + hidden.shape[0]]))

    def leave(self, request_ids: set[str]) -> None:
        self.runner.leave(request_ids)
        for rid in request_ids:
            self.pending.pop(rid, None)

    # ---- drafting ------------------------------------------------------------------------------
    def _pairs(self, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """The decoder's inputs [n, hidden] for pairs (f_t, x_{t+1}): fc([embed(x) ; f])."""
        head = self.head
        embeds = head.embed_weight[torch.tensor(tokens, device=head.embed_weight.device)]
        return head.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))

    @torch.no_grad()
    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        by_id = {s.request_id: (s, k) for s, k in zip(seqs, ks, strict=True)}
        cached = set(self.runner.rows)
        starting = [s.request_id for s, k in zip(seqs, ks, strict=True) if k > 0 and s.request_id not in cached]
        if starting:
            self.runner.join(starting, [[] for _ in starting])  # empty rows: the pending pairs feed below
        rows = self.runner.rows  # every cached row is asked each step (the planner guarantees it)
        row_k = [by_id[rid][1] if self.pending[rid].tokens else 0 for rid in rows]
        k_max = max(row_k, default=0)
        drafts: list[list[int]] = [[] for _ in rows]
        q_rows: list[list[torch.Tensor]] = [[] for _ in rows]
        if k_max == 0:
            return self._in_order(seqs, drafts, q_rows)
        params = [dataclasses.replace(by_id[rid][0].sampling, presence_penalty=0.0, frequency_penalty=0.0,
                                      repetition_penalty=1.0) for rid in rows]
        sampling = BatchSampling.from_params(params, self.runner.device)
        gens = [by_id[rid][0].generator for rid in rows]
        hidden_size = self.head.config.hidden_size
        empty = torch.zeros(0, hidden_size, device=self.runner.device)
        feed = []  # per row: decoder inputs [n_b, hidden]
        for rid, k in zip(rows, row_k, strict=True):
            feats, tokens = self.pending[rid].take() if k else (None, [])
            feed.append(self._pairs(feats, tokens) if feats is not None else empty)
        for j in range(k_max):
            out = self.runner.forward(feed, logits=False, hidden=True).hidden  # [rows, W, hidden]
            self.forwards += 1
            last = torch.tensor([max(len(f) - 1, 0) for f in feed], device=out.device)
            predicted = out[torch.arange(len(rows), device=out.device), last]  # [rows, hidden]: f̂ of the next token
            logits = self.head.full_logits(self.head.fr_logits(predicted))  # [rows, vocab], -inf outside FR
            q = probabilities(_to_width(logits, self.vocab_size)[:, None], sampling)[:, 0]  # [rows, vocab]
            greedy_tokens = q.argmax(dim=-1).tolist()
            next_feed = []
            for b in range(len(rows)):
                if j < row_k[b] and len(feed[b]):
                    token = greedy_tokens[b] if params[b].greedy else sample(q[b], gens[b])
                    drafts[b].append(token)
                    q_rows[b].append(q[b])
                # The last draft is not fed: the target's verdict decides what follows it.
                more = len(drafts[b]) < row_k[b] and len(feed[b])
                next_feed.append(self._pairs(predicted[b : b + 1], drafts[b][-1:]) if more else empty)
            feed = next_feed
            if not any(len(f) for f in feed):
                break
        return self._in_order(seqs, drafts, q_rows)

    def _in_order(
        self, seqs: list[SequenceView], drafts: list[list[int]], q_rows: list[list[torch.Tensor]]
    ) -> Proposal:
        """From cache-row order to the caller's order (sequences not in the cache drafted nothing)."""
        index = {rid: i for i, rid in enumerate(self.runner.rows)}
        out_drafts, out_q = [], []
        for s in seqs:
            i = index.get(s.request_id)
            out_drafts.append(drafts[i] if i is not None else [])
            out_q.append(torch.stack(q_rows[i]) if i is not None and q_rows[i] else None)
        return Proposal(drafts=out_drafts, q=out_q)

    # ---- after verification ----------------------------------------------------------------------
    def commit(self, seq: SequenceView, drafts: list[int], emitted: list[int], hidden: torch.Tensor | None) -> None:
        assert hidden is not None and hidden.shape[0] == len(emitted)
        rid = seq.request_id
        if drafts:  # the cache holds the pairs of d_1..d_{k-1} with predicted features: replace them
            self.runner.rollback(self.runner.kv.index(rid), len(drafts) - 1)
        pending = self.pending[rid]
        pending.features.append(hidden)  # real features of the fed tokens that were committed...
        pending.tokens += emitted  # ...each paired with the token that followed it


def _to_width(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Head logits [..., head_vocab] over the target's `vocab` ids: cut, or padded with -inf."""
    width = logits.shape[-1]
    if width >= vocab:
        return logits[..., :vocab]
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))], dim=-1)
