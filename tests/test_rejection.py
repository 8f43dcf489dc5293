"""The rejection sampler: exact greedy cases, seeded determinism, top-k/top-p, and convergence to p."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from server.sampling import BatchSampling, greedy_tokens, probabilities
from server.speculation.plan import RowPlan, Rule, place
from server.speculation.rejection import rejection_sample
from server.types import SamplingParams

V = 6


def verdict(drafts, p, qs, generators, greedy=None):
    """The sampler on p given per row [rows, W, V] (tests write it so): each row's k + 1 positions,
    row after row, are what it reads."""
    flat = torch.cat([p[b, : len(d) + 1] for b, d in enumerate(drafts)])
    return rejection_sample(rows(drafts, qs), flat, generators, greedy)


def rows(drafts, qs) -> list[RowPlan]:
    """Placed rows: the ratio rule where a q is given, else compare."""
    return place([RowPlan("x", d, Rule.RATIO if q is not None else Rule.COMPARE, q)
                  for d, q in zip(drafts, qs, strict=True)])


def test_p_must_hold_each_rows_positions():
    with pytest.raises(ValueError, match="positions"):
        rejection_sample(rows([[1, 2]], [None]), one_hot(1, 2), gens(1))


def one_hot(*idx: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(idx), V).float()


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_perfect_match_accepts_all_and_adds_bonus():
    p = one_hot(1, 2, 3, 4)[None]  # greedy target: argmax 1, 2, 3 then bonus 4
    v = verdict([[1, 2, 3]], p, [None], gens(1))
    assert v.accepted == [3] and v.tokens == [[1, 2, 3, 4]]


def test_early_mismatch_stops_and_recovers_target_token():
    p = one_hot(1, 5, 3, 4)[None]
    v = verdict([[1, 2, 3]], p, [None], gens(1))
    assert v.accepted == [1] and v.tokens == [[1, 5]]  # recovered = argmax p at the mismatch


def test_ragged_rows_in_one_batch():
    p = torch.stack([one_hot(0, 1, 2), one_hot(4, 0, 0), one_hot(3, 3, 3)])
    v = verdict([[0, 1], [], [2]], p, [None] * 3, gens(3))
    assert v.accepted == [2, 0, 0]
    assert v.tokens == [[0, 1, 2], [4], [3]]


def test_acceptance_probability_is_p_over_q_capped_at_one():
    """A draft with p(x) >= q(x) is always kept; one with p(x) < q(x) is kept with probability p/q.
    An inverted ratio (q/p) fails both halves."""
    p = torch.tensor([[[0.1, 0.1, 0.1, 0.5, 0.1, 0.1], [1.0 / V] * V]])  # [1, 2, V]
    likely = torch.tensor([[0.25, 0.15, 0.15, 0.25, 0.1, 0.1]])  # q(3) = 0.25 < p(3) = 0.5
    unlikely = torch.tensor([[0.1, 0.4, 0.1, 0.2, 0.1, 0.1]])  # q(1) = 0.4 > p(1) = 0.1: keep 1/4
    for seed in range(100):
        assert verdict([[3]], p, [likely], gens(1, seed)).accepted == [1]
    kept = sum(verdict([[1]], p, [unlikely], gens(1, seed)).accepted[0] for seed in range(400))
    assert 0.18 < kept / 400 < 0.32


def test_seeded_determinism_and_independence_from_batch_mates():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(1, 4, V), -1)
    q = torch.softmax(torch.randn(1, 3, V), -1)
    alone = verdict([[1, 2, 3]], p, [q[0]], gens(1, 42))
    again = verdict([[1, 2, 3]], p, [q[0]], gens(1, 42))
    assert alone == again
    p2 = torch.cat([p, torch.softmax(torch.randn(1, 4, V), -1)])
    q2 = torch.cat([q, torch.softmax(torch.randn(1, 3, V), -1)])
    g = [torch.Generator().manual_seed(42), torch.Generator().manual_seed(7)]
    batched = verdict([[1, 2, 3], [0]], p2, [q2[0], q2[1, :1]], g)
    assert batched.tokens[0] == alone.tokens[0]


def test_top_k_top_p_apply_to_p_and_q_alike():
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]])
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)]
    s = BatchSampling.from_params(params, torch.device("cpu"))
    probs = probabilities(logits.expand(2, 1, V), s)
    assert (probs[0, 0, 2:] == 0).all() and probs[0, 0, :2].sum().item() > 0.999
    # softmax([4,3,...]) puts ~0.64 on token 0: the 0.5 nucleus keeps token 0 alone.
    assert probs[1, 0, 0].item() == 1.0
    # Drafted tokens outside the nucleus are never accepted: p(x) = 0 there.
    q = probabilities(torch.zeros(1, 1, V), BatchSampling.from_params(params[:1], torch.device("cpu")))
    for seed in range(20):
        v = verdict([[5]], probs[:1].expand(1, 2, V).contiguous(), [q[0]], gens(1, seed))
        assert v.accepted == [0] and v.tokens[0][0] in (0, 1)


def test_greedy_rows_are_one_hot_at_argmax():
    logits = torch.tensor([[[0.1, 2.0, 1.9, 0.0, 0.0, 0.0]]])
    probs = probabilities(logits, BatchSampling.from_params([SamplingParams(temperature=0.0)], torch.device("cpu")))
    assert probs[0, 0].tolist() == one_hot(1)[0].tolist()


def test_greedy_rows_from_ps_tokens_alone_get_the_same_verdict():
    """A step whose rows are all greedy hands the sampler p's tokens (`greedy_tokens`) instead of a one-hot p:
    the same tokens under every control (logit_bias, a grammar's mask, min_tokens), the same verdict."""
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.0, logit_bias=((3, 5.0),)), SamplingParams(temperature=0.0, min_tokens=4),
              SamplingParams(temperature=0.0)]
    drafts = [[2, 3, 1], [], [5, 5]]
    sampling = BatchSampling.from_params(params, torch.device("cpu"), generated=[0, 1, 9], eos_ids={0})
    placed = rows(drafts, [None] * 3)
    at = sampling.at_positions([len(d) + 1 for d in drafts])
    for trial in range(20):
        logits = torch.randn(placed[-1].positions.stop, 1, V) * 3
        for b, r in enumerate(placed):  # drafts that p often keeps
            for j, x in enumerate(drafts[b]):
                if (trial + j) % 3:
                    logits[r.at + j, 0, x] += 8
        allowed = torch.rand(len(logits), 1, V) > 0.3
        allowed[:, :, 1] = True
        p = probabilities(logits, at, allowed=allowed)[:, 0]
        best = greedy_tokens(logits, at, allowed=allowed)[:, 0]
        assert torch.equal(best, p.argmax(-1))
        want = rejection_sample(placed, p, gens(3), [True] * 3)
        got = rejection_sample(placed, None, gens(3), [True] * 3, best=best.tolist())
        assert got == want
    with pytest.raises(ValueError, match="greedy"):
        rejection_sample(placed, None, gens(3), [True, False, True], best=best.tolist())
    with pytest.raises(ValueError, match="positions"):
        rejection_sample(placed, None, gens(3), [True] * 3, best=best.tolist()[:-1])


