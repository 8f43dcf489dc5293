"""The memory gauges (`Engine.memory_usage`, `specula_memory_bytes{part}`; server/engine/memory.py) equal
the bytes of the tensors each part is made of, and together they hold every tensor the engine keeps: a
part that went missing (or a cache that kept buffers it no longer uses) fails here."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from server.config import Settings
from server.draft_head.model import EagleHead
from server.engine.engine import Engine
from server.engine.memory import PARTS, StepMemory
from server.metrics import Metrics
from server.model.lean_forward import LeanForward
from server.model.memory import PeakTensorBytes, rss_bytes, tensor_bytes
from server.model.runner import ModelRunner
from tests.engine_helpers import request, run

# What the engine may hold besides its parts: bookkeeping (keep masks, empty placeholders, sampling tables)
SLACK_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def head_dir(tiny_target, tmp_path_factory):
    vocab = tiny_target.model.config.vocab_size
    head = EagleHead.create(tiny_target.model, list(range(0, vocab, 2)), "tiny-target", seed=0)
    path = tmp_path_factory.mktemp("head")
    head.save_pretrained(path, dtype=torch.float32)
    return path


def reachable_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through objects (not through classes, modules or functions)."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.CodeType, types.FrameType)
    seen: set[int] = set()
    stack, found = [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        stack.extend(gc.get_referents(obj))
    return found


def storages(tensors) -> int:
    return tensor_bytes(tensors)


def every_part_measured(engine: Engine) -> dict[str, int]:
    """The parts, each checked against the tensors it is made of."""
    parts = engine.memory.usage()
    assert tuple(parts) == PARTS
    seen: set = set()
    target = engine.runner
    weights = [*target.model.parameters(), *target.model.buffers(), *target.call.packed_weights()]
    assert parts["weights"] == tensor_bytes(weights, seen)
    assert parts["kv_cache"] == sum(s.numel() * s.element_size() for s in target.kv.storage())
    seen.update((str(s.device), s.untyped_storage().data_ptr()) for s in target.kv.storage())
    blocks = list(engine.admission.prefixes._blocks.values())
    assert parts["prefix_cache"] == engine.admission.prefixes.used_bytes == sum(b.nbytes for b in blocks)
    proposer_tensors = [t for p in engine.planner.proposers.values() for t in p.weight_tensors()]
    for model in engine.planner.model_runners():  # the proposers' own caches
        proposer_tensors += model.kv.storage()
    eagle = engine.proposer("eagle")
    proposer_tensors += [f for p in eagle.pending.values() for f in p.features]
    proposer_tensors += [f for s in engine.running.values() for f in (s.features or ())]
    suffix = engine.proposer("suffix").cache_bytes(set())
    assert parts["proposers"] == tensor_bytes(proposer_tensors, seen) + suffix
    assert parts["activations"] == engine.memory.step.peak > 0
    assert parts["runtime"] > 0
    return parts


@pytest.mark.slow
def test_the_gauges_are_the_tensors_bytes_and_hold_every_tensor_the_engine_keeps(
    tiny_target, tiny_draft, head_dir, prompt_ids
):
    per_token = sum(ModelRunner.kv_shape(m.model).bytes_per_token for m in (tiny_target, tiny_draft))
    settings = Settings.load(draft_head=str(head_dir), kv_cache_memory=str(2000 * per_token),
                             prefix_cache_memory="4MiB", max_batch_size=4)
    engine = Engine(tiny_target, tiny_draft, settings)
    assert isinstance(engine.runner.call, LeanForward)
    engine.memory.measure(tiny_target.model, engine.vocab_size, engine.planner.needs_hidden, 4, 17)
    engine.memory.settle()
    assert engine.memory.step.per_token > 0 and engine.memory.step.per_position > 0
    # at start: the process's RSS is the sum of the parts but the steps' working memory (none runs)
    parts = every_part_measured(engine)
    resident = sum(v for k, v in parts.items() if k != "activations")
    assert abs(resident - rss_bytes()) < 64 * 2**20

    finished = [request(f"done-{m}", prompt_ids[1] * 3, m, k=4, max_tokens=12) for m in ("eagle", "suffix")]
    run(engine, finished)  # into the prefix cache and suffix's global index
    methods = ["eagle", "draft", "ngram", "suffix"]
    for i, method in enumerate(methods):  # rows in flight: every cache holds something
        engine.add_requests([request(f"run-{i}", prompt_ids[i % len(prompt_ids)] * 4, method, k=4, max_tokens=40)])
    for _ in range(3):
        engine.step()
    assert len(engine.running) == len(methods)
    parts = every_part_measured(engine)
    assert parts["prefix_cache"] > 0 and parts["proposers"] > 0
    assert engine.proposer("suffix").cache_bytes(set()) > 0

    # Nothing tensor-shaped is held outside the parts (bookkeeping aside): a forgotten cache fails here.
    held = storages(reachable_tensors(engine))
    counted = parts["weights"] + parts["kv_cache"] + parts["prefix_cache"] + parts["proposers"]
    counted -= engine.proposer("suffix").cache_bytes(set())  # numpy arrays, not tensors
    assert counted <= held <= counted + SLACK_BYTES, (held, counted)


def test_an_idle_cache_without_a_budget_frees_its_buffers(tiny_target, tiny_draft, prompt_ids):
    """Every row gone: the cache's storage goes, and so do the views of it that would keep it alive."""
    engine = Engine(tiny_target, tiny_draft, Settings.load(prefix_cache_memory=None))
    run(engine, [request(f"r{i}", p * 4, "ngram", max_tokens=8) for i, p in enumerate(prompt_ids)])
    assert engine.memory.usage()["kv_cache"] == 0
    held = storages(reachable_tensors(engine))
    assert held <= engine.memory.usage()["weights"] + engine.memory.usage()["proposers"] + SLACK_BYTES


