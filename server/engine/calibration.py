"""Step costs measured before the first request, so `auto` plans with this machine's costs from the start.

`auto` weighs drafting against what verifying more tokens and running a model proposer cost
(server/speculation/cost.py `CostModel`). Online, those costs are learnt from the engine's own
steps; a fresh server would otherwise plan its first steps from a prior slope, and a lone request
verifying one width at a time never shows the slope at all. At start-up (while `/health` says
loading) `calibrate` therefore times:

* the target's verify pass (the forward, then p and the rejection sampler's verdict over every padded
  position, as a step computes them, for a request with default sampling) over scratch caches of
  its own holding `CONTEXT` tokens per row: one row at widths 1, 2, 4, ... K + 1 (K: the larger of the
  fixed methods' K and `auto`'s ceiling, so every width a request may verify by default), then batch
  sizes 2, 4, ... `max_batch_size`: every row plain, one row drafting one token (what `auto` weighs
  first in a batch: it costs far more than a row's share of the tokens, as the pass is packed), every
  row drafting one and two, and every row at K + 1 (`batch_shapes`); `REPEATS` passes each, each
  timed between two plain passes of its batch and kept as its ratio to them (`sandwiched`: a shared
  host's speed drifts between passes, and the ratios are what the cost model reads), with its batch size;
* each model proposer's drafting (proposers without a declared cost per draft token), through the
  proposer contract itself: join, one warm-up draft and commit, then K drafts per row, twice, at
  batch 1 (right after the one-row passes) and at `max_batch_size` (last), then leave.

The timings are fed to the cost model as its prior (its ratios of wider passes to plain ones, and plain
passes scaled to how fast the machine runs now; timings of real steps join them) and stored as
JSON in `settings.cache_dir/calibration/`, keyed by the target, its dtype, the device, torch's thread
count, the CPU kernels' build (`cpu_kernels.build_id`: a new version's kernels are timed again) and what
else changes the costs (draft model, draft head, K, batch size), so a restart with the same key reads them
back instead of timing again.
Calibration stops early once `budget_s` seconds are spent: the points measured so far are fed to the
cost model, and stored marked incomplete, so the next start measures again. It is skipped entirely
with the `calibrate` setting off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from server.config import Settings
from server.model import cpu_kernels
from server.model.loading import LoadedModel
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, probabilities
from server.speculation.cost import CostModel, elapsed_since
from server.speculation.plan import RowPlan, Rule, place
from server.speculation.proposer import Proposer
from server.speculation.rejection import rejection_sample
from server.types import SamplingParams

log = logging.getLogger(__name__)

VERSION = 8  # bump when what is measured changes, or what it times gets cheaper: older files are then ignored
CONTEXT = 64  # tokens each scratch row holds before a timed pass (a short chat prompt)
REPEATS = 3  # timings per (batch, width): their median is kept (a shared host slows single passes a lot)
BUDGET_S = 30.0  # stop timing after this long (docs/bench.md says how long it takes on a CPU)


@dataclass
class Calibration:
    """Timings: verify passes as (rows, fed tokens, seconds), and per model proposer its drafting as
    (rows, draft tokens per row, seconds)."""

    key: dict[str, object]
    verify: list[tuple[int, int, float]] = field(default_factory=list)
    draft: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)
    loaded: bool = False  # read from the cache directory rather than measured now
    complete: bool = False  # every planned timing was taken (the budget did not cut it short)

    def feed(self, cost: CostModel) -> None:
        """Give the timings to a step-cost model, as its prior."""
        for rows, tokens, seconds in self.verify:
            cost.observe_verify(rows, tokens, seconds, prior=True)
        for name, points in self.draft.items():
            for rows, forwards, seconds in points:
                cost.observe_draft(name, rows, forwards, seconds, prior=True)

    def to_json(self) -> dict[str, object]:
        return {"version": VERSION, "key": self.key, "verify": self.verify, "draft": self.draft,
                "complete": self.complete}


@dataclass(frozen=True)
class Subject:
    """What calibration times: the target (its scratch runners are built on the same model), the runner the
    engine verifies with (its forward's kind), the proposers, and the settings that change the costs."""

    target: LoadedModel
    runner: ModelRunner
    proposers: dict[str, Proposer]
    settings: Settings

    @property
    def timed(self) -> list[str]:
        """Proposers whose cost per draft token the planner times (no declared cost)."""
        return [n for n, p in self.proposers.items() if p.traits.draft_token_cost is None]

    @property
    def max_num_tokens(self) -> int:
        """The most draft tokens a request gets by default, whatever its method: `auto`'s K or a fixed one's."""
        return max(self.settings.num_speculative_tokens, self.settings.auto_max_speculative_tokens)

    def key(self) -> dict[str, object]:
        """What the step costs depend on: model, dtype, weights format, device, threads, the CPU kernels' build,
        and the settings that change them."""
        s = self.settings
        return {
            "target": self.target.name,
            "dtype": str(self.target.model.dtype).removeprefix("torch."),
            "weights": self.target.weights,
            "device": str(self.target.device),
            "threads": torch.get_num_threads(),
            "forward": self.runner.forward_kind,
            "kernels": cpu_kernels.build_id(),
            "draft": [s.draft, s.draft_dtype] if s.draft is not None else None,
            "draft_head": s.draft_head if "eagle" in self.proposers else None,
            "k": s.num_speculative_tokens,
            "auto_k": s.auto_max_speculative_tokens,
            "max_batch_size": s.max_batch_size,
            "model_proposers": sorted(self.timed),
        }


def cache_path(cache_dir: Path, key: dict[str, object]) -> Path:
    """The calibration file for `key`: readable prefix plus a hash of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{key['target']}-{key['device']}")[:60]
    return cache_dir / "calibration" / f"{slug}-{digest}.json"


def load(path: Path, key: dict[str, object]) -> Calibration | None:
    """The stored calibration for `key`, or None (missing, unreadable, another version or key)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("key") != key:
        return None
    if data.get("complete") is not True:  # cut short by the budget (a busy machine): measure again
        return None
    try:
        verify = [(int(r), int(n), float(s)) for r, n, s in data["verify"]]
        draft = {str(name): [(int(r), int(k), float(s)) for r, k, s in pts] for name, pts in data["draft"].items()}
    except (KeyError, TypeError, ValueError):
        return None
    return Calibration(key, verify, draft, loaded=True, complete=True)


def calibrate(
    target: LoadedModel, runner: ModelRunner, proposers: dict[str, Proposer], cost: CostModel, settings: Settings,
    budget_s: float = BUDGET_S,
) -> Calibration:
    """Calibrate `cost` for `target` (verified by `runner`) and the `proposers`: from the cache directory
    when this key was measured before, else by timing now (then stored). Must run before the engine serves
    (it uses the target)."""
    subject = Subject(target, runner, proposers, settings)
    key = subject.key()
    path = cache_path(settings.cache_dir, key)
    found = load(path, key)
    if found is None:
        started = time.perf_counter()
        found = measure(subject, key, budget_s)
        log.info("calibrated step costs in %.1f s: %d verify timings, %s", time.perf_counter() - started,
                 len(found.verify), {n: len(p) for n, p in found.draft.items()})
        try:
            if not found.verify:
                return found  # nothing measured (no budget): nothing to store or feed
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # servers starting together never share one
            tmp.write_text(json.dumps(found.to_json()))
            tmp.replace(path)
        except OSError as err:  # a read-only cache directory costs a restart its calibration, nothing else
            log.warning("could not store the calibration in %s: %s", path, err)
    else:
        log.info("step costs read from %s", path)
    found.feed(cost)
    return found


def widths(k: int) -> list[int]:
    """Verify widths to time: 1, 2, 4, ... and K + 1."""
    return _doubling(k + 1)


def batch_sizes(max_batch: int) -> list[int]:
    """Batch sizes to time: 1, 2, 4, ... and the largest."""
    return _doubling(max_batch)


def batch_shapes(rows: int, widest: int) -> list[list[int]]:
    """Passes to time at a batch of `rows` (tokens per row): plain; one row drafting one token; every
    row drafting one, then two; every row at the widest. A pass's time is far from linear in its
    tokens over the first few drafts of a batch (packing, then per-position work), which is where
    `auto` decides; the widest pass bounds the rest."""
    shapes = [[1] * rows, [2] + [1] * (rows - 1), [2] * rows, [3] * rows, [widest + 1] * rows]
    return [s for i, s in enumerate(shapes) if s not in shapes[:i]]


def _doubling(top: int) -> list[int]:
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return [*out, top]


def measure(subject: Subject, key: dict[str, object], budget_s: float = BUDGET_S) -> Calibration:
    """Time the target's verify passes and the model proposers' drafting now, most needed first (one
    row: every width, then each model proposer; then larger batches), until `budget_s` is spent."""
    deadline = time.perf_counter() + budget_s
    result = Calibration(key)
    widest, top = subject.max_num_tokens, subject.settings.max_batch_size
    # (what, rows, per pass the tokens each row feeds)
    tasks: list[tuple[str, int, list[list[int]]]] = [("verify", 1, [[w] for w in widths(widest)])]
    tasks += [(name, 1, []) for name in subject.timed]
    tasks += [("verify", rows, batch_shapes(rows, widest)) for rows in batch_sizes(top)[1:]]
    tasks += [(name, top, []) for name in subject.timed if top > 1]
    with torch.no_grad():
        for what, rows, shapes in tasks:
            if time.perf_counter() > deadline:
                return result
            if what == "verify":
                result.verify += _time_verify(subject, rows, shapes)
            else:
                result.draft.setdefault(what, []).extend(_time_drafting(subject, what, rows))
    result.complete = True
    return result


def _scratch_tokens(target: LoadedModel, rows: int, length: int) -> list[list[int]]:
    """Deterministic token ids below the tokenizer's size (any ids cost the same to compute)."""
    vocab = min(len(target.tokenizer), int(target.model.config.vocab_size))
    return [[(17 + 31 * (r * length + i)) % vocab for i in range(length)] for r in range(rows)]


def sandwiched(
    time_shape: Callable[[list[int]], float], shapes: list[list[int]], repeats: int
) -> list[tuple[list[int], float]]:
    """(shape, seconds), `repeats` per shape, where `shapes[0]` is the batch's plain pass and every other
    pass is timed between two plain ones: its seconds are its time over the mean of those two, times the
    median plain pass. What `auto` weighs is what a wider pass costs relative to a plain one; on a shared
    host the machine's speed moves between passes, and timed alone two passes a second apart compare
    speeds, not widths (docs/bench.md, "Calibration"). A drift linear over three passes cancels exactly; a
    burst moves one ratio, which the median over repeats drops.
    Each plain pass is given as measured."""
    plain, others = shapes[0], shapes[1:]
    plains: list[float] = []
    ratios: list[list[float]] = [[] for _ in others]
    for _ in range(repeats):
        before = time_shape(plain)
        plains.append(before)
        for i, shape in enumerate(others):
            seconds = time_shape(shape)
            after = time_shape(plain)
            plains.append(after)
            ratios[i].append(seconds / max((before + after) / 2, 1e-9))
            before = after
    base = statistics.median(plains)
    out = [(plain, t) for t in plains]
    out += [(shape, base * r) for shape, rs in zip(others, ratios, strict=True) for r in rs]
    return out


def _time_verify(subject: Subject, rows: int, shapes: list[list[int]]) -> list[tuple[int, int, float]]:
    """(rows, tokens fed, seconds) of target passes over a scratch cache of `rows` rows with `CONTEXT`
    tokens each (the engine's own rows are untouched), row b feeding `shape[b]` tokens in each pass
    (packed where rows feed unequal numbers, as the engine's passes are); every pass is rolled back. Where the
    engine's passes are static-shape ones (static_step.py: replayed graphs cost what eager passes do not), they are
    timed on its own runner, while it holds no rows (at start-up), and its scratch rows leave it empty again."""
    target, device = subject.target, subject.target.device
    own = subject.runner
    runner = own if own.static is not None and not own.rows else ModelRunner(target.model)
    ids = [f"calibration-{r}" for r in range(rows)]
    runner.join(ids, _scratch_tokens(target, rows, CONTEXT))
    fed_rows = _scratch_tokens(target, rows, max(n for shape in shapes for n in shape))
    sampling = BatchSampling.from_params([SamplingParams()] * rows, device)  # a request that sets nothing
    gens = [torch.Generator(device=device).manual_seed(r) for r in range(rows)]

    def time_shape(shape: list[int]) -> float:
        started = time.perf_counter()
        out = runner.forward([r[:n] for r, n in zip(fed_rows, shape, strict=True)])
        # what a step does next, per verify position: p [positions, vocab] and the verdict
        logits, _ = out.of_rows(range(rows))
        p = probabilities(logits[:, None], sampling.at_positions(shape))[:, 0]
        plan = place([RowPlan("calibration", r[1:n]) for r, n in zip(fed_rows, shape, strict=True)])
        rejection_sample(plan, p, gens)
        seconds = elapsed_since(started, device)
        for b, n in enumerate(shape):
            runner.rollback(b, n)
        return seconds

    try:
        runner.forward([r[:1] for r in fed_rows])  # a fresh cache's first pass allocates: not timed
        for b in range(rows):
            runner.rollback(b, 1)
        points = [(rows, sum(shape), seconds) for shape, seconds in sandwiched(time_shape, shapes, REPEATS)]
    finally:
        runner.leave(set(ids))
    return points


@dataclass
class _ScratchSequence:
    """A stand-in sequence for timing a proposer (satisfies `SequenceView`)."""

    request_id: str
    tokens: list[int]
    generator: torch.Generator
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=64, temperature=0.0))
    rule: Rule = Rule.COMPARE  # greedy scratch rows: a model drafts its argmax
    cache_salt: str | None = None


