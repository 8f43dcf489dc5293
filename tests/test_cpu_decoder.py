"""The decoder stack in one C call (server/model/cpu_decoder.py) on a block-quantized model.

It must compute the lean forward's function (the torch path agrees to float32 rounding; checked on float32
activations, where the two paths' only difference is the order of float sums), write the cache where the torch
path would (a step after either path reads the same keys), and give a position the same bits whatever else the
forward holds: fed alone or in a verify pass or a prompt chunk, beside other rows, after holes (on float32 and on
int8 activations: the Q4 products' `KIND_Q4_INT8`, where a float difference upstream would show as a step of an
activation's rounding).
"""

from __future__ import annotations

import os

import pytest
import torch

from server.model import cpu_kernels
from server.model.attention import use_gqa_attention
from server.model.cpu_decoder import KEY_RUN, CpuDecoder
from server.model.lean_forward import LeanForward
from server.model.quantize import quantize_linears
from server.model.runner import ModelRunner
from tests.models import tiny_llama

PROMPT = [(37 * i) % 900 + 50 for i in range(40)]
OTHER = [(11 * i) % 700 + 60 for i in range(90)]


def _quantized(tokenizer, int8: bool):
    """The tiny model on Q4 blocks, its kernels built on float32 or int8 activations (kept on its layers)."""
    if cpu_kernels.library() is None:
        if os.environ.get("CI"):
            pytest.fail("the float32 block kernels did not build (see the log for why)")
        pytest.skip("the float32 block kernels do not build here")
    m = tiny_llama(len(tokenizer), seed=3)
    quantize_linears(m, "q4")
    use_gqa_attention(m)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULA_INT8_ACTIVATIONS", "1" if int8 else "0")
        ModelRunner(m)  # its lean forward, kernels and decoder, kept on the model
    return m


@pytest.fixture(scope="module", autouse=True)
def _float_activations():
    """Kernels built in these tests (the torch path's copies of a lean forward) take float32 activations."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULA_INT8_ACTIVATIONS", "0")
        yield


@pytest.fixture(scope="module")
def model(tokenizer, _float_activations):
    return _quantized(tokenizer, int8=False)


@pytest.fixture(scope="module")
def int8_model(tokenizer, _float_activations):
    return _quantized(tokenizer, int8=True)


@pytest.fixture(params=["float32", "int8"])
def either(request):
    """The model on float32 activations, then on int8 ones."""
    return request.getfixturevalue("model" if request.param == "float32" else "int8_model")


ROUNDINGS = [None, torch.float16, torch.bfloat16]  # the cache's dtype (kv_cache_dtype): the model's, or narrower


def _runner(model, decoder: bool, kv_dtype: torch.dtype | None = None) -> ModelRunner:
    runner = ModelRunner(model, kv_dtype=kv_dtype)
    forward = runner.call
    assert isinstance(forward, LeanForward) and forward.decoder is not None
    if not decoder:  # the same forward's torch path: a copy without the decoder
        forward = LeanForward(model, forward.base)
        forward.decoder = None
        runner.call = forward
    return runner


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a sequence of forwards covering padded and packed passes, holes and a second row."""
    runner.join(["a", "b"], [PROMPT, OTHER])
    out = [runner.forward([[5], [6]]).logits]
    out.append(runner.forward([[7, 8, 9], [10]]).logits)  # packed
    runner.rollback(0, 2)  # holes in row a
    out.append(runner.forward([[11, 12], [13, 14]]).logits)  # padded
    out.append(runner.forward([[15] * 6, [16] * 6], hidden=True, layers=(1,)).layers[1])
    return out


