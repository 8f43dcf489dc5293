"""Sampling controls beyond temperature/top-p (min_tokens, logit_bias, min_p, repetition_penalty):
exact cases on `probabilities`, and greedy output identical with and without speculation (every verify
position gets the mask/penalty of its own history, so speculation stays lossless)."""

from __future__ import annotations

import pytest
import torch

from server.config import Settings
from server.engine.engine import Engine
from server.sampling import BatchSampling, probabilities
from server.types import SamplingParams
from tests.engine_helpers import request, run

CPU = torch.device("cpu")
V = 8
EOS = 2


def greedy_p(logits: torch.Tensor, params: list[SamplingParams], **context) -> torch.Tensor:
    return probabilities(logits, BatchSampling.from_params(params, CPU, **context))


def test_min_tokens_masks_stop_tokens_per_verify_position():
    logits = torch.zeros(2, 4, V)
    logits[..., EOS] = 5.0  # EOS is everyone's argmax
    logits[..., 6] = 4.0  # a stop token id of row 1
    logits[..., 3] = 3.0
    params = [
        SamplingParams(max_tokens=9, temperature=0, min_tokens=5),
        SamplingParams(max_tokens=9, temperature=0, min_tokens=2, stop_token_ids=(6,)),
    ]
    p = greedy_p(logits, params, generated=[3, 0], eos_ids={EOS})
    # Row 0 has 3 tokens: positions 0, 1 follow 3 and 4 tokens (< 5): EOS masked; 2, 3 follow 5, 6.
    assert p[0].argmax(-1).tolist() == [6, 6, EOS, EOS]  # (6 is not a stop token of row 0)
    # Row 1 has none: positions 0, 1 mask EOS and its stop token 6.
    assert p[1].argmax(-1).tolist() == [3, 3, EOS, EOS]
    # Without the row's history (a draft's q), nothing is masked.
    assert greedy_p(logits, params).argmax(-1).tolist() == [[EOS] * 4] * 2


def test_min_tokens_with_ignore_eos_masks_only_stop_token_ids():
    logits = torch.zeros(1, 2, V)
    logits[..., EOS] = 5.0
    logits[..., 6] = 6.0
    params = [SamplingParams(max_tokens=9, temperature=1.0, min_tokens=1, ignore_eos=True, stop_token_ids=(6,))]
    p = greedy_p(logits, params, generated=[0], eos_ids={EOS})
    assert p[0, 0, 6] == 0 and p[0, 0, EOS] > 0.5  # position 0 follows 0 tokens: 6 masked, EOS free
    assert p[0, 1, 6] > 0.5


def test_logit_bias_applies_to_greedy_and_sampled_rows_and_leaves_logits_alone():
    logits = torch.zeros(2, 2, V)
    logits[..., 1] = 1.0
    before = logits.clone()
    params = [
        SamplingParams(temperature=0, logit_bias=((4, 2.0),)),
        SamplingParams(temperature=1.0, logit_bias=((1, -100.0),)),
    ]
    p = greedy_p(logits, params)
    assert p[0].argmax(-1).tolist() == [4, 4]
    assert float(p[1, 0, 1]) < 1e-30 and torch.allclose(p[1, 0].sum(), torch.tensor(1.0))
    assert torch.equal(logits, before)  # the raw logits feed logprobs afterwards: never modified


