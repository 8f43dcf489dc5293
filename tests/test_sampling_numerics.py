"""p is always a distribution, whatever extremes a request combines (issue: temperature 1e-300 gave
degenerate text), and the limits say what they should: greedy and top_k = 1 are one-hot at the best
token, a nucleus smaller than the best token's mass keeps only it.

A property test (hypothesis, derandomized: the same examples on every machine) over temperature,
top_p, top_k, min_p, the three penalties, logit_bias and min_tokens, with logits of ordinary and
extreme magnitude.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.sampling import BatchSampling, probabilities
from server.types import GREEDY_BELOW, SamplingParams

VOCAB = 32
WIDTH = 3

temperatures = st.one_of(
    st.sampled_from([0.0, 1e-300, 1e-40, GREEDY_BELOW / 2, GREEDY_BELOW, 1e-3, 0.7, 1.0, 2.0]),
    st.floats(min_value=0.0, max_value=2.0),
)
params = st.builds(
    SamplingParams,
    max_tokens=st.just(8),
    temperature=temperatures,
    top_p=st.one_of(st.sampled_from([1e-9, 0.01, 1.0]), st.floats(min_value=1e-6, max_value=1.0)),
    top_k=st.sampled_from([0, 1, 2, 5, VOCAB, VOCAB + 7, 2**31 - 1]),
    min_p=st.sampled_from([0.0, 0.05, 0.9, 1.0]),
    presence_penalty=st.floats(min_value=-2.0, max_value=2.0),
    frequency_penalty=st.floats(min_value=-2.0, max_value=2.0),
    repetition_penalty=st.sampled_from([0.01, 0.5, 1.0, 1.3, 100.0]),
    logit_bias=st.lists(st.tuples(st.integers(0, VOCAB - 1), st.floats(min_value=-100, max_value=100)), max_size=4)
    .map(tuple),
    min_tokens=st.integers(0, 4),
    stop_token_ids=st.sampled_from([(), (3,), (3, 4)]),
)
logit_scales = st.sampled_from([1e-6, 1.0, 30.0, 1e4])


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True)
@given(rows=st.lists(params, min_size=1, max_size=3), scale=logit_scales, seed=st.integers(0, 2**16))
def test_p_is_a_distribution_and_the_limits_hold(rows, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), WIDTH, VOCAB, generator=gen) * scale
    counts = torch.randint(0, 3, (len(rows), WIDTH, VOCAB), generator=gen).float()
    prompts = [tuple(range(5)) for _ in rows]
    sampling = BatchSampling.from_params(rows, torch.device("cpu"), generated=[1] * len(rows), eos_ids={2},
                                         prompts=prompts)
    p = probabilities(logits, sampling, counts if sampling.any_penalty else None)

    assert torch.isfinite(p).all() and (p >= 0).all()
    assert torch.allclose(p.sum(-1), torch.ones(len(rows), WIDTH), atol=1e-4)
    for b, sp in enumerate(rows):
        best_mass = p[b].max(-1).values
        if sp.greedy or sp.top_k == 1:
            assert torch.equal(best_mass, torch.ones(WIDTH)), "greedy / top_k=1 is one-hot"
        if sp.top_k and sp.top_k < VOCAB:
            assert ((p[b] > 0).sum(-1) <= sp.top_k).all(), "top_k keeps at most k tokens"
        if sp.min_tokens > 1:  # one token precedes position 0: EOS (2) cannot end the row there
            assert p[b, 0, 2] == 0


def test_a_temperature_that_would_overflow_is_greedy():
    logits = torch.tensor([[[1.0, 3.0, 2.0, -1.0]]])
    for t in (1e-300, 1e-40, GREEDY_BELOW / 10):
        sampling = BatchSampling.from_params([SamplingParams(temperature=t)], torch.device("cpu"))
        assert probabilities(logits, sampling)[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
