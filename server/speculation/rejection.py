"""The batched, lossless rejection sampler (Leviathan et al. 2023; Chen et al. 2023).

For each row, in order over its draft tokens x_j: accept with probability min(1, p_j(x)/q_j(x)).
At the first rejection, sample the *recovered* token from normalize(max(p_j - q_j, 0)) and stop.
If every draft is accepted, sample a *bonus* token from p_{k+1}. Either way a row emits
accepted + 1 tokens, and the result is distributed exactly as sampling from p alone.

A deterministic proposer (n-gram) has q = one-hot(x). For those rows (q given as None) the sampler draws
the token at each position from p_j, exactly as plain decoding would (one uniform per emitted token,
by inverse CDF), and accepts the draft while the drawn token equals it: the acceptance probability
is p(x), a rejection emits a token distributed as p with x removed, the same law as the rule above,
and the text is *the same text* plain decoding draws from the same seed, whatever was drafted. Greedy
rows arrive with one-hot p, so every rule reduces to "accept while x == argmax p".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """What the sampler decided for each row."""

    accepted: list[int]  # accepted draft tokens per row
    tokens: list[list[int]]  # emitted tokens per row: accepted drafts + one recovered/bonus token


def row_bounds(drafts: list[list[int]]) -> list[int]:
    """Where each row's verify positions lie in p given row after row: row b's k_b + 1 positions are
    `bounds[b]:bounds[b + 1]`, and `bounds[-1]` is how many there are in all."""
    bounds = [0]
    for d in drafts:
        bounds.append(bounds[-1] + len(d) + 1)
    return bounds


def rejection_sample(
    drafts: list[list[int]],
    target_probs: torch.Tensor,
    draft_probs: list[torch.Tensor | None],
    generators: list[torch.Generator],
    greedy: list[bool] | None = None,
) -> Verdict:
    """Accept/reject every row's drafts against the target in one pass.

    drafts: per row, its k_b draft tokens (k_b may be 0, and may differ between rows).
    target_probs: p, [sum of (k_b + 1), vocab]: each row's k_b + 1 verify positions, row after row;
        row b's position j scores drafts[b][j] (the last one is its bonus position).
    draft_probs: per row, q [k_b, vocab] from a model proposer, or None for a deterministic proposer
        (q one-hot at its drafts) or a row without drafts: those rows sample-and-compare (see above).
    generators: one per row; each row draws only from its own, so a seeded request reproduces
        whatever else shares its batch.
    greedy: per row, whether it decodes greedily (p one-hot at every position): its exact path needs
        no draws. None: no row is assumed greedy (one-hot rows are then sampled, to the same token).

    Example (greedy, one row): drafts [[5, 9]], p one-hot at 5 then 7 then anything: 5 is accepted, 9
    rejected, and the recovered token is 7: Verdict(accepted=[1], tokens=[[5, 7]]).
    """
    if greedy is None:
        greedy = [False] * len(drafts)
    bounds = row_bounds(drafts)
    if bounds[-1] != len(target_probs):
        raise ValueError(f"p has {len(target_probs)} positions; the drafts need {bounds[-1]}")
    starts = bounds[:-1]
    verdict = Verdict(accepted=[0] * len(drafts), tokens=[[] for _ in drafts])
    exact = [b for b, q in enumerate(draft_probs) if q is None]
    ruled = [b for b, q in enumerate(draft_probs) if q is not None]
    parts = []
    if exact:
        gens, greedy_rows = [generators[b] for b in exact], [greedy[b] for b in exact]
        parts.append((exact, _sample_and_compare(
            [drafts[b] for b in exact], target_probs, [starts[b] for b in exact], gens, greedy_rows)))
    if ruled:
        qs = [draft_probs[b] for b in ruled]
        gens = [generators[b] for b in ruled]
        parts.append((ruled, _accept_reject(
            [drafts[b] for b in ruled], target_probs, [starts[b] for b in ruled], qs, gens)))
    for rows, part in parts:
        for i, b in enumerate(rows):
            verdict.accepted[b], verdict.tokens[b] = part.accepted[i], part.tokens[i]
    return verdict


def _accept_reject(
    drafts: list[list[int]],
    target_probs: torch.Tensor,
    starts: list[int],
    draft_probs: list[torch.Tensor],
    generators: list[torch.Generator],
) -> Verdict:
    """The min(1, p/q) rule for rows whose q comes from a model (every row here has a q); row b's
    positions in `target_probs` start at `starts[b]`."""
    batch, vocab = len(drafts), target_probs.shape[-1]
    k_max = max(len(d) for d in drafts)
    device = target_probs.device
    lengths = torch.tensor([len(d) for d in drafts], device=device)
    first = torch.tensor(starts, device=device)
    # [batch, K]: the flat position of each draft; past a row's drafts, its bonus position (never read:
    # the uniform there is 2.0)
    where = first[:, None] + torch.minimum(torch.arange(k_max, device=device)[None, :], lengths[:, None])
    draft_ids = torch.zeros(batch, k_max, dtype=torch.long, device=device)  # [batch, K]
    q = torch.zeros(batch, k_max, vocab, device=device)  # [batch, K, vocab]; zero past each row's drafts
    for b, d in enumerate(drafts):
        if d:
            draft_ids[b, : len(d)] = torch.tensor(d, device=device)
            q[b, : len(d)] = draft_probs[b].to(device)

    p_x = target_probs[where, draft_ids]  # [batch, K]
    q_x = q.gather(-1, draft_ids[..., None])[..., 0]  # [batch, K]
    # q(x) > 0 for any token actually sampled from q; the clamp only guards the padded positions.
    accept_prob = (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0)  # p >= q: always accept

    uniform = torch.full((batch, k_max), 2.0, device=device)  # 2.0 never accepts: padding
    for b, gen in enumerate(generators):
        k = len(drafts[b])
        if k:
            uniform[b, :k] = torch.rand(k, generator=gen, device=gen.device).to(device)
    accepted_mask = (uniform < accept_prob).to(torch.long)  # [batch, K]
    num_accepted = torch.minimum(accepted_mask.cumprod(dim=1).sum(dim=1), lengths)  # leading accepts

    rows = torch.arange(batch, device=device)
    final_p = target_probs[first + num_accepted]  # [batch, vocab]: p at the first rejection or bonus slot
    rejected = num_accepted < lengths
    if bool(rejected.any()):
        final_q = q[rows, num_accepted.clamp(max=max(k_max - 1, 0))]
        residual = (final_p - final_q).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # mass == 0 only when p == q up to rounding, where rejection had probability ~0: use p.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), final_p)
        final_p = torch.where(rejected[:, None], residual, final_p)

    accepted = num_accepted.tolist()
    tokens = [drafts[b][: accepted[b]] + [sample(final_p[b], gen)] for b, gen in enumerate(generators)]
    return Verdict(accepted=accepted, tokens=tokens)


def _sample_and_compare(
    drafts: list[list[int]],
    target_probs: torch.Tensor,
    starts: list[int],
    generators: list[torch.Generator],
    greedy: list[bool],
) -> Verdict:
    """Deterministic drafts: draw each position's token from p as plain decoding would, and keep
    going while it equals the draft. Emits the drawn tokens; consumes one uniform per sampled token.
    Greedy rows (one-hot p) need no draw: a draft is kept while it is p's one token, then that token.
    Row b's positions in `target_probs` start at `starts[b]`."""
    best = target_probs.max(dim=-1).indices.tolist() if any(greedy) else []  # one-hot: the argmax
    accepted, tokens = [], []
    for b, (d, gen, s) in enumerate(zip(drafts, generators, starts, strict=True)):
        if greedy[b]:
            kept = next((j for j, x in enumerate(d) if best[s + j] != x), len(d))
            out = [*d[:kept], best[s + kept]]
        else:
            out = []
            for j in range(len(d) + 1):
                token = sample(target_probs[s + j], gen)
                out.append(token)
                if j == len(d) or token != d[j]:
                    break
        accepted.append(len(out) - 1)
        tokens.append(out)
    return Verdict(accepted=accepted, tokens=tokens)
