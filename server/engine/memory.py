"""What a server's memory is made of, measured from its objects (docs/api.md "Memory").

`MemoryParts.usage()` (the engine's `memory`) gives these parts in bytes; `/metrics` exports them as
`specula_memory_bytes{part}`, and as `specula_memory_peak_bytes{part}` the parts when their sum was largest
(`MemoryParts.peak`):

* `weights`: the target's parameters and buffers, and the reordered copies its packed kernels multiply
  (server/model/lean_forward.py `PackedLinear`; the dense copies they replace are dropped: `release_dense`).
* `kv_cache`: the target's batch KV cache as allocated (with `kv_cache_memory`, the budget's share from the
  start; without, what the running rows grew it to, freed when the batch empties; on a CPU its pages become
  resident only as forwards write them, so the part is an upper bound there: server/model/kv_layers.py
  `zeroed`).
* `prefix_cache`: the blocks the prefix cache holds (within `prefix_cache_memory`).
* `proposers`: what the proposers hold of their own: a draft model's or draft head's weights (not already
  counted as the target's), their KV caches, `suffix`'s index of earlier outputs.
* `activations`: the working memory of the largest step, which lives only while it runs: a join's scratch
  cache of the prompts it prefills (and the cached prefixes loaded into it), the forward's tensors per
  computed token, and per scored position the logits (vocabulary-wide, fp32), p and the verdict.
  `StepMemory` holds the last two as bytes per token and per position, measured at start-up
  (`measure_step_memory`), and the largest step so far; the part is never below the widest verify pass
  the settings allow (`max_batch_size` rows x the widest drafts + 1).
* `runtime`: Python, torch and the other libraries, the tokenizer, and whatever else was resident once the
  server had loaded, measured once (`MemoryParts.settle`): the process's RSS then less the parts above.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from server.model.memory import HeapTrimmer, PeakTensorBytes, rss_bytes, settle, tensor_bytes
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, probabilities
from server.speculation.plan import RowPlan, place
from server.speculation.rejection import rejection_sample
from server.types import SamplingParams

if TYPE_CHECKING:
    from server.engine.admission import Admission
    from server.speculation.planner import Planner

log = logging.getLogger(__name__)

PARTS = ("weights", "kv_cache", "prefix_cache", "proposers", "activations", "runtime")

# The probe's shapes: small, as every operation runs Python while it is measured (the bytes scale per token)
PROBE_PREFILL = 32  # tokens of one row's prefill
PROBE_ROWS, PROBE_WIDTH = 2, 3  # a verify pass of rows x (2 drafts + 1): bytes scale with positions (per position)
# The most expensive sampling path per position: penalties (token counts), temperature, top-k and top-p (a
# sort of the vocabulary)
PROBE_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1,
                                frequency_penalty=0.5)


@dataclass
class StepMemory:
    """The working memory of steps: bytes per computed token of a forward, per scored position (logits,
    p, the verdict), the widest verify pass the settings allow (`planned`) and the largest step so far."""

    per_token: int = 0
    per_position: int = 0
    planned: int = 0
    high_water: int = 0

    def plan(self, rows: int, positions_per_row: int) -> None:
        """The widest verify pass: `rows` rows scoring `positions_per_row` positions, every one computed."""
        self.planned = self.bytes(rows * positions_per_row, rows * positions_per_row)

    def bytes(self, tokens: int, positions: int, extra: int = 0) -> int:
        return tokens * self.per_token + positions * self.per_position + extra

    def observe(self, tokens: int, positions: int, extra: int = 0) -> None:
        """A step computed `tokens` tokens, scored `positions` positions and held `extra` bytes besides
        (a join's scratch cache)."""
        self.high_water = max(self.high_water, self.bytes(tokens, positions, extra))

    @property
    def peak(self) -> int:
        return max(self.planned, self.high_water)


def measure_step_memory(model: torch.nn.Module, vocab_size: int, hidden: bool) -> StepMemory:
    """Bytes per computed token and per scored position of `model`'s steps, measured on a scratch cache
    with `PeakTensorBytes`: a one-row prefill (the forward's tensors, its cache not counted), then a
    verify pass of `PROBE_ROWS` x `PROBE_WIDTH` with the most expensive sampling and the verdict (what it
    holds beyond the forward's per-token share, per scored position). `hidden`: the forward also returns
    its final hidden states (a proposer reads them)."""
    device = next(model.parameters()).device
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bytes do not depend on it; on a busy host one thread does not crawl (threads.py)
    try:
        return _measure(model, vocab_size, hidden, device)
    finally:
        torch.set_num_threads(threads)


def _measure(model: torch.nn.Module, vocab_size: int, hidden: bool, device: torch.device) -> StepMemory:
    with torch.no_grad():
        runner = ModelRunner(model)
        runner.kv = runner.kv.new_rows(["probe"], PROBE_PREFILL)
        ids = list(range(100, 100 + PROBE_PREFILL))
        with PeakTensorBytes() as peak:
            runner.forward([ids], logits=False, hidden=hidden)
        per_token = max(0, peak.peak - runner.kv.nbytes) // PROBE_PREFILL

        rows = [f"probe{b}" for b in range(PROBE_ROWS)]
        runner = ModelRunner(model)
        runner.kv = runner.kv.new_rows(rows, PROBE_PREFILL + PROBE_WIDTH)
        runner.forward([ids] * PROBE_ROWS, logits=False)
        drafts = [list(range(200, 200 + PROBE_WIDTH - 1))] * PROBE_ROWS
        positions = PROBE_ROWS * PROBE_WIDTH
        params = [PROBE_SAMPLING] * PROBE_ROWS
        gens = [torch.Generator(device=device).manual_seed(b) for b in range(PROBE_ROWS)]
        with PeakTensorBytes() as peak:
            out = runner.forward([[ids[-1], *d] for d in drafts], hidden=hidden)
            logits, _ = out.of_rows(range(PROBE_ROWS))
            sampling = BatchSampling.from_params(params, device, generated=[0] * PROBE_ROWS,
                                                 prompts=[tuple(ids)] * PROBE_ROWS)
            counts = torch.zeros(positions, vocab_size, device=device)
            at = sampling.at_positions([PROBE_WIDTH] * PROBE_ROWS)
            p = probabilities(logits[:, None], at, counts[:, None])[:, 0]
            rejection_sample(place([RowPlan("probe", d) for d in drafts]), p, gens, [False] * PROBE_ROWS)
        per_position = max(0, peak.peak - per_token * positions) // positions
    return StepMemory(per_token=per_token, per_position=per_position)


class MemoryParts:
    """The engine's memory, part by part, measured from the objects that hold it (the module docstring):
    `usage()` from any thread; `measure()` and `settle()` once loaded; `observe_*` and `after_change()`
    from the engine's steps and joins."""

    def __init__(self, runner: ModelRunner, planner: Planner, admission: Admission, trim_heap: HeapTrimmer) -> None:
        self._runner, self._planner, self._admission, self._trim_heap = runner, planner, admission, trim_heap
        self.step = StepMemory()
        self._runtime: int | None = None  # what the process held besides the measured parts (`settle`)
        self._kv_bytes = runner.kv.nbytes  # the target cache's storage after the last step or join
        self._peak: dict[str, int] = {}  # the parts when their sum was largest (`peak`)
        self._peak_lock = threading.Lock()

    def measure(self, model: torch.nn.Module, vocab_size: int, hidden: bool, rows: int, positions: int) -> None:
        """Measure the steps' working memory per computed token and per scored position (about a second on
        2 CPU cores), and plan the widest verify pass: `rows` rows x `positions` positions. Optional: when
        it fails the `activations` part counts the steps and joins seen only."""
        try:
            measured = measure_step_memory(model, vocab_size, hidden)
        except Exception as exc:  # noqa: BLE001 - a gauge must never stop a server from starting
            log.warning("could not measure the steps' working memory: %s: %s", type(exc).__name__, exc)
            return
        measured.high_water = self.step.high_water
        measured.plan(rows, positions)
        self.step = measured
        log.info("step working memory: %d bytes per computed token, %d per scored position; the widest verify "
                 "pass (%d rows x %d positions) %.0f MiB", measured.per_token, measured.per_position, rows,
                 positions, measured.planned / 2**20)

    def settle(self) -> None:
        """Once loaded: free what loading left unreachable, give the heap back, and take the process's RSS
        less the measured parts as the `runtime` part (Python, torch, libraries, the tokenizer)."""
        settle(self._trim_heap)
        parts = self.usage()
        held = sum(v for k, v in parts.items() if k not in ("runtime", "activations"))
        self._runtime = max(0, rss_bytes() - held)

    def usage(self) -> dict[str, int]:
        """Bytes of each part, measured from the objects now; callable from any thread."""
        seen: set[tuple[str, int]] = set()  # storages counted: the proposers' share of the target's weights
        prefixes = self._admission.prefixes
        running = list(self._admission.running.values())
        parts = {
            "weights": tensor_bytes(self._runner.weight_tensors(), seen),
            "kv_cache": tensor_bytes(self._runner.kv.storage(), seen),
            "prefix_cache": prefixes.used_bytes if prefixes is not None else 0,
            # their weights and caches, and the target's features the rows keep for a draft head
            "proposers": tensor_bytes(self._planner.weight_tensors(), seen) + self._planner.cache_bytes(seen)
            + tensor_bytes((t for s in running for t in list(s.features or ())), seen),
            "activations": self.step.peak,
        }
        if self._runtime is None:  # measured once, lazily for an engine built without `build_engine`
            self._runtime = max(0, rss_bytes() - sum(v for k, v in parts.items() if k != "activations"))
        parts["runtime"] = self._runtime
        self._remember(parts)
        return parts

    def _remember(self, parts: dict[str, int]) -> None:
        with self._peak_lock:
            if sum(parts.values()) > sum(self._peak.values()):
                self._peak = dict(parts)

    def peak(self) -> dict[str, int]:
        """The parts when their sum was largest of the times they were measured: every `usage()` (every
        scrape) and every step or join that grew the KV cache, where the sum peaks between scrapes (a long
        prompt's rows may come and go within one). A growth counts the cache's old storage beside the new:
        the move may hold both until the heap is trimmed after the step (an upper bound: glibc may reuse
        some of the old for the new). Callable from any thread."""
        with self._peak_lock:
            return dict(self._peak)

    def observe_join(self) -> None:
        """Rows joined: their prefill's tokens and its scratch cache (the runner's last join)."""
        self.step.observe(self._runner.join_tokens, 0, self._runner.join_bytes)

    def observe_verify(self, computed: int, positions: int) -> None:
        """A verify pass computed `computed` tokens and scored `positions` positions."""
        self.step.observe(computed, positions)

    def after_change(self) -> None:
        """After a step or a join: when the target's cache moved into a bigger buffer (no KV budget), give
        the free pages the old buffer left back at once. glibc keeps freed blocks below its mmap threshold
        (which rises to the largest block freed so far) in its heap, where what later blocks do not reuse
        stays resident until the next idle second. Growth is rare (doubling)."""
        size = self._runner.kv.nbytes
        if size > self._kv_bytes:
            try:  # for `peak`: the parts as the cache moved, its old storage at most still resident beside the new
                parts = self.usage()
                self._remember({**parts, "kv_cache": parts["kv_cache"] + self._kv_bytes})
            except Exception as exc:  # noqa: BLE001 - a gauge must never fail a step
                log.warning("could not measure the memory parts: %s: %s", type(exc).__name__, exc)
            self._trim_heap()
        self._kv_bytes = size
