"""The EAGLE-style draft head: training helps, files round-trip, FR-Spec keeps q = 0 outside its
vocabulary, multi-step drafting over whole sequences equals step-by-step drafting with a cache, and
`python -m server distill` runs end to end and resumes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from server.draft_head.data import Sample, answer_batch, build_self_distilled, teacher_force
from server.draft_head.distill import choose_vocab
from server.draft_head.model import EagleHead
from server.draft_head.options import TrainOptions
from server.draft_head.train import _steps_within, held_out_acceptance, train_head
from server.draft_head.unroll import unrolled_features
from server.sampling import BatchSampling, probabilities
from server.types import SamplingParams
from tests.models import tiny_llama

VOCAB = 256


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread (a second one only adds synchronisation, which a busy CPU makes costly)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def token_driven_target(seed: int = 0):
    """A one-layer tiny Llama whose attention and MLP outputs are zeroed: its next token depends on the
    current token only, a function a head can learn in a few hundred steps on a CPU."""
    model = tiny_llama(VOCAB, seed=seed, layers=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def random_samples(model, count: int, seed: int) -> list[Sample]:
    """Teacher-forced random token sequences (4 prompt + 28 answer tokens) with the model's features."""
    gen = torch.Generator().manual_seed(seed)
    return [
        teacher_force(model, torch.randint(3, VOCAB, (4,), generator=gen).tolist(),
                      torch.randint(3, VOCAB, (28,), generator=gen).tolist())
        for _ in range(count)
    ]


@pytest.mark.slow
def test_training_beats_an_untrained_head(tmp_path):
    torch.manual_seed(0)
    target = token_driven_target()
    train, heldout = random_samples(target, 64, seed=1), random_samples(target, 16, seed=2)
    head = EagleHead.create(target, choose_vocab(train, VOCAB, VOCAB, {2}), "tiny", seed=0).requires_grad_(True)
    lm_head = target.lm_head.weight
    before = held_out_acceptance(head, heldout, lm_head)
    exports = []
    opts = TrainOptions(steps=200, batch_size=8, lr=3e-3, warmup_steps=10, eval_every=100, checkpoint_every=100,
                        train_depth=2)
    state = train_head(head, train, heldout, lm_head, opts, tmp_path / "ck.pt",
                       lambda h, s: exports.append(s.step), progress=False)
    after = held_out_acceptance(head, heldout, lm_head)
    assert exports == [100, 200] and state.step == 200
    assert after.positions == before.positions > 0
    assert after.per_position[0] > before.per_position[0] + 0.3
    assert after.tokens_per_pass > before.tokens_per_pass + 0.3


def _stepwise(head: EagleHead, sample: Sample, start: int, depth: int) -> list[torch.Tensor]:
    """Draft like an engine would: feed the real pairs (f_t, x_{t+1}) for t <= start with a cache, then
    the head's own features, one token per call. Returns the depth 1..depth features [H]."""
    ids, hidden = sample.ids.long()[None], sample.hidden.float()[None]
    cache = DynamicCache()
    pos = torch.arange(1, start + 2)[None]
    out, cache = head(hidden[:, : start + 1], ids[:, 1: start + 2], position_ids=pos, cache=cache, use_cache=True)
    feats = [out[0, -1]]
    for k in range(2, depth + 1):
        out, cache = head(feats[-1][None, None], ids[:, start + k: start + k + 1],
                          position_ids=torch.tensor([[start + k]]), cache=cache, use_cache=True)
        feats.append(out[0, -1])
    return feats


def test_unrolled_drafting_equals_stepwise_drafting_with_padding():
    target = tiny_llama(VOCAB, seed=3, layers=2)
    head = EagleHead.create(target, list(range(VOCAB)), "tiny", seed=1).eval()
    long, short = random_samples(target, 2, seed=4)
    short = Sample(ids=short.ids[:20], hidden=short.hidden[:20], prompt_len=short.prompt_len)
    hidden = torch.zeros(2, 32, target.config.hidden_size)
    ids = torch.zeros(2, 32, dtype=torch.long)
    for b, s in enumerate((long, short)):
        hidden[b, : len(s.ids)], ids[b, : len(s.ids)] = s.hidden.float(), s.ids.long()
    with torch.no_grad():
        outputs = unrolled_features(head, hidden, ids, torch.tensor([32, 20]), depth=3)
        for b, sample, start in ((0, long, 0), (0, long, 17), (0, long, 28), (1, short, 5), (1, short, 16)):
            for k, feat in enumerate(_stepwise(head, sample, start, 3), 1):
                torch.testing.assert_close(outputs[k - 1][b, start], feat, atol=1e-5, rtol=1e-4)


