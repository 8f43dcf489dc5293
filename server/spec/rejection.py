"""The batched, lossless rejection sampler (Leviathan et al. 2023; Chen et al. 2023).

For each row, in order over its draft tokens x_j: accept with probability min(1, p_j(x)/q_j(x)).
At the first rejection, sample the *recovered* token from normalize(max(p_j - q_j, 0)) and stop.
If every draft is accepted, sample a *bonus* token from p_{k+1}. Either way a row emits
accepted + 1 tokens, and the result is distributed exactly as sampling from p alone.

A deterministic proposer (n-gram) has q = one-hot(x): accept with probability p(x), otherwise
sample from p with x removed. Greedy rows arrive with one-hot p, so the rule reduces to "accept
while x == argmax p" and the recovered/bonus token is argmax p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """What the sampler decided for each row."""

    accepted: list[int]  # accepted draft tokens per row
    tokens: list[list[int]]  # emitted tokens per row: accepted drafts + one recovered/bonus token


def rejection_sample(
    drafts: list[list[int]],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: list[torch.Generator],
) -> Verdict:
    """Accept/reject every row's drafts against the target in one pass.

    drafts: per row, its k_b draft tokens (k_b may be 0, and may differ between rows).
    target_probs: p, [batch, K + 1, vocab], K = max k_b; row b's position j scores drafts[b][j].
    draft_probs: q, [batch, K, vocab], or None when every row's proposer is deterministic. Rows
        whose q is one-hot must hold one-hot rows here too (the caller builds them).
    generators: one per row; each row draws only from its own, so a seeded request reproduces
        whatever else shares its batch.
    """
    batch, width, _ = target_probs.shape
    k_max = width - 1
    device = target_probs.device
    lengths = torch.tensor([len(d) for d in drafts], device=device)
    draft_ids = torch.zeros(batch, max(k_max, 1), dtype=torch.long, device=device)
    for b, d in enumerate(drafts):
        if d:
            draft_ids[b, : len(d)] = torch.tensor(d, device=device)
    draft_ids = draft_ids[:, :k_max]  # [batch, K]

    p_x = target_probs[:, :k_max].gather(-1, draft_ids[..., None])[..., 0]  # [batch, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # one-hot q: q(x) = 1
    else:
        q_x = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    # q(x) > 0 for any token actually sampled from q; the clamp only guards the padded positions.
    accept_prob = (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0)  # q >= p: always accept

    uniform = torch.full((batch, k_max), 2.0, device=device)  # 2.0 never accepts: padding
    for b, gen in enumerate(generators):
        k = len(drafts[b])
        if k:
            uniform[b, :k] = torch.rand(k, generator=gen, device=gen.device).to(device)
    accepted_mask = (uniform < accept_prob).to(torch.long)  # [batch, K]
    num_accepted = accepted_mask.cumprod(dim=1).sum(dim=1)  # leading accepts
    num_accepted = torch.minimum(num_accepted, lengths)

    rows = torch.arange(batch, device=device)
    final_p = target_probs[rows, num_accepted]  # [batch, vocab]: p at the first rejection or bonus slot
    rejected = num_accepted < lengths
    if bool(rejected.any()):
        if draft_probs is None:
            rejected_x = draft_ids[rows, num_accepted.clamp(max=max(k_max - 1, 0))]
            final_q = torch.zeros_like(final_p).scatter_(-1, rejected_x[:, None], 1.0)
        else:
            final_q = draft_probs[rows, num_accepted.clamp(max=max(k_max - 1, 0))]
        residual = (final_p - final_q).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # mass == 0 only when p == q up to rounding, where rejection had probability ~0: use p.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), final_p)
        final_p = torch.where(rejected[:, None], residual, final_p)

    accepted = num_accepted.tolist()
    tokens = []
    for b, gen in enumerate(generators):
        last = sample(final_p[b], gen)
        tokens.append(drafts[b][: accepted[b]] + [last])
    return Verdict(accepted=accepted, tokens=tokens)
