"""The speculative decoding engine: one `step()` = propose -> verify -> accept -> commit for a batch.

Single-threaded by contract: the scheduler calls it from one worker thread. Requests join at the
start of a step (their prompts are prefilled then) and leave at its end (finished or aborted).
"""

from __future__ import annotations

import copy
import logging
import random
import time

import torch

from server.config import Settings
from server.engine.attention import use_gqa_attention
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.kv_cache import BatchKV
from server.engine.models import LoadedModel, load_draft_like, load_model
from server.engine.sampling import BatchSampling, probabilities, raw_logprobs
from server.engine.sequence import Sequence
from server.engine.types import (
    GenerationRequest,
    RequestOutput,
    RequestStats,
    SeqStepStats,
    StepResult,
    TokenLogprob,
)
from server.spec.adaptive import AdaptivePolicy, BatchRow
from server.spec.draft import DraftModelProposer
from server.spec.ngram import NgramProposer
from server.spec.proposer import Proposer
from server.spec.rejection import rejection_sample

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None, settings: Settings) -> None:
        self.target = target
        self.settings = settings
        self.tokenizer = target.tokenizer
        self.device = target.device
        self.model_name = settings.served_model_name or target.name
        self.max_context = settings.max_model_len or target.max_context
        self.vocab_size = int(target.model.config.vocab_size)  # logits width (may exceed the tokenizer's)
        self.draft_name = draft.name if draft is not None else None
        for loaded in (target, draft):
            if loaded is not None:
                use_gqa_attention(loaded.model)
        self.kv = BatchKV(target.model)
        self.proposers: dict[str, Proposer] = {"ngram": NgramProposer(settings.ngram_max, settings.ngram_min)}
        if draft is not None:
            self.proposers["draft"] = DraftModelProposer(draft, self.vocab_size)
        # auto: n-gram lookup costs next to nothing per draft token; the draft model's cost is timed.
        self.policy = AdaptivePolicy(list(self.proposers), draft_token_cost={"ngram": 0.002})
        self.eos_ids = _eos_ids(target)
        self.waiting: list[Sequence] = []
        self.running: dict[str, Sequence] = {}  # in the target cache's row order
        self._aborted: set[str] = set()
        self._seed_source = random.SystemRandom()

    # ---- the scheduler's interface -------------------------------------------------------------
    @property
    def has_draft(self) -> bool:
        return "draft" in self.proposers

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def kv_cache_usage(self) -> float:
        """Live KV tokens as a fraction of what `max_batch_size` full-context rows would hold."""
        return self.kv.live_tokens / (self.settings.max_batch_size * self.max_context)

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request for the next step. Raises ValueError (a user-facing message) on bad input."""
        self._validate(request)
        sampling = request.sampling
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else self._seed_source.randrange(2**63))
        stats = RequestStats(
            method=request.speculation.method,
            prompt_tokens=len(request.prompt_token_ids),
            accepted_per_position=[0] * request.speculation.k,
        )
        detok = IncrementalDetokenizer.for_request(self.tokenizer, list(request.prompt_token_ids), sampling)
        self.waiting.append(Sequence(request=request, generator=gen, detokenizer=detok, stats=stats))

    def abort_request(self, request_id: str) -> None:
        """Drop a request at the next step; it gets a final output with finish_reason "abort"."""
        if request_id in self.running or any(s.request_id == request_id for s in self.waiting):
            self._aborted.add(request_id)

    def step(self) -> StepResult:
        """Admit waiting requests, run one speculative step for the batch, and report what it produced."""
        started = time.perf_counter()
        outputs = self._abort_pending()
        prefill_tokens = self._admit()
        seq_stats: list[SeqStepStats] = []
        if self.running:
            seq_stats = self._speculative_step(outputs)
        finished = {o.request_id for o in outputs if o.finished}
        self._leave(finished)
        return StepResult(outputs, seq_stats, prefill_tokens, time.perf_counter() - started)

    # ---- admission and leaving -----------------------------------------------------------------
    def _validate(self, request: GenerationRequest) -> None:
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        total = len(prompt) + request.sampling.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"this model's maximum context length is {self.max_context} tokens, but the request asks "
                f"for {total} ({len(prompt)} in the prompt + {request.sampling.max_tokens} max_tokens)"
            )
        method = request.speculation.method
        if method not in ("none", "auto") and method not in self.proposers:
            raise ValueError(f"speculation method {method!r} is not available: the server has no draft model")
        rid = request.request_id
        if rid in self.running or any(s.request_id == rid for s in self.waiting):
            raise ValueError(f"duplicate request id {rid!r}")

    def _admit(self) -> int:
        """Prefill waiting sequences (all but their last prompt token) and join them to the batch."""
        room = self.settings.max_batch_size - len(self.running)
        joining, self.waiting = self.waiting[:room], self.waiting[room:]
        if not joining:
            return 0
        fresh = self.kv.new_rows([s.request_id for s in joining])
        prompts = [list(s.request.prompt_token_ids[:-1]) for s in joining]
        fresh.prefill(prompts)
        self.kv.add_rows(fresh)
        for seq in joining:
            self.running[seq.request_id] = seq
        for method, proposer in self.proposers.items():
            users = [s for s in joining if s.uses(method)]
            if users:
                proposer.join(users)
        return sum(len(p) for p in prompts)

    def _leave(self, request_ids: set[str]) -> None:
        request_ids = {rid for rid in request_ids if rid in self.running}
        if not request_ids:
            return
        self.kv.remove_rows(request_ids)
        for method, proposer in self.proposers.items():
            proposer.leave({rid for rid in request_ids if self.running[rid].uses(method)})
        for rid in request_ids:
            del self.running[rid]
            self.policy.forget(rid)

    def _abort_pending(self) -> list[RequestOutput]:
        if not self._aborted:
            return []
        outputs = []
        for seq in [s for s in self.waiting if s.request_id in self._aborted]:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
            outputs.append(self._output(seq, [], None))
        aborted_running = {rid for rid in self._aborted if rid in self.running}
        for rid in aborted_running:
            self.running[rid].finish_reason = "abort"
            outputs.append(self._output(self.running[rid], [], None))
        self._leave(aborted_running)
        self._aborted.clear()
        return outputs

    # ---- one speculative step ------------------------------------------------------------------
    def _speculative_step(self, outputs: list[RequestOutput]) -> list[SeqStepStats]:
        seqs = [self.running[rid] for rid in self.kv.rows]
        methods, drafts, q, matches = self._propose(seqs)

        # Verify every row's drafts in one target pass: feed [last, d_1..d_k], score k+1 positions.
        fed = [[seq.last_token, *d] for seq, d in zip(seqs, drafts, strict=True)]
        started = time.perf_counter()
        logits = self.kv.forward(fed)
        sampling = BatchSampling.from_params(
            [s.request.sampling for s in seqs], self.device, generated=[len(s.output_ids) for s in seqs],
            eos_ids=self.eos_ids, prompts=[s.request.prompt_token_ids for s in seqs],
        )  # min_tokens and repetition_penalty need each row's history
        counts = self._token_counts(seqs, drafts, logits.shape[1]) if sampling.any_penalty else None
        p = probabilities(logits, sampling, counts)  # [batch, K+1, vocab]
        # Every row but the draft model's draws its tokens exactly as plain decoding would (see
        # rejection.py), so a seeded request's text does not depend on its n-gram drafts.
        exact = [m != "draft" for m in methods]
        verdict = rejection_sample(drafts, p, q, [s.generator for s in seqs], exact, sampling.greedy.tolist())
        # The pass costs what it computes: every row padded to the widest one, not just real tokens.
        self.policy.cost.observe_verify(len(fed) * logits.shape[1], self._elapsed(started))

        stats = []
        for b, seq in enumerate(seqs):
            k, accepted, emitted = len(drafts[b]), verdict.accepted[b], verdict.tokens[b]
            self.kv.rollback(b, k - accepted)  # the one place target rollback happens
            for method, proposer in self.proposers.items():
                if seq.uses(method):
                    proposer.commit(seq, drafts[b] if methods[b] == method else [], emitted)
            self.policy.observe(seq.request_id, methods[b], k, accepted, matches.get(b), seq.sampled)
            self._record(seq, k, accepted)
            stats.append(SeqStepStats(seq.request_id, seq.method, k, accepted, len(emitted), k > 0 and accepted == k))
            logprobs = self._logprobs(logits[b], emitted, seq.request.sampling.logprobs)
            kept = self._append(seq, emitted)
            outputs.append(self._output(seq, emitted[:kept], logprobs[:kept] if logprobs is not None else None))
        return stats

    def _plan(
        self, seqs: list[Sequence], lookups: dict[int, list[int]], matches: dict[int, int]
    ) -> list[tuple[str, int]]:
        """(proposer, K) per row this step: the request's own, or the adaptive policy's for `auto`."""
        plan: list[tuple[str, int]] = []
        auto_rows = []
        for b, seq in enumerate(seqs):
            k_max = seq.num_drafts()
            if seq.method != "auto":
                plan.append((seq.method, k_max))
                continue
            choice = self.policy.choose(
                seq.request_id, k_max,
                rows=len(seqs),
                has_match=bool(lookups.get(b)),
                reproducible=seq.reproducible,
                match_len=matches.get(b),
                sampled=seq.sampled,
            )
            plan.append((choice.method, choice.k))
            auto_rows.append(b)
        if len(seqs) > 1 and auto_rows:
            self._widen(seqs, plan, set(auto_rows), lookups, matches)
        return plan

    def _widen(
        self,
        seqs: list[Sequence],
        plan: list[tuple[str, int]],
        auto_rows: set[int],
        lookups: dict[int, list[int]],
        matches: dict[int, int],
    ) -> None:
        """In a batch, the verify pass is as wide as its widest row for every row: let the policy pick
        that width for the whole batch, and give each flexible row (auto, with an n-gram proposal, not
        using the draft model this step) as many of its n-gram drafts as fit. Auto rows
        that chose the draft model keep it only if the batch as a whole gains from it (each row chose
        alone, but the draft forward and the wider pass are paid by every row)."""

        def rows_for(demote: bool) -> list[BatchRow]:
            rows = []
            for b, seq in enumerate(seqs):
                method, k = plan[b]
                offer = min(len(lookups.get(b, ())), seq.num_drafts())
                free = b in auto_rows
                if free and demote and method == "draft":
                    method, k = "none", 0
                if free and method in ("none", "ngram") and offer:
                    rows.append(BatchRow(seq.request_id, flexible=offer, match_len=matches.get(b), sampled=seq.sampled))
                elif method == "ngram":
                    rows.append(BatchRow(seq.request_id, method, min(k, offer), matches.get(b), sampled=seq.sampled))
                else:
                    rows.append(BatchRow(seq.request_id, method, k if method == "draft" else 0, sampled=seq.sampled))
            return rows

        rows = rows_for(demote=False)
        best = self.policy.batch_width(rows)
        if best is None:
            return
        if any(plan[b][0] == "draft" for b in auto_rows):
            without = rows_for(demote=True)
            other = self.policy.batch_width(without)
            if other is not None and other[1] >= best[1]:
                rows, best = without, other
                for b in auto_rows:
                    if plan[b][0] == "draft":
                        plan[b] = ("none", 0)
        width = best[0]
        for b, row in enumerate(rows):
            if row.flexible:
                k = min(width, row.flexible)
                plan[b] = ("ngram", k) if k else ("none", 0)

    def _propose(
        self, seqs: list[Sequence]
    ) -> tuple[list[str], list[list[int]], torch.Tensor | None, dict[int, int]]:
        """Plan, then ask each proposer for its rows' drafts. Returns each row's proposer this step,
        the drafts, q for the batch ([batch, K, vocab]; None when every row's q is one-hot), and the
        n-gram match length of every row whose drafts this step are n-gram ones."""
        # The n-gram lookup runs first: it is nearly free, and `auto` needs to know whether it matches.
        # Its proposal is prefix-consistent, so looking up k_max tokens and keeping k equals asking for k.
        lookups: dict[int, list[int]] = {}
        found_len: dict[int, int] = {}
        if "ngram" in self.proposers:
            rows = [b for b, s in enumerate(seqs) if s.uses("ngram")]
            if rows:
                found = self.proposers["ngram"].propose([seqs[b] for b in rows], [seqs[b].num_drafts() for b in rows])
                lookups = dict(zip(rows, found.drafts, strict=True))
                found_len = dict(zip(rows, found.match_lengths or [0] * len(rows), strict=True))
        plan = self._plan(seqs, lookups, found_len)
        methods = [m for m, _ in plan]
        drafts: list[list[int]] = [lookups[b][:k] if m == "ngram" else [] for b, (m, k) in enumerate(plan)]
        matches = {b: found_len[b] for b, (m, k) in enumerate(plan) if m == "ngram" and k and found_len.get(b)}

        model_q: dict[int, torch.Tensor] = {}  # row -> [k, vocab] for the draft model's rows
        if "draft" in self.proposers:
            rows = [b for b, s in enumerate(seqs) if s.uses("draft")]
            if rows:
                ks = [plan[b][1] if plan[b][0] == "draft" else 0 for b in rows]
                started = time.perf_counter()
                proposal = self.proposers["draft"].propose([seqs[b] for b in rows], ks)
                self.policy.cost.observe_draft(max(ks), self._elapsed(started))
                for i, b in enumerate(rows):
                    if ks[i]:
                        drafts[b] = proposal.drafts[i]
                        model_q[b] = proposal.probs[i, : len(drafts[b])]
        if not model_q:
            return methods, drafts, None, matches
        k_max = max(len(d) for d in drafts)
        q = torch.zeros(len(seqs), k_max, self.vocab_size, device=self.device)
        for b, d in enumerate(drafts):
            if b in model_q:
                q[b, : len(d)] = model_q[b].to(self.device)
            elif d:  # a deterministic proposer in a mixed batch: q is one-hot at its tokens
                q[b, torch.arange(len(d)), torch.tensor(d)] = 1.0
        return methods, drafts, q, matches

    def _elapsed(self, started: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # timings feed `auto`: count the kernels, not the launch
        return time.perf_counter() - started

    def _token_counts(self, seqs: list[Sequence], drafts: list[list[int]], width: int) -> torch.Tensor:
        """[batch, W, vocab]: generated tokens before each verify position (drafts before it included)."""
        counts = torch.zeros(len(seqs), width, self.vocab_size, device=self.device)
        for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True)):
            if seq.output_ids:
                counts[b] += torch.bincount(torch.tensor(seq.output_ids), minlength=self.vocab_size).to(self.device)
            for j, token in enumerate(d):
                counts[b, j + 1 :, token] += 1
        return counts

    def _record(self, seq: Sequence, drafts: int, accepted: int) -> None:
        st = seq.stats
        st.decode_steps += 1
        st.draft_tokens += drafts
        st.accepted_tokens += accepted
        for j in range(accepted):
            st.accepted_per_position[j] += 1
        if drafts:
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

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        seq.stats.completion_tokens = len(seq.output_ids)
        stats = copy.copy(seq.stats)
        stats.accepted_per_position = list(seq.stats.accepted_per_position)
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=seq.detokenizer.take(final=seq.finished),
            logprobs=logprobs,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stats=stats,
        )


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
    return Engine(target, draft, settings)