def test_the_heap_is_trimmed_when_the_cache_moves_into_a_bigger_buffer_not_when_it_frees(tiny_target, prompt_ids):
    engine = Engine(tiny_target, None, Settings.load(prefix_cache_memory=None, speculation="none",
                                                     max_num_batched_tokens=512))
    trims: list[int] = []
    engine.memory._trim_heap = lambda: trims.append(engine.memory.usage()["kv_cache"])
    engine.add_requests([request("a", prompt_ids[0], "none", max_tokens=4)])
    engine.step()  # its short prompt is computed by its first step
    assert len(trims) == 1  # the cache's first storage
    engine.add_requests([request("b", (prompt_ids[3] * 30)[:300], "none", max_tokens=4)])
    engine.step()  # its prompt is computed by one step (within the step's budget of 512 tokens)
    assert len(trims) == 2 and trims[-1] > trims[0]  # a longer row: a bigger buffer
    while engine.has_unfinished():
        engine.step()
    assert engine.memory.usage()["kv_cache"] == 0 and len(trims) == 2  # the batch emptied: no trim (idle does it)


def test_the_peak_keeps_a_grown_cache_that_no_scrape_saw(tiny_target, prompt_ids):
    """A long row comes and goes between two scrapes: `peak` still holds the parts at its cache's largest (the
    engine measures them when the cache grows, the old storage counted beside the new: both are resident until
    the heap is trimmed), which is what a peak RSS is held to (the soak)."""
    engine = Engine(tiny_target, None, Settings.load(prefix_cache_memory=None, speculation="none",
                                                     max_num_batched_tokens=512))
    assert engine.memory.peak() == {}
    engine.add_requests([request("short", prompt_ids[0], "none", max_tokens=30)])
    engine.step()
    before = engine.runner.kv.nbytes  # the short row's storage, moved when the long row joins
    assert before > 0
    engine.add_requests([request("long", (prompt_ids[3] * 30)[:300], "none", max_tokens=4)])
    largest = 0
    while engine.has_unfinished():
        engine.step()
        largest = max(largest, engine.runner.kv.nbytes)
    assert engine.memory.usage()["kv_cache"] == 0  # they left: a scrape now sees no cache
    peak = engine.memory.peak()
    assert largest >= ModelRunner.kv_shape(tiny_target.model).bytes_per_token * 300
    assert peak["kv_cache"] == largest + before
    assert set(peak) == set(engine.memory.usage())


