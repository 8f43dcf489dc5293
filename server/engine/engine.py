"""The speculative decoding engine: one `step()` = plan -> verify -> accept -> commit for a batch.

Single-threaded by contract: the scheduler calls it from one worker thread, and owns the waiting queue.
The engine runs the step and owns its parts: admission (rows joining and leaving: admission.py), the
planner (who drafts what: server/speculation/planner.py), the verifier (the target's pass and the
rejection sampler: verify.py), failure isolation (isolation.py) and each row's commit (sequence.py). It
never names a proposer (docs/design.md).

What only makes steps cheaper is optional and fails safe (server/failsafe.py): the thread governor, the
prefix cache, calibration and, through the planner, the proposers, `auto`'s models and the grammar's fast
path. An exception in one of them is counted (`Engine.parts`) and the step goes on without it. A step
fails only in what every answer needs: the target's pass, the sampler, a row's own grammar.
"""

from __future__ import annotations

import logging
import random
import time

import torch

from server.config import Settings
from server.engine.admission import Admission, kv_slots, pinned_columns, row_slack
from server.engine.calibration import calibrate
from server.engine.isolation import Isolation, describe, own_input
from server.engine.memory import MemoryParts
from server.engine.sequence import Sequence
from server.engine.threads import DECODE, PROMPT, ThreadGovernor, governed
from server.engine.verify import Verified, Verifier
from server.failsafe import OptionalParts
from server.grammar import Grammars
from server.model import cpu_kernels, families, prefix_cache
from server.model.attention import use_gqa_attention
from server.model.kv_shape import kv_name, kv_precision
from server.model.loading import LoadedModel, load_draft_like, load_model
from server.model.memory import HeapTrimmer, budget_bytes, rss_bytes
from server.model.quantized import activations
from server.model.runner import ModelRunner
from server.model.static_step import row_buckets
from server.speculation.acceptance import AcceptanceModel
from server.speculation.budget import StepBudget, attention_span
from server.speculation.cost import CostModel, elapsed_since
from server.speculation.planner import Planner
from server.speculation.policy import DraftPolicy
from server.speculation.proposer import BuildContext, Proposer
from server.speculation.registry import BUILTIN, Registry
from server.speculation.tuning import AutoTuning
from server.types import Fallback, GenerationRequest, RequestOutput, SeqStepStats, ServingLimits, StepResult

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        settings: Settings,
        registry: Registry = BUILTIN,
        cost: CostModel | None = None,
        acceptance: AcceptanceModel | None = None,
        policy: DraftPolicy | None = None,
    ) -> None:
        """`registry`: the proposers to build (tests add their own). `auto`'s parts, for tests and benches:
        `cost` (default: learnt from this engine's timings), `acceptance` (default: from its verdicts),
        `policy` (default: `AutoPolicy` over those two; `FixedPolicy` to compare against)."""
        self.target, self.settings, self.tokenizer, self.device = target, settings, target.tokenizer, target.device
        self.model_name = settings.served_model_name or target.name
        self.weights = target.weights  # the weights format served (loading.py): /v1/models, cache keys
        # the precision of the target's cached keys and values (kv_shape.py): /v1/models, cache keys
        self.kv_dtype = kv_precision(settings.kv_cache_dtype, target.weights, target.model.dtype)
        self.kv_cache_dtype = kv_name(self.kv_dtype, target.model.dtype)
        # what the linear layers take their inputs in (quantized.py): /v1/models, cache keys
        self.activations = activations(target.model)
        spec = getattr(target.model, "spec", None)  # the server's own tree (decoder.py) carries its family's
        self.architecture = spec.family if spec is not None else \
            f"transformers:{getattr(target.model.config, 'model_type', 'unknown')}"
        self.architectures = [f.name for f in families.FAMILIES]
        self.vocab_size = int(target.model.config.vocab_size)  # logits width (may exceed the tokenizer's)
        self.draft_name = draft.name if draft is not None else None
        for loaded in (target, draft):
            if loaded is not None:
                use_gqa_attention(loaded.model)
        self.parts = OptionalParts()  # the optional parts' failures and switches (failsafe.py)
        tuning = AutoTuning().with_overrides(settings.auto_tuning)
        log.info("auto's tuning: %s", tuning)
        self.planner = Planner.build(BuildContext(target, draft, settings, self.vocab_size), registry, self.parts,
                                     tuning, cost, acceptance, policy)
        self.cost = self.planner.cost
        # prompt prefixes computed before, reused at join (prefix_cache.py); None: every prompt is prefilled
        prefixes = (prefix_cache.PrefixCache(budget_bytes(settings.prefix_cache_memory, self.device,
                                                          "prefix_cache_memory"),
                                             # blocks differ per weights format, activations and cache precision
                                             namespace=f"{target.name}:{target.weights}:{self.activations}:"
                                                       f"kv-{self.kv_cache_dtype}")
                    if settings.prefix_cache_memory is not None else None)
        shapes = [ModelRunner.kv_shape(target.model, self.kv_dtype), *self.planner.cache_shapes()]
        # the most tokens a step's pass computes, prompt tokens weighted by their depth (budget.py)
        self.step_budget = StepBudget(settings.step_token_budget(self.device.type), attention_span(target.model.config))
        slack = row_slack(self.step_budget.tokens)
        self.kv_slots = kv_slots(settings, self.device, shapes, prefixes.budget_bytes if prefixes else 0, slack)
        max_context = settings.max_model_len or target.max_context
        # static-shape passes (static_step.py) need every row's columns pinned: the budget split into rows
        columns = pinned_columns(settings, target.model, self.kv_slots, max_context + slack, slack,
                                 shapes[0].bytes_per_token)
        if columns is not None:
            self.kv_slots = row_buckets(settings.max_batch_size)[-1] * columns
        self.runner = ModelRunner(target.model, self.kv_slots, kv_dtype=self.kv_dtype, kv_columns=columns)
        if columns is not None:
            widest = max(settings.num_speculative_tokens, settings.auto_max_speculative_tokens)
            self.runner.use_static(settings.max_batch_size, widest + 1)
            max_context = min(max_context, columns - slack)  # a row's columns hold its context and a step's
        if self.kv_slots is not None:  # one row alone must fit the budget, with a step's columns to spare
            max_context = min(max_context, self.kv_slots - slack)
        self.limits = ServingLimits(max_context=max_context, vocab_size=self.vocab_size, methods=self.planner.methods)
        if settings.speculation not in self.limits.methods:
            raise ValueError(f"the configured speculation method {settings.speculation!r} cannot run on this "
                             f"server (available: {', '.join(self.limits.methods)})")
        self.eos_ids = _eos_ids(target)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids, slicer=self.device.type != "cpu")
        seeds = random.SystemRandom()
        self.admission = Admission(
            self.runner, self.planner, self.parts, prefixes=prefixes, kv_slots=self.kv_slots,
            max_rows=settings.max_batch_size, slack=slack,
            start=lambda r: Sequence.start(r, self.tokenizer, self.grammars, self.eos_ids, self.device, seeds),
        )
        self.verifier = Verifier(self.runner, self.vocab_size, self.eos_ids, self.device)
        self.isolation = Isolation(self.runner.kv, self.planner)
        self._trim_heap = HeapTrimmer()
        self.memory = MemoryParts(self.runner, self.planner, self.admission, self._trim_heap)  # memory.py
        # torch's CPU thread count per step, from measured step times (threads.py); CPU with > 1 thread only
        threads = torch.get_num_threads()
        self.threads = ThreadGovernor(threads) if self.device.type == "cpu" and threads > 1 else None

    # ---- the scheduler's interface -------------------------------------------------------------------
    def add_requests(self, requests: list[GenerationRequest]) -> None:
        """Join requests to the running batch (admission.py: nothing is computed now; the next steps compute
        their prompts within their token budget, or read them from the prefix cache; all or nothing). They
        must pass `limits.check`; the scheduler keeps the batch within `max_batch_size` and the KV budget
        (`fits`)."""
        self.admission.join(requests)

    def abort_request(self, request_id: str) -> None:
        """Drop a running request now (its client is gone: no output is produced for it)."""
        self.admission.leave({request_id})

    def fits(self, requests: list[GenerationRequest]) -> bool:
        """Whether `requests` can join the running batch now within the KV budget (always, without one)."""
        return self.admission.fits(requests)

    def kv_cache_usage(self) -> float:
        return self.admission.usage(self.limits.max_context)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def release_idle_memory(self) -> None:
        """The batch is empty and stayed so (the scheduler's idle wait): a burst's freed buffers go back to
        the OS, so the RSS falls back."""
        if not self.running:
            self._trim_heap()

    # ---- a read-only view for tests, benches and tools --------------------------------------------------
    @property
    def running(self) -> dict[str, Sequence]:
        """The rows in flight by request id (read them; the engine alone changes them)."""
        return self.admission.running

    def proposer(self, name: str) -> Proposer:
        """The proposer `name` this engine built (to read its figures, e.g. `forwards`)."""
        return self.planner.proposers[name]

    # ---- one step ------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One speculative step for the batch, and what it produced.

        A row whose part of the step raises fails alone (`StepResult.failed`, and it leaves the batch);
        its neighbours' step goes through as if it had never been there. Raises `EngineFault` when a
        failure cannot be pinned on rows (the engine itself is broken: the scheduler stops serving)."""
        started = time.perf_counter()
        failures: dict[str, Exception] = self.admission.enter(self.step_budget.tokens)  # rows the budget reaches
        self.memory.observe_join()
        seqs = [self.running[rid] for rid in self.runner.rows]  # the target cache's row order: oldest first
        outputs, stats, fallbacks = [], [], []
        if seqs:
            if self.threads is not None:  # steps that compute prompt tokens have their own thread count
                governed(self.threads, self.parts, self.threads.before_step,
                         PROMPT if self.admission.prompt_waiting() else DECODE)
            verified, failed = self.isolation.run(seqs, self._verify)  # plan -> verify -> accept
            if verified is not None:
                outputs, stats, fallbacks = self._commit(verified, failed)
            self.planner.settle()  # rows a proposer dropped while planning leave it
            self.isolation.count(failed, committed=verified is not None and bool(stats or verified.chunks))
            failures |= failed
        self.admission.leave({o.request_id for o in outputs if o.finished} | set(failures), failed=set(failures))
        self.memory.after_change()
        return _result(outputs, stats, failures, self.admission, started, self.parts.take_new(), fallbacks)

    def _verify(self, seqs: list[Sequence], hold: frozenset[str]) -> Verified:
        """Plan, verify in one target pass and sample, for the rows not in `hold`; the pass's timing
        teaches the cost model and the thread governor. Changes only what isolation's checkpoint restores."""
        plan = self.planner.plan(seqs, hold, self.step_budget)
        started = time.perf_counter()
        verified = self.verifier(seqs, plan, hold, hidden=self.planner.needs_hidden)
        self._learn(verified, elapsed_since(started, self.device))
        return verified

    def _learn(self, verified: Verified, seconds: float) -> None:
        """The pass costs what it computed: the real tokens when packed, else every row padded to the widest.
        A thread-count probe times another configuration (the governor compares it, the cost model skips
        it); a pass that also computed prompt chunks is no verify pass of its width (the cost model skips it,
        the governor compares it with other such passes by their size in budget tokens)."""
        rows, tokens, chunked = len(verified.rows), verified.computed, verified.prompt_tokens > 0
        self.memory.observe_verify(tokens, verified.logits.shape[0])
        if not (self.threads is not None and self.threads.probing) and not chunked:
            self.parts.call("cost_model", self.cost.observe_verify, rows, tokens, seconds, default=None)
        if self.threads is not None:
            size = self.parts.call("threads", self._budget_tokens, verified, default=None) if chunked else \
                self.parts.call("cost_model", self.cost.verify_time, rows, tokens, default=None)
            governed(self.threads, self.parts, self.threads.observe, seconds, size)

    def _budget_tokens(self, verified: Verified) -> float:
        """A pass's size in budget tokens: every computed token, a prompt token weighted by its depth as the
        step's budget weighs it (budget.py; the rows' positions before the step's commit)."""
        finishing = zip(verified.seqs, verified.rows, strict=True)
        pieces = [(c.seq.prompt_computed, c.tokens) for c in verified.chunks] + \
            [(seq.prompt_computed, row.chunk) for seq, row in finishing if row.chunk]
        return verified.computed + sum(self.step_budget.cost(start, n) - n for start, n in pieces)

    def _commit(
        self, v: Verified, failed: dict[str, Exception]
    ) -> tuple[list[RequestOutput], list[SeqStepStats], list[tuple[str, Fallback]]]:
        """Roll back the rejected drafts and commit what each verified row emitted, and the prompt chunks of
        the rows that computed one only; a row whose commit raises joins `failed` (its state is dropped when
        it leaves; the other rows never read it). Each committed row's output says which proposers it has lost
        to their failure (`Sequence.fell_back`); the losses new this step come back with the row's method."""
        outputs, stats, fallbacks = [], [], []
        for chunk in v.chunks:
            seq = chunk.seq
            try:
                if chunk.hidden is not None:  # proposers that read the target's features take them now
                    if seq.features is not None:
                        seq.features.append(chunk.hidden.clone())  # a copy: a view keeps the step's tensor
                    self.planner.prefilled(seq, seq.prompt_computed, chunk.hidden)
                self.admission.prefilled(seq, chunk.tokens)  # and the prefix cache the blocks completed
            except Exception as exc:
                failed[seq.request_id] = exc
        for i, (b, seq, row) in enumerate(zip(v.cache_rows, v.seqs, v.rows, strict=True)):
            try:
                emitted = v.verdict.tokens[i]
                self.runner.rollback(b, row.k - v.verdict.accepted[i])  # the one place target rollback happens
                hidden = v.committed_hidden(i)
                if seq.features is not None and hidden is not None:
                    seq.features.append(hidden.clone())
                self.planner.commit(seq, row, emitted, hidden)
                lost = seq.fell_back(self.planner.fallbacks_of(seq.request_id))
                output, step = seq.commit(row, emitted, v.logprobs(i, seq.sampling.logprobs))
                if row.chunk:  # the prompt's last chunk is in the cache now: share the prompt
                    self.admission.prefilled(seq, row.chunk)
            except Exception as exc:
                log.warning("commit failed for request %s: %s", seq.request_id, describe(exc), exc_info=exc)
                failed[seq.request_id] = exc
                continue
            outputs.append(output)
            stats.append(step)
            fallbacks += [(seq.method, f) for f in lost]
        return outputs, stats, fallbacks


