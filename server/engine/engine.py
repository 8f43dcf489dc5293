"""The speculative decoding engine: one `step()` = plan -> verify -> accept -> commit for a batch.

Single-threaded by contract: the scheduler calls it from one worker thread, and owns the waiting
queue. A request joins when the scheduler adds it (its prompt is prefilled then) and leaves at the
end of the step that finishes it, or when it is aborted. The engine never names a proposer: the
planner (server/speculation/planner.py) decides who drafts what, the model runner runs the target,
and the rejection sampler decides what is kept (docs/design.md).

What only makes steps cheaper is optional and fails safe (server/failsafe.py): the thread governor, the
prefix cache, calibration and, through the planner, the proposers, `auto`'s estimates and the grammar's
fast path. An exception in one of them is counted (`Engine.parts`) and the step goes on without it. A
step fails only in what every answer needs: the target's pass, the sampler, a row's own grammar.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from server.config import Settings
from server.engine.calibration import calibrate
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sequence import Sequence
from server.engine.threads import ThreadGovernor
from server.failsafe import OptionalParts
from server.grammar import GrammarError, Grammars
from server.model import prefix_cache
from server.model.attention import use_gqa_attention
from server.model.kv_cache import BatchKV, KVCheckpoint, slots_for
from server.model.loading import LoadedModel, load_draft_like, load_model
from server.model.memory import HeapTrimmer, budget_bytes
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, probabilities, raw_logprobs
from server.speculation.adaptive import CostModel
from server.speculation.planner import Planner, RowPlan, elapsed_since
from server.speculation.proposer import BuildContext
from server.speculation.registry import BUILTIN, Registry
from server.speculation.rejection import rejection_sample, row_bounds
from server.types import (
    GenerationRequest,
    ProposerTally,
    RequestOutput,
    RequestStats,
    SeqStepStats,
    ServingLimits,
    StepResult,
    TokenLogprob,
    TokenSource,
)

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        settings: Settings,
        registry: Registry = BUILTIN,
        cost: CostModel | None = None,
    ) -> None:
        """`registry`: the proposers to build (tests add their own); `cost`: the step-cost model `auto`
        plans with (default: fitted online from this engine's timings)."""
        self.target = target
        self.settings = settings
        self.tokenizer = target.tokenizer
        self.device = target.device
        self.model_name = settings.served_model_name or target.name
        self.weights = target.weights  # the weights format served (loading.py): /v1/models, cache keys
        self.vocab_size = int(target.model.config.vocab_size)  # logits width (may exceed the tokenizer's)
        self.draft_name = draft.name if draft is not None else None
        for loaded in (target, draft):
            if loaded is not None:
                use_gqa_attention(loaded.model)
        self.parts = OptionalParts()  # the optional parts' failures and switches (failsafe.py)
        self.planner = Planner(BuildContext(target, draft, settings, self.vocab_size), registry, cost, self.parts)
        # prompt prefixes computed before, reused at join (prefix_cache.py); None: every prompt is prefilled
        self.prefixes = (
            prefix_cache.PrefixCache(
                budget_bytes(settings.prefix_cache_memory, self.device, "prefix_cache_memory"),
                namespace=f"{target.name}:{target.weights}",  # keys and values differ per weights format
            )
            if settings.prefix_cache_memory is not None else None
        )
        # the KV budget in tokens per cache, or None; a fraction of free memory leaves the prefix cache's room
        self.kv_slots = self._kv_slots(target, settings, self.prefixes.budget_bytes if self.prefixes else 0)
        self.runner = ModelRunner(target.model, self.kv_slots)
        max_context = settings.max_model_len or target.max_context
        if self.kv_slots is not None:  # one row alone must fit the budget, with a step's columns to spare
            max_context = min(max_context, self.kv_slots - ROW_SLACK)
        self.limits = ServingLimits(max_context=max_context, vocab_size=self.vocab_size, methods=self.planner.methods)
        if settings.speculation not in self.limits.methods:
            raise ValueError(
                f"the configured speculation method {settings.speculation!r} cannot run on this server "
                f"(available: {', '.join(self.limits.methods)})"
            )
        self.eos_ids = _eos_ids(target)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        self.running: dict[str, Sequence] = {}  # in the target cache's row order
        self._prefill_tokens = 0  # prompt tokens prefilled since the last step (reported with it)
        self._cached_tokens = 0  # prompt tokens read from the prefix cache since the last step
        self._seed_source = random.SystemRandom()
        self._faulty_steps = 0  # consecutive steps in which every row failed (see `FAULTY_STEPS`)
        self._trim_heap = HeapTrimmer()
        # torch's thread count per step, from measured step times (threads.py); CPU with > 1 thread only
        threads = torch.get_num_threads()
        self.threads = ThreadGovernor(threads) if self.device.type == "cpu" and threads > 1 else None

    # ---- the scheduler's interface -------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def methods(self) -> tuple[str, ...]:
        return self.limits.methods

    @property
    def num_running(self) -> int:
        return len(self.running)

    def release_idle_memory(self) -> None:
        """The batch is empty and stayed so (the scheduler's idle wait): a burst's freed buffers go back to
        the OS, so the RSS falls back."""
        if not self.running:
            self._trim_heap()

    def release_dense_weights(self) -> int:
        """Drop the dense weights every model this engine runs holds a reordered copy of (CPU, oneDNN:
        `LeanForward.release_dense`), for a process in which nothing else runs these models; bytes dropped."""
        freed = sum(r.release_dense() for r in (self.runner, *self.planner.model_runners()))
        if freed:
            self._trim_heap()
        return freed

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def kv_cache_usage(self) -> float:
        """With a KV budget: the fraction of it the running rows hold (rows x the largest reservation,
        what admission counts: see `fits`). Without: live KV tokens as a fraction of what
        `max_batch_size` full-context rows would hold."""
        if self.kv_slots is None:
            return self.runner.kv.live_tokens / (self.settings.max_batch_size * self.max_context)
        need = [_reservation(s.request) for s in self.running.values()]
        return len(need) * max(need, default=0) / self.kv_slots

    def fits(self, requests: list[GenerationRequest]) -> bool:
        """Whether `requests` can join the running batch now within the KV budget (always, without one).

        The cache's rows share one column space (server/model/kv_cache.py), so a batch needs rows x its
        longest row's reservation (prompt + max_tokens + ROW_SLACK: one step's columns) token slots.
        """
        if self.kv_slots is None:
            return True
        need = [_reservation(s.request) for s in self.running.values()] + [_reservation(r) for r in requests]
        return len(need) * max(need, default=0) <= self.kv_slots

    def add_request(self, request: GenerationRequest) -> None:
        """Join a request to the batch now (see `add_requests`)."""
        self.add_requests([request])

    def add_requests(self, requests: list[GenerationRequest]) -> None:
        """Join requests to the running batch: prefill every prompt token but the last (which the
        next step feeds), together, and tell the planner. The requests must pass `limits.check`
        (the scheduler and the API check them first); the scheduler keeps the batch within
        `max_batch_size`. All or nothing: when one cannot join, none has.

        With the prefix cache, requests whose prompt starts like another's in the same call (the `n`
        choices of one request; clients sending one system prompt at once) join after it, so they read
        its prefill from the cache instead of computing it again."""
        seqs = [self._sequence(r) for r in requests]
        for seq in seqs:
            if seq.request_id in self.running:
                raise ValueError(f"duplicate request id {seq.request_id!r}")
        leaders, followers = self._followers(seqs)
        self._join(leaders, ride=not followers)  # followers read the leaders' prompts from the cache
        if followers:
            try:
                self._join(followers, ride=True)
            except BaseException:
                self._leave({s.request_id for s in leaders})  # their prompts stay cached: they were computed
                raise

    def _followers(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(leaders, followers): a follower's prompt begins with the same first block (and salt) as an
        earlier request's in `seqs`; none without a prefix cache."""
        if self.prefixes is None or len(seqs) < 2 or not self.parts.on("prefix_cache"):
            return seqs, []
        seen: set[bytes] = set()
        leaders, followers = [], []
        try:
            for seq in seqs:
                first = self.prefixes.names(seq.request.prompt_token_ids[:-1][: self.prefixes.block], seq.cache_salt)
                (followers if first and first[0] in seen else leaders).append(seq)
                seen.update(first)
        except Exception as exc:
            self.parts.failed("prefix_cache", exc)
            return seqs, []
        return leaders, followers

    def _join(self, seqs: list[Sequence], ride: bool = True) -> None:
        """Prefill `seqs` together (loading what the prefix cache holds of each) and tell the planner.

        When `ride` and the target's passes are packed (only real tokens computed), a prompt whose tail
        after the cached prefix is short (`RIDE_TOKENS`) is not prefilled now: the tail rides with the
        row's first step (`Sequence.prefill`), whose verify pass computes it before the row's last prompt
        token and drafts. That saves the row a pass of its own: a request whose prompt is mostly cached
        (an agent's next turn, a chat's next message) starts drafting in the pass that prefills it. Not
        with a KV budget, whose reservations count one step's columns per row (`ROW_SLACK`)."""
        prompts = [list(s.request.prompt_token_ids[:-1]) for s in seqs]
        ids = [s.request_id for s in seqs]
        features = self.planner.needs_hidden  # proposers that read the target's features get every prompt token's
        found, prefixes = self._cached_prefixes(seqs, prompts, features)
        ride = ride and self.runner.packs and self.kv_slots is None
        while True:
            cached = [kv[0].shape[2] if kv is not None else 0 for kv in prefixes or [None] * len(seqs)]
            now = [p[:c] if ride and 0 < len(p) - c <= RIDE_TOKENS else p for p, c in zip(prompts, cached, strict=True)]
            try:
                hidden = self.runner.join(ids, now, hidden=features, prefixes=prefixes)  # of the tokens computed now
                if hidden is not None and found is not None:  # the cached prefix's features, then those
                    hidden = [torch.cat([prefix_cache.concat_features(blocks), h]) if blocks else h
                              for blocks, h in zip(found, hidden, strict=True)]
                break
            except Exception as exc:
                if prefixes is None:
                    raise
                if ids[0] in self.runner.rows:  # joined, but the cached features did not fit: undone
                    self.runner.leave(set(ids))
                self.parts.failed("prefix_cache", exc)  # what it held did not load: a full prefill
                found = prefixes = None
        if hidden is not None and self.prefixes is not None:
            for seq, h in zip(seqs, hidden, strict=True):
                seq.features = [h]
        try:
            self.planner.join(seqs, hidden, found)
        except BaseException:
            self.planner.leave(seqs)  # all or nothing: no half-joined rows stay behind
            self.runner.leave(set(ids))
            raise
        for seq, prompt, computed, c in zip(seqs, prompts, now, cached, strict=True):
            self.running[seq.request_id] = seq
            seq.stats.cached_tokens = c
            seq.prefill = prompt[len(computed):]
            self._cached_tokens += c
            self._prefill_tokens += len(prompt) - c
            if self.prefixes is not None and not seq.prefill:  # now, not at leave: requests arriving meanwhile
                self._remember(seq)  # share the prompt (a riding row's, once its first step computed it)

    def abort_request(self, request_id: str) -> None:
        """Drop a running request now (its client is gone: no output is produced for it)."""
        self._leave({request_id})

    def step(self) -> StepResult:
        """One speculative step for the batch, and what it produced.

        A row whose part of the step raises fails alone (`StepResult.failed`, and it leaves the batch);
        its neighbours' step goes through as if it had never been there. Raises `EngineFault` when a
        failure cannot be pinned on rows (the engine itself is broken: the scheduler stops serving).
        """
        started = time.perf_counter()
        if self.threads is not None and self.running:
            self._govern(self.threads.before_step)
        outputs: list[RequestOutput] = []
        failures: dict[str, Exception] = {}
        seq_stats = self._isolated_step(outputs, failures) if self.running else []
        self._leave({o.request_id for o in outputs if o.finished} | set(failures), failed=set(failures))
        prefill, self._prefill_tokens = self._prefill_tokens, 0
        cached, self._cached_tokens = self._cached_tokens, 0
        failed = {rid: _describe(e) for rid, e in failures.items() if not _own_input(e)}
        rejected = {rid: str(e) for rid, e in failures.items() if _own_input(e)}
        return StepResult(outputs, seq_stats, prefill, time.perf_counter() - started, failed=failed, rejected=rejected,
                          cached_tokens=cached, degraded=self.parts.take_new())

    def _govern(self, call: Callable[..., object], *args: object) -> None:
        """A call of the thread governor; when it raises, or once it is switched off, the steps run at the
        thread count it chose last."""
        assert self.threads is not None
        if self.parts.on("threads"):
            try:
                call(*args)
                return
            except Exception as exc:
                self.parts.failed("threads", exc)
        if torch.get_num_threads() != self.threads.current:
            torch.set_num_threads(self.threads.current)

    # ---- the KV budget -------------------------------------------------------------------------
    def _kv_slots(self, target: LoadedModel, settings: Settings, reserved: int) -> int | None:
        """Token slots `kv_cache_memory` buys when the target's cache and every model proposer's cache
        hold as many tokens each (the proposers' caches grow on demand within about that share)."""
        if settings.kv_cache_memory is None:
            return None
        budget = budget_bytes(settings.kv_cache_memory, self.device, reserved=reserved)
        shapes = [ModelRunner.kv_shape(target.model), *self.planner.cache_shapes()]
        slots = slots_for(budget, shapes)
        if slots < ROW_SLACK + 16:
            per_token = sum(s.bytes_per_token for s in shapes)
            raise ValueError(
                f"kv_cache_memory {settings.kv_cache_memory!r} ({budget} bytes) holds {slots} tokens at "
                f"{per_token} bytes per token; at least {ROW_SLACK + 16} are needed"
            )
        log.info("KV budget %s: %d bytes = %d tokens (%d bytes per token over %d caches)",
                 settings.kv_cache_memory, budget, slots, sum(s.bytes_per_token for s in shapes), len(shapes))
        return slots

    # ---- joining and leaving -------------------------------------------------------------------
    def _sequence(self, request: GenerationRequest) -> Sequence:
        sampling = request.sampling
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else self._seed_source.randrange(2**63))
        stats = RequestStats(
            method=request.speculation.method,
            prompt_tokens=len(request.prompt_token_ids),
            accepted_per_position=[0] * request.speculation.k,
        )
        detok = IncrementalDetokenizer.for_request(self.tokenizer, list(request.prompt_token_ids), sampling)
        grammar = self.grammars.state(request.grammar) if request.grammar is not None else None
        stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else frozenset(self.eos_ids))
        return Sequence(request=request, generator=gen, detokenizer=detok, stats=stats, grammar=grammar,
                        stop_ids=stops)

    def _leave(self, request_ids: set[str], failed: Collection[str] = ()) -> None:
        """Rows leave the batch (finished, aborted or failed); what the cache computed for those that did
        not fail is kept for later prompts that start the same way (prefix_cache.py)."""
        leaving = [self.running[rid] for rid in request_ids if rid in self.running]
        if not leaving:
            return
        if self.prefixes is not None:
            for seq in leaving:
                if seq.request_id not in failed:
                    self._remember(seq)
        self.runner.leave({s.request_id for s in leaving})
        self.planner.leave(leaving)
        for seq in leaving:
            del self.running[seq.request_id]

    def _cached_prefixes(
        self, seqs: list[Sequence], prompts: list[list[int]], features: bool
    ) -> tuple[list[list[prefix_cache.Block]] | None, list[tuple[torch.Tensor, torch.Tensor] | None] | None]:
        """(each prompt's cached blocks, their keys and values joined), or (None, None) without a prefix
        cache or when it fails (a full prefill)."""
        if self.prefixes is None or not self.parts.on("prefix_cache"):
            return None, None
        try:
            found = [self.prefixes.match(p, s.cache_salt, features) for p, s in zip(prompts, seqs, strict=True)]
            return found, [prefix_cache.concat(blocks) if blocks else None for blocks in found]
        except Exception as exc:
            self.parts.failed("prefix_cache", exc)
            return None, None

    def _remember(self, seq: Sequence) -> None:
        """Store a row's computed tokens in the prefix cache (`_store`); a failure stores nothing."""
        if self.parts.on("prefix_cache"):
            try:
                self._store(seq)
            except Exception as exc:
                self.parts.failed("prefix_cache", exc)

    def _store(self, seq: Sequence) -> None:
        """Store a row's computed tokens in the prefix cache (blocks it holds already are not read again):
        the cache's live tokens are the sequence's first ones (a stop may have cut the output shorter
        than what was computed)."""
        row = self.runner.kv.index(seq.request_id)
        tokens = seq.tokens[: self.runner.kv.positions[row]]
        features = torch.cat(seq.features) if seq.features else None  # one per fed token: the cache's live ones
        if seq.features and len(seq.features) > 1:
            seq.features = [features]  # stored again at leave: joined once
        states = self.planner.prefix_states(seq, self.prefixes.block)  # what proposers computed of it
        self.prefixes.store(tokens, seq.cache_salt, self.runner.kv.live(row), features, states)

    # ---- one step, isolated: a row that fails takes no neighbour with it ------------------------
    def _isolated_step(self, outputs: list[RequestOutput], failed: dict[str, Exception]) -> list[SeqStepStats]:
        """Plan, verify and sample for every row; when that raises, undo it (`_Checkpoint`), find the
        rows that fail on their own (each row's step tried alone, undone again), and redo the step with
        those rows held back (they feed nothing, draft nothing, sample nothing). Committing is per row:
        a row whose commit raises fails alone (rows commit independently)."""
        seqs = [self.running[rid] for rid in self.runner.rows]
        ckpt = self._checkpoint(seqs)
        try:
            verified = self._verify(seqs, frozenset())
        except Exception as exc:
            ckpt.restore()
            failed.update(self._culprits(seqs, ckpt, exc))
            hold = frozenset(failed)
            try:
                verified = self._verify(seqs, hold) if len(hold) < len(seqs) else None
            except Exception as again:
                why = f"a step failed again without the rows that fail alone: {_describe(again)}"
                raise EngineFault(why) from again
        stats = self._commit(verified, outputs, failed) if verified is not None else []
        self.planner.settle()  # rows a proposer dropped while planning leave it
        own_fault = all(_own_input(e) for e in failed.values())  # bad input never counts
        self._faulty_steps = self._faulty_steps + 1 if failed and not stats and not own_fault else 0
        if self._faulty_steps >= FAULTY_STEPS:
            last = _describe(next(iter(failed.values())))
            raise EngineFault(f"{FAULTY_STEPS} steps in a row failed every row they ran; last: {last}")
        return stats

    def _checkpoint(self, seqs: list[Sequence]) -> _Checkpoint:
        return _Checkpoint(
            self.runner.kv, self.runner.kv.checkpoint(), self.planner, self.planner.checkpoint(),
            [(s.generator, s.generator.get_state()) for s in seqs],
        )

    def _culprits(self, seqs: list[Sequence], ckpt: _Checkpoint, exc: Exception) -> dict[str, Exception]:
        """Request id -> its exception, for the rows whose step fails alone (the state is restored after each try).
        Raises `EngineFault` when the failure is the engine's: no row fails alone, or every row of a
        batch of several does."""
        if len(seqs) == 1:
            log.warning("step failed for request %s: %s", seqs[0].request_id, _describe(exc), exc_info=exc)
            return {seqs[0].request_id: exc}
        ids = [s.request_id for s in seqs]
        bad: dict[str, Exception] = {}
        for rid in ids:
            try:
                self._verify(seqs, frozenset(ids) - {rid})
            except Exception as alone:
                log.warning("step failed for request %s alone: %s", rid, _describe(alone), exc_info=alone)
                bad[rid] = alone
            finally:
                ckpt.restore()
        if not bad:
            raise EngineFault(f"a step failed but no row fails alone: {_describe(exc)}") from exc
        if len(bad) == len(ids) and not all(_own_input(e) for e in bad.values()):
            raise EngineFault(f"every row of a batch of {len(ids)} fails alone: {_describe(exc)}") from exc
        return bad

    def _verify(self, seqs: list[Sequence], hold: frozenset[str]) -> _Verified:
        """Propose, verify the drafts in one target pass and run the rejection sampler, for the rows not
        in `hold`. Changes only what `_Checkpoint` restores (caches, proposers, generators)."""
        plan = self.planner.plan(seqs, hold)  # propose
        active = [b for b, s in enumerate(seqs) if s.request_id not in hold]
        # Verify every row's drafts in one target pass: feed [last, d_1..d_k], score k+1 positions (a
        # riding row feeds its prompt's tail first: [tail, last, d_1..d_k], scored at the same k+1).
        fed = [[*seq.prefill, seq.last_token, *row.drafts] if seq.request_id not in hold else []
               for seq, row in zip(seqs, plan.rows, strict=True)]
        riding = any(seqs[b].prefill for b in active)
        scored = [len(row.drafts) + 1 if f else 0 for f, row in zip(fed, plan.rows, strict=True)] if riding else None
        started = time.perf_counter()
        out = self.runner.forward(fed, hidden=self.planner.needs_hidden, scored=scored)
        rows = [plan.rows[b] for b in active]
        kept = [seqs[b] for b in active]
        drafts = [r.drafts for r in rows]
        # Row after row, each active row's k + 1 verify positions: what follows costs the computed tokens.
        logits, hidden = out.of_rows(active)  # [positions, vocab], [fed positions, hidden]
        fed_at = list(itertools.accumulate((len(fed[b]) for b in active), initial=0))  # row i's fed positions in hidden
        sampling = BatchSampling.from_params(
            [s.sampling for s in kept], self.device, generated=[len(s.output_ids) for s in kept],
            eos_ids=self.eos_ids, prompts=[s.request.prompt_token_ids for s in kept],
        )  # min_tokens and repetition_penalty need each row's history
        bounds = row_bounds(drafts)  # row i's verify positions: bounds[i]:bounds[i + 1]
        counts = self._token_counts(kept, drafts, bounds) if sampling.any_penalty else None
        allowed = self._allowed(kept, drafts, bounds)  # constrained rows' grammars
        at = sampling.at_positions([len(d) + 1 for d in drafts])
        p = probabilities(logits[:, None], at, _one(counts), _one(allowed))[:, 0]  # [positions, vocab]
        gens = [s.generator for s in kept]
        verdict = rejection_sample(drafts, p, [r.q for r in rows], gens, sampling.greedy.tolist())
        # The pass costs what it computed: the real tokens when packed, else every row padded to the widest.
        seconds = elapsed_since(started, self.device)
        # A thread-count probe times another configuration: the governor compares it, the cost model skips it.
        # A pass that also prefilled (riding rows) is no verify pass of its width: neither learns from it.
        probe = self.threads is not None and self.threads.probing
        predicted = self.planner.observe_verify(out.computed, seconds, record=not probe and not riding,
                                                rows=len(active))
        if self.threads is not None:
            self._govern(self.threads.observe, seconds, None if riding else predicted)
        return _Verified(active, kept, rows, logits, hidden, bounds, fed_at, verdict.accepted, verdict.tokens)

    def _commit(
        self, v: _Verified, outputs: list[RequestOutput], failed: dict[str, Exception]
    ) -> list[SeqStepStats]:
        """Roll back the rejected drafts and commit what each verified row emitted; a row whose commit
        raises joins `failed` (its state is dropped when it leaves; the other rows never read it)."""
        stats = []
        for i, (b, seq, row) in enumerate(zip(v.cache_rows, v.seqs, v.rows, strict=True)):
            at = v.bounds[i]  # row i's verify positions: at .. at + k
            try:
                k, accepted, emitted = len(row.drafts), v.accepted[i], v.tokens[i]
                self.runner.rollback(b, k - accepted)  # the one place target rollback happens
                fed = v.fed_at[i]  # the committed fed tokens: a riding row's prompt tail, last, accepted drafts
                hidden = v.hidden[fed : fed + len(seq.prefill) + accepted + 1] if v.hidden is not None else None
                if seq.features is not None and hidden is not None:  # a copy: the view would keep the step's
                    seq.features.append(hidden.clone())  # whole hidden tensor alive; joined once, at `_remember`
                self.planner.commit(seq, row, emitted, hidden)
                sources = _sources(row, accepted, seq.stats.decode_steps)
                self._record(seq, row, accepted)
                step_stats = SeqStepStats(seq.request_id, seq.mode, row.proposer or "none", k, accepted, len(emitted),
                                          k > 0 and accepted == k)
                logprobs = self._logprobs(v.logits[at : at + k + 1], emitted, seq.sampling.logprobs)
                if seq.grammar is not None:
                    emitted = self._follow_grammar(seq, emitted)
                kept = self._append(seq, emitted)
                if seq.prefill:  # the prompt is in the cache now
                    seq.prefill = []
                    if self.prefixes is not None:
                        self._remember(seq)
                output = self._output(seq, emitted[:kept], logprobs[:kept] if logprobs is not None else None,
                                      sources[:kept])
            except Exception as exc:
                log.warning("commit failed for request %s: %s", seq.request_id, _describe(exc), exc_info=exc)
                failed[seq.request_id] = exc
                continue
            stats.append(step_stats)
            outputs.append(output)
        return stats

    def _allowed(self, seqs: list[Sequence], drafts: list[list[int]], bounds: list[int]) -> torch.Tensor | None:
        """[positions, vocab] bool, row after row: what each constrained row's grammar allows at each of
        its verify positions (None when no row is constrained)."""
        if all(seq.grammar is None for seq in seqs):
            return None
        allowed = torch.ones(bounds[-1], self.vocab_size, dtype=torch.bool)
        for seq, d, at in zip(seqs, drafts, bounds[:-1], strict=True):
            if seq.grammar is not None:
                allowed[at : at + len(d) + 1] = seq.grammar.masks(d)
        return allowed.to(self.device)

    def _follow_grammar(self, seq: Sequence, emitted: list[int]) -> list[int]:
        """Advance a constrained sequence's grammar through the step's tokens. The output ends at the
        token that completes the grammar (finish "stop"); what the step drew after it is dropped, so
        the output is the one plain constrained decoding gives."""
        assert seq.grammar is not None
        for i, token in enumerate(emitted):
            if not seq.grammar.advance([token]):  # p was 0 outside the grammar: a limit hit, never a wrong draw
                raise seq.grammar.failure()
            if seq.grammar.done:
                if not (token in self.eos_ids and not seq.sampling.ignore_eos):
                    seq.finish_reason = "stop"  # complete: nothing but EOS could follow
                return emitted[: i + 1]
        return emitted

    def _token_counts(self, seqs: list[Sequence], drafts: list[list[int]], bounds: list[int]) -> torch.Tensor:
        """[positions, vocab], row after row: the tokens generated before each verify position (the
        row's drafts before it included)."""
        counts = torch.zeros(bounds[-1], self.vocab_size, device=self.device)
        for seq, d, at in zip(seqs, drafts, bounds[:-1], strict=True):
            if seq.output_ids:
                counts[at : at + len(d) + 1] += torch.bincount(
                    torch.tensor(seq.output_ids), minlength=self.vocab_size).to(self.device)
            for j, token in enumerate(d):
                counts[at + j + 1 : at + len(d) + 1, token] += 1
        return counts

    def _record(self, seq: Sequence, row: RowPlan, accepted: int) -> None:
        st, drafts = seq.stats, len(row.drafts)
        st.decode_steps += 1
        st.draft_tokens += drafts
        st.accepted_tokens += accepted
        for j in range(accepted):
            st.accepted_per_position[j] += 1
        if drafts:
            tally = st.by_proposer.setdefault(row.proposer, ProposerTally())
            tally.draft_tokens += drafts
            tally.accepted_tokens += accepted
            if accepted == drafts:
                st.bonus_tokens += 1
            else:
                st.recovered_tokens += 1

    def _append(self, seq: Sequence, emitted: list[int]) -> int:
        """Commit tokens in order until a stop; returns how many reached the output (the rest are dropped)."""
        sp = seq.request.sampling
        for i, token in enumerate(emitted):
            seq.output_ids.append(token)
            if token in seq.stop_ids:
                if sp.include_stop_str_in_output:
                    seq.detokenizer.add(token)  # the stop token's text (none if skip_special_tokens)
                seq.finish_reason = "stop"
                return i + 1
            seq.detokenizer.add(token)
            if seq.detokenizer.stopped:
                seq.finish_reason = "stop"
                return i + 1
            if seq.remaining <= 0:
                seq.finish_reason = "length"
                return i + 1
        return len(emitted)

    def _logprobs(self, logits: torch.Tensor, emitted: list[int], top: int | None) -> list[TokenLogprob] | None:
        """Logprobs of the emitted tokens under the target's raw distribution at their positions."""
        if top is None:
            return None
        lp = raw_logprobs(logits[: len(emitted)])  # [n, vocab]
        chosen = lp.gather(-1, torch.tensor(emitted, device=lp.device)[:, None])[:, 0].tolist()
        best_v, best_i = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
        return [
            TokenLogprob(token, chosen[j], tuple(zip(best_i[j].tolist(), best_v[j].tolist(), strict=True)))
            for j, token in enumerate(emitted)
        ]

    def _output(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None, sources: list[TokenSource]
    ) -> RequestOutput:
        seq.stats.completion_tokens = len(seq.output_ids)
        stats = copy.copy(seq.stats)
        stats.accepted_per_position = list(seq.stats.accepted_per_position)
        stats.by_proposer = {name: copy.copy(t) for name, t in seq.stats.by_proposer.items()}
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=seq.detokenizer.take(final=seq.finished),
            logprobs=logprobs,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stats=stats,
            sources=sources,
        )