def test_save_load_round_trip_and_target_check(tmp_path):
    target = tiny_llama(VOCAB, seed=0)
    head = EagleHead.create(target, [5, 9, 2, 100], "tiny", seed=3).eval()
    sample = random_samples(target, 1, seed=5)[0]
    x, ids = sample.hidden.float()[None, :-1], sample.ids.long()[None, 1:]
    with torch.no_grad():
        expected, _ = head(x, ids)
    head.save_pretrained(tmp_path / "fp32", dtype=torch.float32)
    loaded = EagleHead.from_pretrained(tmp_path / "fp32", target)
    assert loaded.config.vocab_ids == [5, 9, 2, 100]
    assert torch.equal(loaded.lm_head_fr, target.lm_head.weight[[5, 9, 2, 100]])
    with torch.no_grad():
        assert torch.equal(loaded(x, ids)[0], expected)

    head.save_pretrained(tmp_path / "bf16")  # the default: half the bytes
    sizes = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("bf16", "fp32")}
    assert sizes["bf16"] < 0.6 * sizes["fp32"]
    small = EagleHead.from_pretrained(tmp_path / "bf16", target)
    assert small.fc.weight.dtype == torch.float32
    assert torch.equal(small.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["target_name"] == "tiny"

    with pytest.raises(ValueError, match="does not fit this target"):
        EagleHead.from_pretrained(tmp_path / "bf16", tiny_llama(VOCAB, seed=0, hidden=32))
    with pytest.raises(FileNotFoundError):
        EagleHead.from_pretrained(tmp_path / "missing", target)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.5, top_p=0.95, top_k=50)])
def test_q_is_zero_outside_the_fr_vocabulary(params):
    target = tiny_llama(VOCAB, seed=0)
    vocab_ids = [7, 3, 250, 2, 64]
    head = EagleHead.create(target, vocab_ids, "tiny", seed=0).eval()
    sample = random_samples(target, 1, seed=6)[0]
    with torch.no_grad():
        feats, _ = head(sample.hidden.float()[None, :-1], sample.ids.long()[None, 1:])
        q = probabilities(head.full_logits(head.fr_logits(feats)), BatchSampling.from_params([params], feats.device))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab_ids] = False
    assert q.shape == (1, feats.shape[1], VOCAB)
    assert torch.all(q[..., outside] == 0)
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:-1]))
    assert torch.all(q[..., vocab_ids].sum(-1) > 0.999)


def test_choose_vocab_keeps_stop_tokens_and_only_emitted_tokens():
    samples = [Sample(ids=torch.tensor([9, 9, 4, 4, 4, 5, 1], dtype=torch.int32),
                      hidden=torch.zeros(7, 2, dtype=torch.float16), prompt_len=2)]
    assert choose_vocab(samples, 16, 8, {2}) == [4, 1, 5, 2]  # 9 is prompt only; ties by id; stop appended
    assert choose_vocab(samples, 16, 2, {2}) == [4, 2]


@pytest.mark.slow
def test_distill_command_trains_exports_and_resumes(tmp_path, tokenizer):
    from server.__main__ import main

    model_dir = tmp_path / "tiny-model"
    tiny_llama(len(tokenizer), seed=0, hidden=32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"prompt": "Tell me about rivers."}\n{"prompt": "Say hi."}\n')
    out = tmp_path / "run"
    args = ["distill", "--out", str(out), "--target", str(model_dir), "--num-prompts", "6", "--max-new-tokens", "5",
            "--gen-batch-size", "4", "--heldout-prompts", str(heldout), "--fr-vocab", "64", "--checkpoint-every", "2",
            "--eval-every", "2", "--batch-size", "2", "--quiet", "--threads", "1"]
    assert main([*args, "--steps", "2"]) == 0
    first = json.loads((out / "head" / "config.json").read_text())
    assert first["training"]["steps"] == 2 and first["training"]["train_samples"] == 6
    assert len(first["vocab_ids"]) <= 64 and first["training"]["heldout_samples"] == 2
    assert main([*args, "--steps", "4", "--resume"]) == 0
    second = json.loads((out / "head" / "config.json").read_text())
    assert second["training"]["steps"] == 4
    assert second["training"]["tokens_seen"] > first["training"]["tokens_seen"]
    steps = [h["step"] for h in json.loads((out / "history.json").read_text())]
    assert steps[:2] == [2, 4]  # the resumed run kept the first run's history and went on from step 2
    with pytest.raises(ValueError, match="other prompts"):
        main([*args, "--steps", "4", "--num-prompts", "5"])