def test_min_p_drops_tokens_below_the_threshold():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]]]) + 1e-12)
    p = greedy_p(logits, [SamplingParams(temperature=1.0, min_p=0.2)])  # threshold 0.1
    assert (p[0, 0, :3] > 0).all() and (p[0, 0, 3:] == 0).all()
    assert torch.allclose(p[0, 0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_repetition_penalty_counts_prompt_output_and_earlier_drafts():
    logits = torch.tensor([[[2.0, -1.0, 1.0, 0, 0, 0, 0, 0]] * 2])  # [1, 2, V]
    params = [SamplingParams(temperature=1.0, repetition_penalty=2.0)]
    sampling = BatchSampling.from_params(params, CPU, prompts=[(0,)])
    counts = torch.zeros(1, 2, V)
    counts[0, 1, 1] = 1  # a draft token 1 precedes position 1
    p = probabilities(logits, sampling, counts)
    expected0 = torch.softmax(torch.tensor([1.0, -1.0, 1.0, 0, 0, 0, 0, 0]), -1)  # prompt token 0: 2 / 2
    expected1 = torch.softmax(torch.tensor([1.0, -2.0, 1.0, 0, 0, 0, 0, 0]), -1)  # and token 1: -1 * 2
    assert torch.allclose(p[0, 0], expected0) and torch.allclose(p[0, 1], expected1)


def test_each_verify_position_as_its_own_row_gives_the_padded_p():
    """The engine reads p row after row, k + 1 positions a row (`at_positions`): every control that
    depends on the row (bias, penalties, the nucleus) or on the position (min_tokens) gives, position by
    position, the p the padded layout [rows, W, vocab] gives."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4]
    logits = torch.randn(3, 4, V, generator=gen) * 2
    counts = torch.randint(0, 2, (3, 4, V), generator=gen).float()
    params = [
        SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3, min_tokens=4, logit_bias=((5, 3.0),)),
        SamplingParams(temperature=0, presence_penalty=0.5, logit_bias=((1, -2.0), (6, 1.0))),
        SamplingParams(temperature=1.2, top_p=0.6, frequency_penalty=0.4, min_tokens=2, stop_token_ids=(6,)),
    ]
    sampling = BatchSampling.from_params(params, CPU, generated=[2, 0, 1], eos_ids={EOS}, prompts=[(0, 3), (4,), ()])
    padded = probabilities(logits, sampling, counts)
    flat = lambda x: torch.cat([x[b, :n] for b, n in enumerate(lengths)])  # noqa: E731
    at = sampling.at_positions(lengths)
    per_position = probabilities(flat(logits)[:, None], at, flat(counts)[:, None])[:, 0]
    torch.testing.assert_close(per_position, flat(padded))
    assert at.generated.tolist() == [2, 3, 4, 0, 1, 2, 3, 4]  # position j of a row follows j more tokens


def test_repetition_penalty_without_prompts_is_refused():
    with pytest.raises(ValueError, match="prompts"):
        BatchSampling.from_params([SamplingParams(repetition_penalty=1.2)], CPU)


def eos_id(engine: Engine) -> int:
    return min(engine.eos_ids)


CONTROLS = [
    pytest.param({"min_tokens": 5, "logit_bias": "eos+100"}, id="min_tokens-forced-eos"),
    pytest.param({"min_tokens": 7, "logit_bias": "eos+4"}, id="min_tokens-likely-eos"),
    pytest.param({"min_tokens": 3, "logit_bias": "eos+6"}, id="min_tokens-3"),
    pytest.param({"repetition_penalty": 0.5}, id="repetition-below-1-repeats"),
    pytest.param({"repetition_penalty": 1.5, "presence_penalty": 0.5}, id="repetition-and-presence"),
    pytest.param({"logit_bias": "argmax-100"}, id="logit_bias-bans-first-token"),
]


def _params(engine: Engine, prompt: list[int], spec: dict, reference: list[int]) -> dict:
    params = dict(spec)
    if params.get("logit_bias") == "argmax-100":
        params["logit_bias"] = ((reference[0], -100.0),)
    elif isinstance(params.get("logit_bias"), str):
        params["logit_bias"] = ((eos_id(engine), float(params["logit_bias"].split("+")[1])),)
    return params


@pytest.mark.slow
@pytest.mark.parametrize("spec", CONTROLS)
def test_greedy_output_is_identical_with_and_without_speculation(
    tiny_target, tiny_draft, prompt_ids, greedy_reference, spec
):
    outputs = {}
    for method, k in (("none", 1), ("ngram", 8), ("draft", 5), ("auto", 8)):
        engine = Engine(tiny_target, tiny_draft, Settings.load())
        requests = [
            request(f"r{i}", p, method, k, max_tokens=14, ignore_eos=False,
                    **_params(engine, p, spec, greedy_reference[f"r{i}"]))
            for i, p in enumerate(prompt_ids)
        ]
        outputs[method] = run(engine, requests)
    assert outputs["ngram"] == outputs["none"]
    assert outputs["draft"] == outputs["none"]
    assert outputs["auto"] == outputs["none"]
    eos = eos_id(engine)
    for i in range(len(prompt_ids)):
        tokens = outputs["none"][f"r{i}"]
        if "min_tokens" in spec:
            assert eos not in tokens[: spec["min_tokens"]]
            if spec["logit_bias"] == "eos+100":  # EOS wins as soon as it is allowed
                assert tokens == [*tokens[:5], eos] and len(tokens) == 6
        if spec.get("logit_bias") == "argmax-100":
            assert tokens[0] != greedy_reference[f"r{i}"][0]
    if spec.get("repetition_penalty", 1.0) < 1:  # (the random model never repeats by itself) it changed the text
        assert any(out != greedy_reference[rid][: len(out)] for rid, out in outputs["none"].items())


def test_repeated_logit_bias_entries_add_up():
    logits = torch.zeros(1, 1, V)
    params = [SamplingParams(temperature=1.0, logit_bias=((3, 1.0), (3, 1.0), (5, -1.0)))]
    p = greedy_p(logits, params)[0, 0]
    expected = torch.softmax(torch.tensor([0, 0, 0, 2.0, 0, -1.0, 0, 0]), -1)
    assert torch.allclose(p, expected)