RIDE_TOKENS = 128  # the longest prompt tail that rides with a row's first step (`Engine._join`): beyond it, the
# rows already decoding would attend padded to it for a pass's worth of tokens (attention is padded: attention.py)
ROW_SLACK = 33  # KV columns a row may need beyond its prompt + max_tokens: one step's (K <= 32, + 1)
FAULTY_STEPS = 3  # consecutive steps in which every row failed: the engine, not its requests, is broken


class EngineFault(RuntimeError):
    """A step failed in a way no row explains: the engine's state cannot be trusted any more."""


@dataclass(frozen=True)
class _Verified:
    """A step up to the sampler's verdict, for its active rows (index i), in the target cache's order."""

    cache_rows: list[int]  # row i's index in the target cache
    seqs: list[Sequence]
    rows: list[RowPlan]
    logits: torch.Tensor  # [positions, vocab]: row i's k_i + 1 verify positions, row after row
    hidden: torch.Tensor | None  # [fed positions, hidden] when a proposer reads the target's features
    bounds: list[int]  # row i's verify positions in logits: bounds[i]:bounds[i + 1]
    fed_at: list[int]  # row i's fed positions in hidden: fed_at[i]:fed_at[i + 1] (a riding row's tail first)
    accepted: list[int]
    tokens: list[list[int]]  # emitted: accepted drafts + the recovered or bonus token