@pytest.mark.parametrize("kv_dtype", ROUNDINGS)
def test_the_decoder_computes_the_lean_forwards_function(model, kv_dtype):
    fast, slow = _runner(model, True, kv_dtype), _runner(model, False, kv_dtype)
    # a 16-bit cache: a key or value the paths' rounding put one step apart moves the logits by more than float32's
    # rounding does (measured: up to 2.3e-5 of the largest logit with float16, 1e-5 with bfloat16, 3.5e-6 float32)
    tolerance = 2e-5 if kv_dtype is None else 6e-5
    for a, b in zip(_steps(fast), _steps(slow), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=tolerance * float(b.abs().max()))
    # both write every live key and value in the cache's dtype, the same values but where the paths' float32
    # rounding put one on the other side of a rounding boundary (one step of it, or float32's difference itself
    # for values near zero)
    for mine, theirs in zip(fast.kv.cache.layers, slow.kv.cache.layers, strict=True):
        for x, y in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert x.dtype == y.dtype == (kv_dtype or torch.float32)
            live = fast.kv.keep[:, : fast.kv.length]  # holes hold whatever a pass left there
            x = x[:, :, : fast.kv.length].transpose(1, 2)[live].float()
            y = y[:, :, : slow.kv.length].transpose(1, 2)[live].float()
            eps = torch.finfo(kv_dtype or torch.float32).eps
            assert torch.allclose(x, y, rtol=eps, atol=2e-5 * float(y.abs().max()))
            if kv_dtype is not None:
                assert float((x != y).float().mean()) < 0.01


def test_every_pass_runs_the_decoder_steps_and_prompt_chunks_short_or_deep(model, monkeypatch):
    runner = _runner(model, True)
    calls = []
    original = CpuDecoder.__call__
    monkeypatch.setattr(CpuDecoder, "__call__", lambda self, *a: calls.append(a[0].shape) or original(self, *a))
    runner.join(["a"], [PROMPT])  # a 40-token chunk
    assert len(calls) == 1
    runner.forward([[5, 6, 7]])
    assert len(calls) == 2
    long = [(29 * i) % 900 + 40 for i in range(KEY_RUN + 20)]
    runner.join(["b"], [long], chunk=KEY_RUN + 20)  # one chunk over more columns than a key run
    assert len(calls) == 3
    runner.forward([long[:40], [6]])  # a prompt chunk beside a decoding row
    assert len(calls) == 4


@pytest.mark.parametrize("kv_dtype", [None, torch.float16])
def test_decoding_rows_beside_a_deep_prompt_chunk_keep_their_bits(either, kv_dtype):
    """A step that carries a prompt chunk deep into a long prompt (chunked prefill beside streaming chats): a
    decoding row's logits are the same bits as in a step without the chunk, and the chunk's row computes the torch
    path's function (to float32 rounding, and the cache's)."""
    deep = [(29 * i) % 900 + 40 for i in range(KEY_RUN + 30)]
    chunk = [(17 * i) % 800 + 60 for i in range(40)]
    tail = [(13 * i) % 800 + 70 for i in range(6)]

    def runner(decoder: bool = True) -> ModelRunner:
        r = _runner(either, decoder, kv_dtype)
        r.join(["a"], [PROMPT])
        r.join(["long"], [deep], chunk=len(deep))
        return r

    beside = runner()
    mixed = beside.forward([tail[:3], chunk], scored=[3, 1])  # a row's verify pass beside the chunk
    steps = beside.forward([tail[3:], [5]]).logits[0]  # and the next step
    plain = runner().forward([tail[:3], [5]], scored=[3, 1])  # the same pass beside a one-token row
    assert torch.equal(mixed.of_rows([0])[0], plain.of_rows([0])[0])
    if either is not model:
        return  # the torch path's function on float32 activations (the docstring says why)
    torch_only = runner(decoder=False)
    reference = torch_only.forward([tail[:3], chunk], scored=[3, 1])
    long_mixed, _ = mixed.of_rows([1])
    long_ref, _ = reference.of_rows([1])
    tolerance = 2e-5 if kv_dtype is None else 6e-5  # test_the_decoder_computes_the_lean_forwards_function says why
    assert torch.allclose(long_mixed, long_ref, rtol=0, atol=tolerance * float(long_ref.abs().max()))
    follow = torch_only.forward([tail[3:], [5]]).logits[0]
    # the next step reads the chunk's 40 keys and values, each path's own roundings of them (measured: 2.3e-6 of the
    # largest logit with a float32 cache, 6.1e-5 with float16)
    tolerance = 2e-5 if kv_dtype is None else 1.5e-4
    assert torch.allclose(steps, follow, rtol=0, atol=tolerance * float(follow.abs().max()))


