"""The speculative decoding engine: one `step()` = plan -> verify -> accept -> commit for a batch.

Single-threaded by contract: the scheduler calls it from one worker thread, and owns the waiting
queue. A request joins when the scheduler adds it (its prompt is prefilled then) and leaves at the
end of the step that finishes it, or when it is aborted. The engine never names a proposer: the
planner (server/speculation/planner.py) decides who drafts what, the model runner runs the target,
and the rejection sampler decides what is kept (docs/design.md).
"""

from __future__ import annotations

import copy
import logging
import random
import time

import torch

from server.config import Settings
from server.engine.calibration import calibrate
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sequence import Sequence
from server.grammar import GrammarError, Grammars
from server.model.attention import use_gqa_attention
from server.model.loading import LoadedModel, load_draft_like, load_model
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, probabilities, raw_logprobs
from server.speculation.adaptive import CostModel
from server.speculation.planner import Planner, RowPlan, elapsed_since
from server.speculation.proposer import BuildContext
from server.speculation.registry import BUILTIN, Registry
from server.speculation.rejection import rejection_sample
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
        self.vocab_size = int(target.model.config.vocab_size)  # logits width (may exceed the tokenizer's)
        self.draft_name = draft.name if draft is not None else None
        for loaded in (target, draft):
            if loaded is not None:
                use_gqa_attention(loaded.model)
        self.runner = ModelRunner(target.model)
        self.planner = Planner(BuildContext(target, draft, settings, self.vocab_size), registry, cost)
        self.limits = ServingLimits(
            max_context=settings.max_model_len or target.max_context,
            vocab_size=self.vocab_size,
            methods=self.planner.methods,
        )
        if settings.speculation not in self.limits.methods:
            raise ValueError(
                f"the configured speculation method {settings.speculation!r} cannot run on this server "
                f"(available: {', '.join(self.limits.methods)})"
            )
        self.eos_ids = _eos_ids(target)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        self.running: dict[str, Sequence] = {}  # in the target cache's row order
        self._prefill_tokens = 0  # prompt tokens prefilled since the last step (reported with it)
        self._seed_source = random.SystemRandom()

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

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def kv_cache_usage(self) -> float:
        """Live KV tokens as a fraction of what `max_batch_size` full-context rows would hold."""
        return self.runner.kv.live_tokens / (self.settings.max_batch_size * self.max_context)

    def add_request(self, request: GenerationRequest) -> None:
        """Join a request to the batch now (see `add_requests`)."""
        self.add_requests([request])

    def add_requests(self, requests: list[GenerationRequest]) -> None:
        """Join requests to the running batch: prefill every prompt token but the last (which the
        next step feeds), together, and tell the planner. The requests must pass `limits.check`
        (the scheduler and the API check them first); the scheduler keeps the batch within
        `max_batch_size`."""
        seqs = [self._sequence(r) for r in requests]
        for seq in seqs:
            if seq.request_id in self.running:
                raise ValueError(f"duplicate request id {seq.request_id!r}")
        prompts = [list(s.request.prompt_token_ids[:-1]) for s in seqs]
        hidden = self.runner.join([s.request_id for s in seqs], prompts, hidden=self.planner.needs_hidden)
        for seq in seqs:
            self.running[seq.request_id] = seq
        self.planner.join(seqs, hidden)
        self._prefill_tokens += sum(len(p) for p in prompts)

    def abort_request(self, request_id: str) -> None:
        """Drop a running request now (its client is gone: no output is produced for it)."""
        self._leave({request_id})

    def step(self) -> StepResult:
        """One speculative step for the batch, and what it produced."""
        started = time.perf_counter()
        outputs: list[RequestOutput] = []
        seq_stats = self._speculative_step(outputs) if self.running else []
        self._leave({o.request_id for o in outputs if o.finished})
        prefill, self._prefill_tokens = self._prefill_tokens, 0
        return StepResult(outputs, seq_stats, prefill, time.perf_counter() - started)

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
        return Sequence(request=request, generator=gen, detokenizer=detok, stats=stats, grammar=grammar)

    def _leave(self, request_ids: set[str]) -> None:
        leaving = [self.running[rid] for rid in request_ids if rid in self.running]
        if not leaving:
            return
        self.runner.leave({s.request_id for s in leaving})
        self.planner.leave(leaving)
        for seq in leaving:
            del self.running[seq.request_id]

    # ---- one speculative step ------------------------------------------------------------------
    def _speculative_step(self, outputs: list[RequestOutput]) -> list[SeqStepStats]:
        seqs = [self.running[rid] for rid in self.runner.rows]
        plan = self.planner.plan(seqs)  # propose

        # Verify every row's drafts in one target pass: feed [last, d_1..d_k], score k+1 positions.
        fed = [[seq.last_token, *row.drafts] for seq, row in zip(seqs, plan.rows, strict=True)]
        started = time.perf_counter()
        out = self.runner.forward(fed, hidden=self.planner.needs_hidden)
        logits = out.logits  # [batch, K+1, vocab]
        sampling = BatchSampling.from_params(
            [s.sampling for s in seqs], self.device, generated=[len(s.output_ids) for s in seqs],
            eos_ids=self.eos_ids, prompts=[s.request.prompt_token_ids for s in seqs],
        )  # min_tokens and repetition_penalty need each row's history
        counts = self._token_counts(seqs, plan.drafts, logits.shape[1]) if sampling.any_penalty else None
        allowed = self._allowed(seqs, plan.drafts, logits.shape[1])  # constrained rows' grammars
        p = probabilities(logits, sampling, counts, allowed)  # [batch, K+1, vocab]
        verdict = rejection_sample(plan.drafts, p, plan.q, [s.generator for s in seqs], sampling.greedy.tolist())
        # The pass costs what it computes: every row padded to the widest one, not just real tokens.
        self.planner.observe_verify(len(fed) * logits.shape[1], elapsed_since(started, self.device))

        stats = []
        for b, (seq, row) in enumerate(zip(seqs, plan.rows, strict=True)):
            k, accepted, emitted = len(row.drafts), verdict.accepted[b], verdict.tokens[b]
            self.runner.rollback(b, k - accepted)  # the one place target rollback happens
            hidden = out.hidden[b, : accepted + 1] if out.hidden is not None else None  # the committed fed tokens
            self.planner.commit(seq, row, emitted, hidden)
            sources = _sources(row, accepted, seq.stats.decode_steps)
            self._record(seq, row, accepted)
            stats.append(
                SeqStepStats(seq.request_id, seq.mode, row.proposer or "none", k, accepted, len(emitted),
                             k > 0 and accepted == k)
            )
            logprobs = self._logprobs(logits[b], emitted, seq.sampling.logprobs)
            if seq.grammar is not None:
                emitted = self._follow_grammar(seq, emitted)
            kept = self._append(seq, emitted)
            outputs.append(
                self._output(seq, emitted[:kept], logprobs[:kept] if logprobs is not None else None, sources[:kept])
            )
        return stats

    def _allowed(self, seqs: list[Sequence], drafts: list[list[int]], width: int) -> torch.Tensor | None:
        """[batch, W, vocab] bool: what each constrained row's grammar allows at each verify position
        (None when no row is constrained)."""
        if all(seq.grammar is None for seq in seqs):
            return None
        allowed = torch.ones(len(seqs), width, self.vocab_size, dtype=torch.bool)
        for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
            if seq.grammar is not None:
                allowed[b, : len(d) + 1] = seq.grammar.masks(d)
        return allowed.to(self.device)

    def _follow_grammar(self, seq: Sequence, emitted: list[int]) -> list[int]:
        """Advance a constrained sequence's grammar through the step's tokens. The output ends at the
        token that completes the grammar (finish "stop"); what the step drew after it is dropped, so
        the output is the one plain constrained decoding gives."""
        assert seq.grammar is not None
        for i, token in enumerate(emitted):
            if not seq.grammar.advance([token]):  # p was 0 outside the grammar: a limit hit, never a wrong draw
                raise GrammarError(f"the grammar could not be followed: {seq.grammar.error.splitlines()[0]}")
            if seq.grammar.done:
                if not (token in self.eos_ids and not seq.sampling.ignore_eos):
                    seq.finish_reason = "stop"  # complete: nothing but EOS could follow
                return emitted[: i + 1]
        return emitted

    def _token_counts(self, seqs: list[Sequence], drafts: list[list[int]], width: int) -> torch.Tensor:
        """[batch, W, vocab]: generated tokens before each verify position (drafts before it included)."""
        counts = torch.zeros(len(seqs), width, self.vocab_size, device=self.device)
        for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
            if seq.output_ids:
                counts[b] += torch.bincount(torch.tensor(seq.output_ids), minlength=self.vocab_size).to(self.device)
            for j, token in enumerate(d):
                counts[b, j + 1 :, token] += 1
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
            if token in sp.stop_token_ids or (token in self.eos_ids and not sp.ignore_eos):
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


def build_engine(settings: Settings) -> Engine:
    """Load the configured target (and draft) and build the engine. Slow: loads weights."""
    started = time.perf_counter()
    target = load_model(
        settings.target, dtype=settings.target_dtype, device=settings.device, cache_dir=settings.cache_dir
    )
    draft = None
    if settings.draft is not None:
        draft = load_draft_like(target, settings.draft, dtype=settings.draft_dtype, cache_dir=settings.cache_dir)
    log.info(
        "loaded target %s and draft %s on %s in %.1f s",
        target.name, draft.name if draft else None, target.device, time.perf_counter() - started,
    )
    engine = Engine(target, draft, settings)
    engine.grammars.warm()  # structured output's tokenizer view (~0.5 s), before the first request
    if settings.calibrate:  # step costs measured (or read back) before the first request: calibration.py
        calibrate(engine)
    return engine