def _time_drafting(subject: Subject, name: str, rows: int) -> list[tuple[int, int, float]]:
    """(rows, K, seconds) of `name` drafting K tokens for `rows` scratch sequences, after a warm-up draft
    (which prefills the proposer's own cache) and its commit, as the planner would time it."""
    target, device = subject.target, subject.target.device
    proposer = subject.proposers[name]
    k = subject.settings.num_speculative_tokens
    prompts = _scratch_tokens(target, rows, CONTEXT)
    seqs = [_ScratchSequence(f"calibration-{name}-{r}", p, torch.Generator(device=device).manual_seed(r))
            for r, p in enumerate(prompts)]
    hidden_size = int(target.model.config.hidden_size)
    needs = proposer.traits.needs_hidden

    def hidden(n: int) -> torch.Tensor | None:
        return torch.zeros(n, hidden_size, device=device, dtype=target.model.dtype) if needs else None

    points: list[tuple[int, int, float]] = []
    proposer.join(seqs, [hidden(len(p) - 1) for p in prompts] if needs else None)
    try:
        for timed in (False, True, True):
            started = time.perf_counter()
            proposal = proposer.propose(seqs, [k if timed else 1] * rows)
            seconds = elapsed_since(started, device)
            if timed:
                points.append((rows, k, seconds))
            for seq, drafts in zip(seqs, proposal.drafts, strict=True):
                emitted = [*drafts, seq.tokens[0]]  # every draft accepted, then a bonus token
                proposer.commit(seq, drafts, emitted, hidden(len(emitted)))
                seq.tokens = seq.tokens + emitted
    finally:
        proposer.leave({s.request_id for s in seqs})
    return points