def test_a_long_prompt_is_computed_within_the_step_budget_and_a_cached_one_loads_into_a_scratch_cache(
    tiny_target, prompt_ids
):
    """A 700-token prompt is computed in chunks: no pass computes more than the step's budget (the working
    memory is the budget's, not the prompt's). The same prompt again loads its cached blocks into a scratch
    cache sized to them (not doubled), which counts as working memory."""
    engine = Engine(tiny_target, None, Settings.load(speculation="none", max_num_batched_tokens=256))
    computed: list[int] = []
    observe = engine.memory.observe_verify
    engine.memory.observe_verify = lambda tokens, positions: (computed.append(tokens), observe(tokens, positions))
    prompt = (prompt_ids[3] * 40)[:700]
    engine.add_requests([request("long", prompt, "none", max_tokens=4)])
    prefilled = 0
    while engine.has_unfinished():
        prefilled += engine.step().prefill_tokens
    assert prefilled == len(prompt) - 1 and max(computed) <= 256 and len(computed) >= 3 + 3
    engine.add_requests([request("again", prompt, "none", max_tokens=4)])
    engine.step()
    per_token = ModelRunner.kv_shape(tiny_target.model).bytes_per_token
    cached = (len(prompt) - 1) // 16 * 16
    assert engine.running["again"].stats.cached_tokens == cached
    assert engine.runner.join_bytes == 2 * cached * per_token  # the scratch cache and the blocks it loaded
    assert engine.memory.step.high_water >= engine.runner.join_bytes
    assert engine.memory.usage()["activations"] >= engine.runner.join_bytes


def test_step_memory_is_per_token_and_per_position():
    memory = StepMemory(per_token=10, per_position=1000)
    memory.plan(rows=4, positions_per_row=3)
    assert memory.planned == 12 * 10 + 12 * 1000 and memory.peak == memory.planned
    memory.observe(tokens=100, positions=0, extra=50_000)
    assert memory.high_water == 51_000 and memory.peak == 51_000


def test_peak_tensor_bytes_counts_what_is_alive_at_once():
    with PeakTensorBytes() as peak:
        a = torch.zeros(1000)  # 4000 bytes
        b = a + 1  # 8000 at once
        del a
        c = b[:10]  # a view: nothing new
        d = torch.ones(500)  # 4000 + 2000
        del b, c, d
    assert peak.peak == 8000 and peak.live == 0


def test_metrics_export_the_parts_their_peak_and_the_process_rss():
    metrics = Metrics("m", "t", None, "none", 4, ("none",))
    metrics.watch_memory(lambda: {"weights": 10, "kv_cache": 20}, lambda: {"weights": 10, "kv_cache": 50})
    text = metrics.render()[0].decode()
    assert 'specula_memory_bytes{model="m",part="weights"} 10.0' in text
    assert 'specula_memory_bytes{model="m",part="kv_cache"} 20.0' in text
    assert 'specula_memory_peak_bytes{model="m",part="kv_cache"} 50.0' in text
    assert "process_resident_memory_bytes" in text

    def broken() -> dict[str, int]:
        raise RuntimeError("no")

    other = Metrics("m", "t", None, "none", 4, ("none",))
    other.watch_memory(broken)
    assert "specula_memory_bytes" in other.render()[0].decode()  # the scrape itself still works


