"""The batched, lossless rejection sampler (Leviathan et al. 2023; Chen et al. 2023).

For each row, in order over its draft tokens x_j: accept with probability min(1, p_j(x)/q_j(x)).
At the first rejection, sample the *recovered* token from normalize(max(p_j - q_j, 0)) and stop.
If every draft is accepted, sample a *bonus* token from p_{k+1}. Either way a row emits
accepted + 1 tokens, and the result is distributed exactly as sampling from p alone.

Each row's `RowPlan.rule` (plan.py) says which way its drafts are judged. `Rule.RATIO` is the rule above,
with the row's q. `Rule.COMPARE` draws the token at each position from p_j, exactly as plain decoding would
(one uniform per emitted token, by inverse CDF), and accepts the draft while the drawn token equals it:
for a draft whose q is one-hot (n-gram) the acceptance probability is p(x) and a rejection emits a token
distributed as p with x removed, the same law as the rule above, and the text is *the same text* plain
decoding draws from the same seed, whatever was drafted. Greedy rows arrive with one-hot p, so every rule
reduces to "accept while x == argmax p".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from server.sampling import sample
from server.speculation.plan import RowPlan, Rule


@dataclass(frozen=True)
class Verdict:
    """What the sampler decided for each row."""

    accepted: list[int]  # accepted draft tokens per row
    tokens: list[list[int]]  # emitted tokens per row: accepted drafts + one recovered/bonus token


def rejection_sample(
    rows: Sequence[RowPlan],
    target_probs: torch.Tensor | None,
    generators: list[torch.Generator],
    greedy: list[bool] | None = None,
    best: list[int] | None = None,
) -> Verdict:
    """Accept/reject every row's drafts against the target in one pass.

    rows: per row its drafts (k_b may be 0, and may differ between rows), its rule, q for the ratio rule
        ([k_b, vocab]) and its verify positions in `target_probs` (`plan.place`).
    target_probs: p, [positions, vocab]: row b's k_b + 1 positions score its drafts, then its bonus.
    generators: one per row; each row draws only from its own, so a seeded request reproduces
        whatever else shares its batch.
    greedy: per row, whether it decodes greedily (p one-hot at every position): its exact path needs
        no draws. None: no row is assumed greedy (one-hot rows are then sampled, to the same token).
    best: where every row is greedy (and so compares), p's one token at each position instead of p
        (`sampling.greedy_tokens`); `target_probs` may then be None.

    Example (greedy, one row): drafts [5, 9], p one-hot at 5 then 7 then anything: 5 is accepted, 9
    rejected, and the recovered token is 7: Verdict(accepted=[1], tokens=[[5, 7]]).
    """
    if greedy is None:
        greedy = [False] * len(rows)
    needed = max((r.positions.stop for r in rows), default=0)
    if best is not None:
        if not all(greedy) or any(r.rule is not Rule.COMPARE for r in rows) or len(rows) != len(greedy):
            raise ValueError("p's tokens alone serve only rows that are all greedy and compare")
        if needed != len(best):
            raise ValueError(f"best has {len(best)} positions; the rows need {needed}")
        return _compare_greedy(rows, best)
    if target_probs is None:
        raise ValueError("p is needed unless every row is greedy and `best` is given")
    if needed != len(target_probs):
        raise ValueError(f"p has {len(target_probs)} positions; the rows need {needed}")
    verdict = Verdict(accepted=[0] * len(rows), tokens=[[] for _ in rows])
    compare = [b for b, r in enumerate(rows) if r.rule is Rule.COMPARE]
    ratio = [b for b, r in enumerate(rows) if r.rule is Rule.RATIO]
    parts = []
    if compare:
        parts.append((compare, _sample_and_compare(
            [rows[b] for b in compare], target_probs, [generators[b] for b in compare], [greedy[b] for b in compare])))
    if ratio:
        parts.append((ratio, _accept_reject([rows[b] for b in ratio], target_probs, [generators[b] for b in ratio])))
    for members, part in parts:
        for i, b in enumerate(members):
            verdict.accepted[b], verdict.tokens[b] = part.accepted[i], part.tokens[i]
    return verdict


def _accept_reject(rows: list[RowPlan], target_probs: torch.Tensor, generators: list[torch.Generator]) -> Verdict:
    """The min(1, p/q) rule, for rows whose drafts come with a model's q."""
    drafts = [r.drafts for r in rows]
    batch, vocab = len(drafts), target_probs.shape[-1]
    k_max = max(len(d) for d in drafts)
    device = target_probs.device
    lengths = torch.tensor([len(d) for d in drafts], device=device)
    first = torch.tensor([r.at for r in rows], device=device)
    # [batch, K]: the flat position of each draft; past a row's drafts, its bonus position (never read:
    # the uniform there is 2.0)
    where = first[:, None] + torch.minimum(torch.arange(k_max, device=device)[None, :], lengths[:, None])
    draft_ids = torch.zeros(batch, k_max, dtype=torch.long, device=device)  # [batch, K]
    q = torch.zeros(batch, k_max, vocab, device=device)  # [batch, K, vocab]; zero past each row's drafts
    for b, row in enumerate(rows):
        if row.drafts:
            draft_ids[b, : row.k] = torch.tensor(row.drafts, device=device)
            q[b, : row.k] = row.q.to(device)

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
    rows: list[RowPlan], target_probs: torch.Tensor, generators: list[torch.Generator], greedy: list[bool]
) -> Verdict:
    """`Rule.COMPARE`: draw each position's token from p as plain decoding would, and keep going while it
    equals the draft. Emits the drawn tokens; consumes one uniform per sampled token. Greedy rows (one-hot
    p) need no draw: a draft is kept while it is p's one token, then that token."""
    best = target_probs.max(dim=-1).indices.tolist() if any(greedy) else []  # one-hot: the argmax
    accepted, tokens = [], []
    for b, (row, gen) in enumerate(zip(rows, generators, strict=True)):
        d, s = row.drafts, row.at
        if greedy[b]:
            out = _kept(d, best, s)
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


def _kept(drafts: list[int], best: list[int], at: int) -> list[int]:
    """A greedy row's emitted tokens: its drafts while each is p's one token at its position, then that token."""
    kept = next((j for j, x in enumerate(drafts) if best[at + j] != x), len(drafts))
    return [*drafts[:kept], best[at + kept]]


def _compare_greedy(rows: Sequence[RowPlan], best: list[int]) -> Verdict:
    """`_sample_and_compare` for rows that are all greedy, from p's tokens (no p, no draws)."""
    tokens = [_kept(r.drafts, best, r.at) for r in rows]
    return Verdict(accepted=[len(t) - 1 for t in tokens], tokens=tokens)