@dataclass(frozen=True)
class _Checkpoint:
    """What planning, verifying and sampling change, as it was before a step: the target cache, the
    proposers (their caches and pending tokens) and every row's random stream. Sequences themselves
    change only when committing, after the last restore."""

    kv: BatchKV
    kv_state: KVCheckpoint
    planner: Planner
    planner_state: dict[str, object]
    generators: list[tuple[torch.Generator, torch.Tensor]]

    def restore(self) -> None:
        self.kv.restore(self.kv_state)
        self.planner.restore(self.planner_state)
        for gen, state in self.generators:
            gen.set_state(state)


def _one(x: torch.Tensor | None) -> torch.Tensor | None:
    """[positions, ...] -> [positions, 1, ...]: each verify position a row of width 1 for `probabilities`."""
    return x[:, None] if x is not None else None


def _reservation(request: GenerationRequest) -> int:
    """The KV columns a row may need: its prompt, its max_tokens, and one step's columns."""
    return len(request.prompt_token_ids) + request.sampling.max_tokens + ROW_SLACK


def _own_input(exc: BaseException) -> bool:
    """Whether a row failed on its own input (a grammar llguidance cannot follow): the client's 400,
    never a sign that the engine is broken."""
    return isinstance(exc, GrammarError)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _sources(row: RowPlan, accepted: int, step: int) -> list[TokenSource]:
    """Where each of a step's accepted + 1 emitted tokens came from."""
    if not row.drafts:
        return [TokenSource("plain", None, step)]
    last = "bonus" if accepted == len(row.drafts) else "recovered"
    return [TokenSource("accepted", row.proposer, step)] * accepted + [TokenSource(last, row.proposer, step)]


