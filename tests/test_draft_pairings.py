"""The draft model in every pairing the CLI accepts beside every kind of target the server serves on a CPU.

`--draft target|DIR|FILE` x `--draft-dtype auto|float32|bfloat16|float16`, beside a GGUF target served as its
quantized blocks (the C decoder, and its torch path with `SPECULA_CPU_DECODER=0`), as int8 weights and as fp32
weights: on a copy-heavy prompt the draft drafts, its drafts are accepted, nothing fails safe, and greedy text is
the target's alone. The models are a tiny cycling Llama written as a real GGUF file (tests/models.py), so every
pairing goes through the loading path a user's does. A bf16 copy of a quantized target once failed at every step
(its mask in bfloat16 against float32 queries) and the fail-safe turned the method off without a word: these
tests cannot pass on a method that drafts nothing.
"""

from __future__ import annotations

import pytest
import torch

from server.config import Settings
from server.engine.engine import Engine
from server.model import cpu_kernels
from server.model.loading import load_draft_like, load_model
from server.model.weights_cache import entry_path
from server.speculation.draft_model import DraftCannotRun
from tests.engine_helpers import request, run_with_stats
from tests.models import as_loaded, tiny_llama, write_tiny_gguf

CYCLE = list(range(40, 60))  # token ids of the tiny GGUF's tokenizer the cycling model repeats
PROMPT = CYCLE[:9] + CYCLE[:4]  # copy-heavy: the text repeats itself


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The cycling GGUF (Q4_1 layers, Q8_0 table and head), a weights cache, the fp32 entry as a directory, and a
    smaller model of the same tokenizer as another file (one layer, Q8_0: a draft beside a target, as `-md`)."""
    root = tmp_path_factory.mktemp("pairings")
    gguf = write_tiny_gguf(root / "cycling.gguf", hidden=64, quant="Q4_1", cycle=CYCLE)
    small = write_tiny_gguf(root / "small.gguf", hidden=64, layers=1, quant="Q8_0", cycle=CYCLE)
    cache = root / "cache"
    load_model(str(gguf), device="cpu", weights="fp32", cache_dir=cache)  # writes the dequantized entry
    return {"file": str(gguf), "dir": str(entry_path(gguf, cache, "fp32")), "small": str(small), "cache": cache}


TARGETS = {  # name -> (weights, SPECULA_CPU_DECODER)
    "as-file": ("as-file", "1"),
    "as-file-torch-path": ("as-file", "0"),
    "int8": ("int8", "1"),
    "fp32": ("fp32", "1"),
}
DRAFTS = [("target", d) for d in ("auto", "float32", "bfloat16", "float16")] + \
    [("file", d) for d in ("auto", "bfloat16", "float16")] + [("dir", d) for d in ("float32", "bfloat16")] + \
    [("small", d) for d in ("auto", "bfloat16")]
FAST = {("as-file", "target", "bfloat16"), ("as-file", "small", "auto"), ("fp32", "target", "float16")}
PAIRINGS = [pytest.param(t, s, d, marks=() if (t, s, d) in FAST else pytest.mark.slow, id=f"{t}-{s}-{d}")
            for t in TARGETS for s, d in DRAFTS]


def engine_for(files, target_kind: str, source: str, dtype: str, monkeypatch) -> Engine:
    weights, decoder = TARGETS[target_kind]
    monkeypatch.setenv("SPECULA_CPU_DECODER", decoder)  # read when the target's forward is built (in the engine)
    target = load_model(files["file"], device="cpu", weights=weights, cache_dir=files["cache"])
    draft = load_draft_like(target, files.get(source, source), dtype=dtype, cache_dir=files["cache"])
    return Engine(target, draft, Settings.load(device="cpu", cache_dir=files["cache"]))


@pytest.mark.parametrize(("target_kind", "source", "dtype"), PAIRINGS)
def test_every_draft_pairing_drafts_is_accepted_and_keeps_the_targets_greedy_text(
    files, target_kind, source, dtype, monkeypatch
):
    engine = engine_for(files, target_kind, source, dtype, monkeypatch)
    plain = run_with_stats(engine, [request("plain", PROMPT, "none", max_tokens=24)])[0]["plain"]
    assert plain == (CYCLE[4:] + CYCLE)[:24]  # the target copies its cycle: a copy-heavy answer
    tokens, stats = run_with_stats(engine, [request("drafted", PROMPT, "draft", 4, max_tokens=24)])
    st = stats["drafted"]
    assert st.draft_tokens > 0 and st.accepted_tokens > 0 and st.by_proposer["draft"].accepted_tokens > 0
    assert tokens["drafted"] == plain
    assert st.fallbacks == [] and engine.parts.report() == {}  # nothing failed safe


@pytest.mark.parametrize("target_kind", [k if k == "as-file" else pytest.param(k, marks=pytest.mark.slow)
                                         for k in TARGETS])
def test_the_draft_runs_as_it_was_asked_for(files, target_kind, monkeypatch):
    """What each pairing makes: `target` in its own dtype (or auto) is the target's model itself, run over a cache
    of its own; in another dtype a dense copy computing in that dtype (its mask and cache too); a GGUF draft under
    `auto` runs its quantized blocks on the C decoder, as llama-server's `-md` does."""
    engine = engine_for(files, target_kind, "target", "auto", monkeypatch)
    draft = engine.proposer("draft")
    assert draft.draft.model is engine.target.model and draft.runner.dtype == engine.runner.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        engine = engine_for(files, target_kind, "target", str(dtype).removeprefix("torch."), monkeypatch)
        runner = engine.proposer("draft").runner
        assert runner.dtype == runner.kv.dtype == dtype and runner.model is not engine.target.model
        assert engine.target.model.dtype == torch.float32  # the target is untouched
    for file in ("file", "small"):
        file_draft = engine_for(files, target_kind, file, "auto", monkeypatch).proposer("draft")
        if cpu_kernels.library() is not None:  # the blocks' kernels build here (else auto serves the file dense)
            decoder = TARGETS[target_kind][1] == "1"  # SPECULA_CPU_DECODER=0 is every model's torch path
            assert file_draft.draft.weights == "as-file"
            assert file_draft.runner.forward_kind.endswith("+c-decoder") == decoder


def test_a_draft_file_whose_tokenizer_differs_is_refused_naming_both(files, tmp_path):
    target = load_model(files["file"], device="cpu", weights="as-file", cache_dir=files["cache"])
    other = write_tiny_gguf(tmp_path / "other-tokenizer.gguf", hidden=64, quant="Q4_1", cycle=CYCLE,
                            merges=("Ġ t", "h e"))
    with pytest.raises(ValueError, match="other-tokenizer.*cycling.*tokenizer"):
        load_draft_like(target, str(other), dtype="auto", cache_dir=files["cache"])


def test_a_draft_that_cannot_compute_stops_the_start_naming_it(tokenizer, tiny_target):
    """A pairing whose draft cannot run is a start-up error, not a method that fails safe at every step."""
    broken = tiny_llama(len(tokenizer), seed=4)
    layer = broken.model.layers[0].self_attn
    layer.q_proj.weight = torch.nn.Parameter(layer.q_proj.weight[:, :7].clone(), requires_grad=False)  # wrong shape
    with pytest.raises(DraftCannotRun, match="draft model 'broken-draft'.*cannot run here"):
        Engine(tiny_target, as_loaded(broken, tokenizer, "broken-draft"), Settings.load())