def test_a_prompt_far_beyond_the_context_is_refused_before_it_is_tokenized_whole(tokenizer):
    """The tokenizer's output costs ~500 bytes a token while it exists: a multi-megabyte prompt is refused
    from its first part, and a prompt within the context is tokenized as it always was."""
    from server.api.errors import APIError
    from server.api.prompts import HEAD_CHARS_PER_TOKEN, ModelInfo, encode
    from server.types import ServingLimits

    calls: list[int] = []

    def counting(text, **kwargs):
        calls.append(len(text))
        return tokenizer(text, **kwargs)

    info = ModelInfo("m", counting, ServingLimits(max_context=256, vocab_size=len(tokenizer), methods=("none",)),
                     "none", 4, 16, 16)
    huge = "a " * 500_000  # 1 MB, 500k tokens
    with pytest.raises(APIError) as refused:
        encode(info, huge, "prompt")
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert calls == [HEAD_CHARS_PER_TOKEN * 257]  # only its head was tokenized
    calls.clear()
    text = "The quick brown fox. " * 20
    assert encode(info, text, "prompt") == list(tokenizer(text)["input_ids"]) and calls == [len(text)]
    spaces = " " * (HEAD_CHARS_PER_TOKEN * 300)  # long runs of few tokens: counted whole, as before
    assert encode(info, spaces, "prompt") == list(tokenizer(spaces)["input_ids"])
    english = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens in 2,700 characters
    with pytest.raises(APIError):
        encode(info, english, "prompt")  # ~4.5 characters a token: refused from its first 2,056


@pytest.mark.slow
def test_a_server_caps_the_heap_arenas_unless_the_environment_says(monkeypatch):
    import subprocess
    import sys

    from server.model.memory import limit_heap_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_heap_arenas() is False  # the operator's choice stands
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    code = "from server.model.memory import limit_heap_arenas; import ctypes.util; " \
           "print(limit_heap_arenas() or ctypes.util.find_library('c') is None)"  # glibc: applied
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


KERNEL_SHAPES = """
import sys
from server.model.memory import limit_kernel_caches
print(limit_kernel_caches(16))
import torch
from server.model.memory import rss_bytes
torch.set_num_threads(1)
packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(256, 64), None)
def run(ms):
    for m in ms:
        torch.ops.mkldnn._linear_pointwise(torch.randn(m, 64), packed, None, "none", [], "")
run(range(1, 20))
before = rss_bytes()
run(range(20, 420))  # 400 new token counts: ~250 MiB of kernels at the libraries' default caches
print((rss_bytes() - before) / 2**20)
"""


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's kernels are a CPU build's")
def test_a_server_caps_the_kernel_caches_so_new_shapes_do_not_grow_its_memory(monkeypatch):
    import subprocess
    import sys

    from server.model.memory import limit_kernel_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "2048")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert limit_kernel_caches(16) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}  # the operator's choice stands
    env = {k: v for k, v in __import__("os").environ.items() if not k.endswith("CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", KERNEL_SHAPES], capture_output=True, text=True, timeout=300, env=env)
    applied, growth = out.stdout.split("\n")[:2]
    assert applied == str({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}), out.stderr
    assert float(growth) < 40, f"RSS grew {growth} MiB over 400 new shapes with the caches capped at 16"


def test_a_servers_eagle_head_drops_its_dense_weights_and_drafts_the_same(tiny_target, head_dir, prompt_ids):
    """`build_engine` drops the dense weights packed kernels replace, the head's fc and FR output matrix included
    (only the proposer's kernels multiply them): the same drafts, accepted the same, afterwards."""
    from tests.engine_helpers import run_with_stats

    settings = Settings.load(draft_head=str(head_dir))
    requests = lambda: [request(f"r{i}", p, "eagle", 3) for i, p in enumerate(prompt_ids)]  # noqa: E731
    want = run_with_stats(Engine(tiny_target, None, settings), requests())
    engine = Engine(tiny_target, None, settings)
    head = engine.planner.proposers["eagle"].head
    dense = sum(t.numel() * t.element_size() for t in (head.fc.weight, head.lm_head_fr))
    assert engine.planner.release_dense() > dense
    assert head.fc.weight.numel() == 0 and head.lm_head_fr.numel() == 0
    got = run_with_stats(engine, requests())
    assert got[0] == want[0]
    assert [(s.draft_tokens, s.accepted_tokens) for s in got[1].values()] == \
        [(s.draft_tokens, s.accepted_tokens) for s in want[1].values()]