def test_draft_head_setting(tmp_path):
    from pydantic import ValidationError

    from server.config import Settings
    from server.draft_head import BUILTIN_HEAD

    assert Settings.load().resolved_draft_head() == BUILTIN_HEAD  # shipped for the built-in target
    assert (BUILTIN_HEAD / "model.safetensors").stat().st_size < 16 * 2**20
    assert Settings.load(target="/models/other").resolved_draft_head() is None
    no_head = tmp_path / "no-head.yaml"
    no_head.write_text("draft_head: null\n")
    assert Settings.load(no_head).resolved_draft_head() is None
    EagleHead.create(tiny_llama(VOCAB), [1, 2], "tiny").save_pretrained(tmp_path / "head")
    assert Settings.load(draft_head=str(tmp_path / "head")).resolved_draft_head() == tmp_path / "head"
    with pytest.raises(ValidationError, match="not a draft head directory"):
        Settings.load(draft_head=str(tmp_path))


@pytest.mark.slow
@pytest.mark.real_model
def test_shipped_head_loads_for_the_builtin_target():
    from server.config import Settings
    from server.draft_head import BUILTIN_HEAD
    from server.model.loading import load_model

    target = load_model(None, device="cpu", cache_dir=Settings.load().cache_dir)
    head = EagleHead.from_pretrained(BUILTIN_HEAD, target.model)
    assert head.config.target_name == "SmolLM2-135M-Instruct"
    assert target.tokenizer.eos_token_id in head.config.vocab_ids
    assert head.config.training["heldout_acceptance"][0] > 0.5  # the GPU-distilled head (docs/distill.md)
    # the shipped config was saved with Llama's default special ids, outside the decoder's one-token
    # vocabulary: transformers warned about them at every server start
    dcfg = head.decoder.config
    assert [k for k in dcfg.to_dict() if k.endswith("_token_id") and getattr(dcfg, k) is not None] == []


def test_last_layer_init_copies_the_targets_last_layer():
    target = tiny_llama(VOCAB, seed=0, layers=2)
    head = EagleHead.create(target, [1, 2], "tiny", init="last-layer")
    for name, value in target.model.layers[-1].state_dict().items():
        assert torch.equal(head.decoder.layers[0].state_dict()[name], value)
    with pytest.raises(ValueError, match="init must be"):
        EagleHead.create(target, [1, 2], "tiny", init="first-layer")


def test_auto_starts_from_the_heads_measured_acceptance():
    """`auto`'s prior for eagle drafts is the head's held-out first-draft acceptance when distill
    recorded it, and the proposer's default when a head records none (or nonsense)."""
    from server.speculation.eagle import EagleProposer

    target = tiny_llama(VOCAB)
    head = EagleHead.create(target, list(range(VOCAB)), "tiny", seed=0)
    assert EagleProposer(head, VOCAB).traits == EagleProposer.traits
    head.config.training["heldout_acceptance"] = [0.31, 0.25]
    assert EagleProposer(head, VOCAB).traits.confidence_priors == (0.31,)
    head.config.training["heldout_acceptance"] = [1.7]
    assert EagleProposer(head, VOCAB).traits == EagleProposer.traits


def _favour(model, token: int, bonus: float):
    """Make `model` emit `token` more often (a logit bonus), so tiny random models end answers."""
    def hook(_module, _inputs, logits):
        logits[..., token] += bonus
        return logits
    return model.lm_head.register_forward_hook(hook)