def test_a_prompt_gets_the_same_bits_however_it_is_chunked(either):
    """A prompt's positions do not depend on the chunks a step's token budget cuts it into (across the attention's
    key runs too), so what follows it does not depend on the budget."""
    long = [(37 * i) % 900 + 50 for i in range(2 * KEY_RUN + 40)]
    logits = []
    for chunk in (1024, 7, 32, KEY_RUN + 1):
        runner = _runner(either, True)
        runner.join(["a"], [long], chunk=chunk)
        logits.append(runner.forward([[5, 6]]).logits)
    assert all(torch.equal(logits[0], other) for other in logits[1:])


@pytest.mark.parametrize("kv_dtype", ROUNDINGS)
@pytest.mark.parametrize("length", [40, 505])
def test_a_position_gets_the_same_bits_in_any_pass_beside_any_rows(either, length, kv_dtype):
    """Fed one token at a time beside a longer row, or in one pass alone, or after holes and a compaction:
    each position's logits are the same bits (what greedy exactness across proposers rests on). 505 tokens of
    prompt: the queries' keys cross a run of the C attention's (256) during the tail."""
    PROMPT = [(37 * i) % 900 + 50 for i in range(length)]  # noqa: N806
    tail = [(13 * i) % 800 + 70 for i in range(12)]
    singly = _runner(either, True, kv_dtype)
    singly.join(["a", "long"], [PROMPT, OTHER])  # prefilled together, in one pass
    one = torch.cat([singly.forward([[t], [7]]).logits[0, :1] for t in tail])

    together = _runner(either, True, kv_dtype)
    together.join(["a"], [PROMPT])
    wide = together.forward([tail]).logits[0]
    assert torch.equal(one, wide)

    holes = _runner(either, True, kv_dtype)
    holes.join(["a"], [PROMPT])
    holes.join(["long"], [OTHER])
    got = []
    for t in tail:  # every token first fed beside 3 rejected drafts, then kept alone
        holes.forward([[t, 1, 2, 3], [9]])
        holes.rollback(0, 4)
        holes.rollback(1, 1)
        got.append(holes.forward([[t], [9, 9]]).logits[0, :1])
    holes.kv.compact()
    assert torch.equal(torch.cat(got), one)
    after = holes.forward([[4], [9]]).logits[0, :1]
    singly.leave({"long"})
    assert torch.equal(after, singly.forward([[4]]).logits[0])


def test_the_decoder_can_be_turned_off_and_calibration_tells_the_forwards_apart(model, tokenizer, monkeypatch):
    assert "+c-decoder" in ModelRunner(model).forward_kind
    monkeypatch.setenv("SPECULA_CPU_DECODER", "0")
    other = tiny_llama(len(tokenizer), seed=3)
    quantize_linears(other, "q4")
    use_gqa_attention(other)
    runner = ModelRunner(other)
    assert runner.call.decoder is None and "+c-decoder" not in runner.forward_kind


def test_int8_activations_stay_within_their_rounding_of_float32_ones(model, int8_model):
    """The same weights on int8 activations: the forward kind says so (calibration keys it), and the logits stay
    close to the float32 activations' (each activation is off by at most half a step of its group's scale)."""
    assert "+q8-act-blocks" in ModelRunner(int8_model).forward_kind
    assert "+f32-blocks" in ModelRunner(model).forward_kind
    logits = []
    for m in (model, int8_model):
        runner = _runner(m, True)
        runner.join(["a"], [PROMPT])
        logits.append(runner.forward([[5, 6, 7]]).logits)
    exact, int8 = logits
    assert not torch.equal(exact, int8)
    # two layers of random weights amplify the roundings (measured: 11% of the largest logit here; SmolLM2-135M's
    # Q4_1 file on a real prompt: 6%, the same greedy tokens, KL 3e-5 to 0.025 nats a position)
    assert float((int8 - exact).abs().max()) < 0.2 * float(exact.abs().max())
    assert (int8.argmax(-1) == exact.argmax(-1)).all()
