"""Lossless in distribution: speculative sampling at temperature 1 matches target-only sampling.

Tiny models with a 64-token vocabulary make the exact target distribution of the first two
generated tokens computable by enumeration, so a chi-square test can compare the engine's
empirical frequencies with it. The same test must fail for a deliberately wrong acceptance rule.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

import server.engine.verify as verify_module
from server.config import Settings
from server.draft_head.model import EagleHead
from server.engine.engine import Engine
from server.speculation.rejection import Verdict
from server.types import GenerationRequest, SamplingParams, SpeculationParams
from tests.models import as_loaded, perturbed, tiny_llama

VOCAB = 64
PROMPT = (5, 9, 17, 33)
SAMPLES = 3000
P_VALUE = 1e-3  # a correct sampler fails this by chance one run in a thousand (per token position)


@pytest.fixture(scope="module")
def pair(tokenizer, tmp_path_factory):
    """Target, draft model, and the directory of an (untrained) EAGLE head over 48 of the 64 tokens:
    its q is 0 on the other 16, which the residual must cover."""
    target = tiny_llama(VOCAB, seed=11, hidden=32)
    for module in target.modules():  # flatten the logits so many tokens carry mass
        if isinstance(module, torch.nn.Embedding):
            module.weight.mul_(0.3)
    draft = perturbed(target, 0.3, seed=5)  # ~40% acceptance: both accept and residual paths run
    head_dir = tmp_path_factory.mktemp("head64")
    EagleHead.create(target, list(range(0, VOCAB, 4)) + list(range(1, VOCAB, 2)), "t64", seed=2).save_pretrained(
        head_dir, dtype=torch.float32
    )
    return as_loaded(target, tokenizer, "t64"), as_loaded(draft, tokenizer, "d64"), head_dir


def exact_two_token_marginals(target) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x1) and p(x2) = sum_x1 p(x1) p(x2 | x1) under the target alone."""
    with torch.no_grad():
        first = torch.softmax(target(input_ids=torch.tensor([PROMPT])).logits[0, -1], -1)
        ids = torch.tensor([[*PROMPT, x] for x in range(VOCAB)])
        second = torch.softmax(target(input_ids=ids).logits[:, -1], -1)  # [x1, x2]
    return first, first @ second


def empirical(pair, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft, head_dir = pair
    engine = Engine(target, draft, Settings.load(max_batch_size=256, draft_head=str(head_dir)))
    return first_two_token_counts(
        engine, PROMPT, method, lambda i: SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
    )


def first_two_token_counts(
    engine: Engine,
    prompt: tuple[int, ...],
    method: str,
    params: Callable[[int], SamplingParams],
    grammar: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token came first and second over SAMPLES requests of `prompt` (`params(i)` for
    request i, constrained by `grammar` if given) with `method`, K = 2, run in batches of 250."""
    counts = torch.zeros(2, VOCAB)
    for start in range(0, SAMPLES, 250):
        engine.add_requests([GenerationRequest(f"s{i}", prompt, params(i), SpeculationParams(method, 2), grammar)
                             for i in range(start, min(start + 250, SAMPLES))])  # one join: one prefill, one relayout
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        for toks in tokens.values():
            counts[0, toks[0]] += 1
            counts[1, toks[1]] += 1
    return counts[0], counts[1]


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_the_draft_pair_really_differs(pair, method):
    """Guard for the test below: acceptance well inside (0, 1), so rejections and residuals happen."""
    target, draft, head_dir = pair
    engine = Engine(target, draft, Settings.load(max_batch_size=256, draft_head=str(head_dir)))
    engine.add_requests([GenerationRequest(
        f"a{i}", PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True),
        SpeculationParams(method, 2)) for i in range(200)])
    drafted = accepted = 0
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                drafted += out.stats.draft_tokens
                accepted += out.stats.accepted_tokens
    assert 0.2 < accepted / drafted < 0.8


def p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value, pooling categories with expected count < 5 into one bin."""
    expected = probs.double() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].sum()[None].double()])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "ngram", "eagle"])
def test_speculative_sampling_matches_target_distribution(pair, method):
    first, second = exact_two_token_marginals(pair[0].model)
    got_first, got_second = empirical(pair, method)
    assert p_value(got_first, first) > P_VALUE
    assert p_value(got_second, second) > P_VALUE


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_always_accept_rule_is_detected(pair, monkeypatch, method):
    """Accepting every draft token returns the draft's distribution: the same check must fail. The
    head drafts from the second token on (the first step computes the prompt, whose target features it
    reads: admission.py `_join`), so its check fails there; the draft model's already at the first."""

    def always_accept(rows, target_probs, generators, greedy=None):
        tokens = []
        for row, gen in zip(rows, generators, strict=True):  # its bonus position is its last
            bonus = int(torch.multinomial(target_probs[row.positions[-1]], 1, generator=gen))
            tokens.append([*row.drafts, bonus])
        return Verdict(accepted=[row.k for row in rows], tokens=tokens)

    monkeypatch.setattr(verify_module, "rejection_sample", always_accept)
    first, second = exact_two_token_marginals(pair[0].model)
    got_first, got_second = empirical(pair, method)
    if method == "eagle":
        assert p_value(got_second, second) < 1e-6
    else:
        assert p_value(got_first, first) < 1e-6