def test_answers_checked_every_few_steps_equal_answers_checked_every_step():
    """The GPU path (finished rows leave every few steps, tokens stay on the device) makes the same
    samples as the CPU path: each answer ends at its first stop token, with that token's feature."""
    target = tiny_llama(VOCAB, seed=3)
    _favour(target, 2, 3.0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 7, 5, 2, 6)]
    every_step = answer_batch(target, prompts, {2}, 20, check_every=1)
    every_fifth = answer_batch(target, prompts, {2}, 20, check_every=5)
    lengths = [len(s.ids) - s.prompt_len for s in every_step]
    assert min(lengths) < 20 and max(lengths) == 20  # some stopped early, some ran to the cap
    for a, b, p in zip(every_step, every_fifth, prompts, strict=True):
        assert a.ids.tolist() == b.ids.tolist() and a.prompt_len == b.prompt_len == len(p)
        assert a.hidden.shape == b.hidden.shape == (len(a.ids), target.config.hidden_size)
        assert torch.allclose(a.hidden.float(), b.hidden.float(), atol=1e-2)
        answer = a.ids[a.prompt_len:].tolist()
        assert 2 not in answer[:-1]  # nothing after a stop token is kept


def test_answering_stops_at_its_time_limit_and_resumes(tmp_path, tokenizer):
    target = tiny_llama(len(tokenizer), seed=0, hidden=32)
    prompts = [f"Question number {i}?" for i in range(6)]
    data = tmp_path / "data"
    kwargs = {"batch_size": 2, "max_new_tokens": 3, "progress": False}
    assert build_self_distilled(data, target, tokenizer, prompts, **kwargs, time_limit=0) == []
    whole = build_self_distilled(data, target, tokenizer, prompts, **kwargs)
    assert len(whole) == 6  # the stopped run left nothing behind that a resumed one trips over
    # Temperatures taken in turn, batch by batch: shard 0 greedy, shard 1 sampled.
    mixed = build_self_distilled(tmp_path / "mixed", target, tokenizer, prompts, **kwargs, temperature=[0.0, 5.0])
    assert [s.ids.tolist() for s in mixed[:2]] == [s.ids.tolist() for s in whole[:2]]
    assert [s.ids.tolist() for s in mixed[2:4]] != [s.ids.tolist() for s in whole[2:4]]


@pytest.mark.slow
def test_the_target_writes_prompts(tokenizer):
    """Magpie: fed its chat template up to the user's text, the target writes user messages; only whole
    (self-ended), new ones count, and writing ends when batches stop yielding any."""
    from server.draft_head.self_prompts import generate_prompts, pre_query_ids

    assert tokenizer.decode(pre_query_ids(tokenizer)).endswith("<|im_start|>user\n")
    target = tiny_llama(len(tokenizer), seed=0, hidden=32)
    assert generate_prompts(target, tokenizer, 4, batch_size=4, max_tokens=4) == []  # never ends a message
    _favour(target, tokenizer.eos_token_id, 9.0)
    first = generate_prompts(target, tokenizer, 12, batch_size=8, max_tokens=24, seed=1)
    assert len(first) == 12 and len({" ".join(p.lower().split()) for p in first}) == 12
    assert all(p and "<|im_end|>" not in p for p in first)
    again = generate_prompts(target, tokenizer, 12, batch_size=8, max_tokens=24, seed=1, exclude=first[:3])
    assert not set(first[:3]) & set(again) and len(again) == 12


def test_training_ends_within_its_time_limit(tmp_path):
    """With a time limit, the step count is cut to what the measured rate fits (here: none left after
    the first 25 steps), and the LR schedule follows the new count."""
    target = token_driven_target()
    train = random_samples(target, 16, seed=1)
    head = EagleHead.create(target, choose_vocab(train, VOCAB, VOCAB, {2}), "tiny", seed=0).requires_grad_(True)
    opts = TrainOptions(steps=60, batch_size=4, train_depth=1, eval_every=1000, checkpoint_every=1000,
                        time_limit=0.0)
    exported = []
    state = train_head(head, train, train[:2], None, opts, tmp_path / "checkpoint.pt",
                       lambda h, s: exported.append(s.step), progress=False)
    assert state.step == 26 and exported == [26]
    assert _steps_within(10.0, 1000, 100, 5.0, 100) == 200  # 20 steps/s, 5 s left
    assert _steps_within(10.0, 150, 100, 5.0, 100) == 150  # never more than asked