def _result(
    outputs: list[RequestOutput], stats: list[SeqStepStats], failures: dict[str, Exception],
    admission: Admission, started: float, degraded: list[str], fallbacks: list[tuple[str, Fallback]],
) -> StepResult:
    """The step's report: failures split into the engine's (`failed`) and the clients' bad input (`rejected`)."""
    prefill, cached = admission.take_counts()
    return StepResult(outputs, stats, prefill, time.perf_counter() - started, cached_tokens=cached,
                      prompt_tokens_waiting=admission.prompt_waiting(),
                      failed={rid: describe(e) for rid, e in failures.items() if not own_input(e)},
                      rejected={rid: str(e) for rid, e in failures.items() if own_input(e)}, degraded=degraded,
                      fallbacks=fallbacks)


def _eos_ids(model: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (model.tokenizer.eos_token_id, getattr(model.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def price_passes(engine: Engine) -> None:
    """Before the first request: the static-shape passes recorded (CUDA graphs, so no request waits for one), then
    the step costs measured or read back where the settings calibrate (calibration.py), over those replays."""
    if engine.runner.static is not None:
        started = time.perf_counter()
        if captured := engine.runner.static.capture():
            log.info("captured %d static-shape passes in %.1f s", captured, time.perf_counter() - started)
    if engine.settings.calibrate:
        engine.parts.call("calibration", calibrate, engine.target, engine.runner, engine.planner.proposers,
                          engine.cost, engine.settings, default=None)  # failing: learnt from traffic


def build_engine(settings: Settings, *, keep_dense: bool = False, modules: str = "own") -> Engine:
    """Load the configured target (and draft) and build the engine. Slow: loads weights. The models are the
    engine's alone: the dense weights its packed kernels were reordered from are dropped (CPU, oneDNN:
    `LeanForward.release_dense`) unless `keep_dense` (a caller that also runs transformers' forward on the
    same model, as `bench.overhead` does: it asks for `modules="transformers"` too, `load_model`'s choice of
    module tree, since the server's own modules have no `generate()`)."""
    started = time.perf_counter()
    target = load_model(
        settings.target, dtype=settings.target_dtype, device=settings.device, cache_dir=settings.cache_dir,
        weights=settings.weights, modules=modules,
    )
    draft = None
    if settings.draft is not None:
        draft = load_draft_like(target, settings.draft, dtype=settings.draft_dtype, cache_dir=settings.cache_dir)
    log.info(
        "loaded target %s (weights %s) and draft %s on %s in %.1f s",
        target.name, target.weights, draft.name if draft else None, target.device, time.perf_counter() - started,
    )
    engine = Engine(target, draft, settings)
    if (problem := cpu_kernels.problem()) is not None:  # the file's blocks on torch's kernel: slower, same answers
        engine.parts.failed("kernels", RuntimeError(problem))
    log.info("the target's cache keeps keys and values in %s (kv_cache_dtype %s)", engine.kv_cache_dtype,
             settings.kv_cache_dtype)
    price_passes(engine)
    if not keep_dense:
        freed = engine.runner.release_dense() + engine.planner.release_dense()
        if freed:
            engine._trim_heap()
            log.info("dropped %.0f MB of dense weights the packed kernels replace", freed / 2**20)
    # structured output's tokenizer view (~0.3 s), before the first request; after the drop above, so its build's
    # transient heap (~30 MiB) does not stack on the dense weights' (the start-up's peak RSS); that heap given back
    # (35 MiB of a 152k vocabulary's, Qwen2.5's, stayed resident without it)
    engine.grammars.warm()
    engine._trim_heap()
    widest = max(settings.num_speculative_tokens, settings.auto_max_speculative_tokens)  # drafts of a row
    engine.memory.measure(target.model, engine.vocab_size, engine.planner.needs_hidden, settings.max_batch_size,
                          widest + 1)
    engine.memory.settle()
    log.info("memory (MiB): %s; RSS %.0f", ", ".join(f"{k} {v / 2**20:.0f}" for k, v in engine.memory.usage().items()),
             rss_bytes() / 2**20)
    return engine