def test_a_greedy_rows_q_changes_nothing_so_model_proposers_hand_none():
    """p one-hot: min(1, p/q) keeps a draft exactly when it is p's token and recovers that token, whatever
    q is. Model proposers therefore hand greedy rows' drafts over without q (model_proposer.py), and
    the sampler compares them with the argmax: the same verdicts, for any q and any drafts."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        k = 1 + trial % 4
        best = torch.randint(V, (k + 1,), generator=gen)
        p = torch.nn.functional.one_hot(best, V).float()[None]  # [1, k + 1, V]
        q = torch.softmax(torch.randn(k, V, generator=gen) * 3, dim=-1)
        from_q = torch.multinomial(q, 1, generator=gen)[:, 0]
        drafts = [torch.where(torch.rand(k, generator=gen) < 0.6, best[:k], from_q).tolist()]
        with_q = verdict(drafts, p, [q], [torch.Generator().manual_seed(trial)], greedy=[True])
        without = verdict(drafts, p, [None], [torch.Generator().manual_seed(trial)], greedy=[True])
        assert with_q == without
        kept = next((j for j, x in enumerate(drafts[0]) if x != int(best[j])), k)
        assert without.tokens == [drafts[0][:kept] + [int(best[kept])]]


def _first_token_histogram(p: torch.Tensor, q: torch.Tensor, n: int, accept_all: bool = False) -> torch.Tensor:
    """Sample the first emitted token n times: draft x ~ q, then the sampler (or a broken rule)."""
    counts = torch.zeros(V)
    gen = torch.Generator().manual_seed(123)
    for _ in range(n):
        x = int(torch.multinomial(q[0, 0], 1, generator=gen))
        if accept_all:
            token = x
        else:
            token = verdict([[x]], p, [q[0]], [gen]).tokens[0][0]
        counts[token] += 1
    return counts


@pytest.mark.slow
def test_output_converges_to_target_distribution_and_a_wrong_rule_is_caught():
    torch.manual_seed(3)
    p = torch.softmax(torch.randn(1, 2, V) * 1.5, -1)
    q = torch.softmax(torch.randn(1, 1, V) * 1.5, -1)
    n = 4000
    expected = p[0, 0] * n
    good = _first_token_histogram(p, q, n)
    assert chisquare(good, expected).pvalue > 1e-3
    bad = _first_token_histogram(p, q, n, accept_all=True)  # "always accept" yields q, not p
    assert chisquare(bad, expected).pvalue < 1e-6


def test_compared_drafts_do_not_change_what_a_seed_samples():
    """For compared drafts (n-gram: one-hot q) the sampler draws every token as plain decoding would: the
    emitted text from a seed is the same whatever was drafted, and only how many tokens one pass
    yields changes."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(1, 5, V) * 0.7, dim=-1)  # 5 positions of a sampled distribution
    plain = []
    gen = torch.Generator().manual_seed(7)
    for j in range(5):  # plain decoding: one token per pass, from the same seed
        plain.append(verdict([[]], p[:, j : j + 1], [None], [gen]).tokens[0][0])
    rng = torch.Generator().manual_seed(1)
    for trial in range(20):  # any drafts at all, right or wrong, of any length
        gen = torch.Generator().manual_seed(7)
        out: list[int] = []
        while len(out) < 5:
            k = int(torch.randint(0, 5 - len(out), (1,), generator=rng))
            right = plain[len(out) : len(out) + k]
            wrong = torch.randint(0, V, (k,), generator=rng).tolist()
            mix = torch.rand(k, generator=rng) < 0.5
            drafts = right if trial % 2 else [w if m else r for w, r, m in zip(wrong, right, mix, strict=True)]
            v = verdict([drafts], p[:, len(out) : len(out) + k + 1], [None], [gen])
            out += v.tokens[0]
        assert out == plain
    # a mixed batch: the n-gram row keeps that property next to a draft-model row
    q = torch.softmax(torch.randn(2, V), dim=-1)
    gen, other = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    v = verdict([plain[:4], [1, 2]], torch.cat([p, p]), [None, q], [gen, other])
    assert v.tokens[0] == plain and v.accepted[0] == 4


def test_a_sampled_row_that_is_one_hot_at_first_still_samples_later_positions():
    """A nucleus can shrink to one token at one position (top_p) and not at the next: only rows that
    decode greedily take the argmax everywhere."""
    p = torch.stack([one_hot(2)[0], torch.full((V,), 1.0 / V)])[None]  # [1, 2, V]
    seconds = {verdict([[2]], p, [None], gens(1, seed), greedy=[False]).tokens[0][1] for seed in range(40)}
    assert len(seconds) > 3  # sampled, not always the same token
    assert verdict([[2]], p, [None], gens(1), greedy=[True]).tokens[0] == [2, int(p[0, 1].argmax())]