def _eos_ids(model: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (model.tokenizer.eos_token_id, getattr(model.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def build_engine(settings: Settings, *, keep_dense: bool = False) -> Engine:
    """Load the configured target (and draft) and build the engine. Slow: loads weights. The models
    are the engine's alone: the dense weights its packed kernels were reordered from are dropped
    (`Engine.release_dense_weights`) unless `keep_dense` (a caller that also runs transformers'
    forward on the same model, as `bench.overhead` does)."""
    started = time.perf_counter()
    target = load_model(
        settings.target, dtype=settings.target_dtype, device=settings.device, cache_dir=settings.cache_dir,
        weights=settings.weights,
    )
    draft = None
    if settings.draft is not None:
        draft = load_draft_like(target, settings.draft, dtype=settings.draft_dtype, cache_dir=settings.cache_dir)
    log.info(
        "loaded target %s (weights %s) and draft %s on %s in %.1f s",
        target.name, target.weights, draft.name if draft else None, target.device, time.perf_counter() - started,
    )
    engine = Engine(target, draft, settings)
    engine.grammars.warm()  # structured output's tokenizer view (~0.5 s), before the first request
    if settings.calibrate:  # step costs measured (or read back) before the first request: calibration.py
        engine.parts.call("calibration", calibrate, engine, default=None)  # failing: learnt from traffic
    if not keep_dense:
        freed = engine.release_dense_weights()
        if freed:
            log.info("dropped %.0f MB of dense weights the packed kernels replace", freed / 2**20)
    return engine
