"""Rows joining and leaving the engine's batch: their prompts computed by the steps (or read from the prefix
cache), the KV budget, and what rows leave behind for later prompts that start the same way.

`Admission` owns the running rows (`running`, in no particular order: the target cache's row order is the
batch's, the order rows entered it). A request joins when the scheduler adds it, without any computing; it
enters the target's batch at the first step whose token budget reaches its prompt (`enter`, oldest first),
and each step's pass then computes a chunk of its prompt (server/speculation/budget.py), stored in the
prefix cache block by block (`prefilled`), until the step that computes the last one also verifies its
last token. It leaves at the end of the step that finishes it, when it is aborted (mid-prompt too), or when
its step failed. The prefix cache is optional (server/failsafe.py): when it raises, a prompt is computed in
full and nothing is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import torch

from server.config import Settings
from server.engine.sequence import Sequence
from server.failsafe import OptionalParts
from server.model import prefix_cache
from server.model.kv_shape import KVShape, slots_for
from server.model.lean_forward import LeanForward
from server.model.memory import budget_bytes, free_bytes
from server.model.runner import ModelRunner
from server.model.static_step import StaticStep, row_buckets
from server.speculation.budget import entering
from server.speculation.planner import Planner
from server.types import GenerationRequest

log = logging.getLogger(__name__)

ROW_SLACK = 33  # KV columns a row may need beyond its prompt + max_tokens: one step's (K <= 32, + 1)


def row_slack(budget: int) -> int:
    """KV columns a row may need beyond its prompt + max_tokens: a step's widest row (its drafts, or a chunk
    of a prompt: every row's columns advance with the widest row's, model/kv_cache.py)."""
    return max(ROW_SLACK, budget)


def kv_slots(
    settings: Settings, device: torch.device, shapes: list[KVShape], reserved: int, slack: int = ROW_SLACK
) -> int | None:
    """Token slots `kv_cache_memory` buys when the target's cache and every model proposer's cache (`shapes`)
    hold as many tokens each (the proposers' caches grow on demand within about that share); None without
    a budget. `reserved`: bytes a fraction of free memory leaves to the prefix cache; `slack`: `row_slack`."""
    if settings.kv_cache_memory is None:
        return None
    budget = budget_bytes(settings.kv_cache_memory, device, reserved=reserved)
    slots = slots_for(budget, shapes)
    per_token = sum(s.bytes_per_token for s in shapes)
    if slots < slack + 16:
        raise ValueError(f"kv_cache_memory {settings.kv_cache_memory!r} ({budget} bytes) holds {slots} tokens at "
                         f"{per_token} bytes per token; at least {slack + 16} are needed (a row and one step's "
                         f"columns: max_num_batched_tokens)")
    log.info("KV budget %s: %d bytes = %d tokens (%d bytes per token over %d caches)",
             settings.kv_cache_memory, budget, slots, per_token, len(shapes))
    return slots


def _reservation(request: GenerationRequest, slack: int) -> int:
    """The KV columns a row may need: its prompt, its max_tokens, and one step's columns (`row_slack`)."""
    return len(request.prompt_token_ids) + request.sampling.max_tokens + slack


def pinned_columns(
    settings: Settings, model: torch.nn.Module, slots: int | None, wanted: int, slack: int, per_token: int
) -> int | None:
    """Every row's columns in the target's cache where the `compile` setting runs its passes at static shapes
    (static_step.py: `on`, or `auto` on a GPU) and its forward allows it: a row's context and a step's columns
    (`wanted`), within the KV budget split over the largest row bucket; None: the cache's columns move as it
    needs. Without a budget on a GPU, where the pinned rows are allocated at once (`per_token` bytes a token),
    more than the device has free is refused here, with what to set, rather than failing to allocate."""
    if settings.compile == "off" or (settings.compile == "auto" and model.device.type != "cuda"):
        return None
    why = StaticStep.refuses(LeanForward.of(model))
    if why is not None:
        log.info("compile=%s: passes stay eager (%s)", settings.compile, why)
        return None
    rows = row_buckets(settings.max_batch_size)[-1]
    if slots is None:
        need, free = rows * wanted * per_token, free_bytes(model.device)
        if model.device.type == "cuda" and need > free:
            raise ValueError(f"compile={settings.compile} pins {rows} rows of {wanted} tokens of KV cache "
                             f"({need / 2**30:.1f} GiB), more than the device's {free / 2**30:.1f} GiB free: "
                             "set kv_cache_memory, max_model_len or max_batch_size")
        return wanted
    columns = min(wanted, slots // rows)
    if columns < slack + 16:
        raise ValueError(f"kv_cache_memory holds {slots} tokens: too few for {settings.max_batch_size} rows of "
                         f"static-shape passes (compile=on) with {slack} columns of a step's each")
    return columns


class Admission:
    """The running rows, their joining and leaving (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        planner: Planner,
        parts: OptionalParts,
        start: Callable[[GenerationRequest], Sequence],
        prefixes: prefix_cache.PrefixCache | None,
        kv_slots: int | None,
        max_rows: int,
        slack: int = ROW_SLACK,
    ) -> None:
        """`start`: a joining request's `Sequence`; `kv_slots`: the KV budget in tokens per cache, or None;
        `max_rows`: the batch's size limit (what `usage` counts against without a budget); `slack`: a row's
        KV columns beyond its prompt and max_tokens (`row_slack`)."""
        self.runner, self.planner, self.parts, self.start = runner, planner, parts, start
        self.prefixes, self.kv_slots, self.max_rows, self.slack = prefixes, kv_slots, max_rows, slack
        self.running: dict[str, Sequence] = {}  # every row joined: in the target's batch, or `joining`
        self.joining: list[Sequence] = []  # joined, not in the target's batch yet (in the order they joined)
        self.prefill_tokens = 0  # prompt tokens computed since the last `take_counts`
        self.cached_tokens = 0  # prompt tokens read from the prefix cache since then

    # ---- the KV budget -------------------------------------------------------------------------------
    def fits(self, requests: list[GenerationRequest]) -> bool:
        """Whether `requests` can join the running rows now within the KV budget (always, without one).
        The cache's rows share one column space (model/kv_cache.py), so a batch needs rows x its longest
        row's reservation (prompt + max_tokens + one step's columns) token slots."""
        if self.kv_slots is None:
            return True
        need = [_reservation(s.request, self.slack) for s in self.running.values()]
        need += [_reservation(r, self.slack) for r in requests]
        return len(need) * max(need, default=0) <= self.kv_slots

    def usage(self, max_context: int) -> float:
        """With a KV budget, the fraction of it the running rows hold (rows x the largest reservation, what
        `fits` counts); without, live KV tokens over what `max_rows` full-context rows would hold."""
        if self.kv_slots is None:
            return self.runner.kv.live_tokens / (self.max_rows * max_context)
        need = [_reservation(s.request, self.slack) for s in self.running.values()]
        return len(need) * max(need, default=0) / self.kv_slots

    def prompt_waiting(self) -> int:
        """Prompt tokens of the joined rows not computed yet (nor read from the prefix cache)."""
        return sum(s.prompt_left for s in self.running.values())

    def take_counts(self) -> tuple[int, int]:
        """(prompt tokens computed, prompt tokens read from the prefix cache) since the last call."""
        counts = self.prefill_tokens, self.cached_tokens
        self.prefill_tokens = self.cached_tokens = 0
        return counts

    # ---- joining ---------------------------------------------------------------------------------------
    def join(self, requests: list[GenerationRequest]) -> None:
        """The requests join: their sequences wait, nothing computed, for the steps whose token budget reaches
        their prompts (`enter`). All or nothing: when one request cannot join, none has."""
        seqs = [self.start(r) for r in requests]
        ids = [s.request_id for s in seqs]
        for rid in ids:
            if rid in self.running or ids.count(rid) > 1:
                raise ValueError(f"duplicate request id {rid!r}")
        for seq in seqs:
            self.running[seq.request_id] = seq
            self.joining.append(seq)

    def enter(self, budget: int) -> dict[str, Exception]:
        """Joining rows enter the target's batch, in the order they joined, while the step's `budget` has
        tokens left after the batch's decoding rows and the prompts that finish (budget.py `entering`: a
        prompt too long for this step leaves the rest to short ones): the longest prefix of each prompt the
        prefix cache holds now is loaded (so a prompt that starts like one computed a moment ago reads it:
        blocks are stored as chunks are computed), the rest is left to the steps' passes, and the planner
        tells the proposers. A row whose prompt starts with the same first block as one whose whole blocks are
        still being computed waits until they are stored (the `n` choices of one request; clients sending one
        system prompt at once) and then reads them. Returns the rows that could not enter (they left), with why."""
        if not self.joining:
            return {}
        batch = [self.running[rid] for rid in self.runner.rows]
        left = entering(budget, [s.prompt_left for s in batch])
        busy = {self._first_block(s) for s in batch if self._storing(s, s.prompt_computed)} - {None}
        seqs, found = [], []
        for seq in list(self.joining):
            if left <= 0:
                break
            first = self._first_block(seq)
            if first in busy:
                continue
            blocks = self._match(seq)
            cached = len(blocks) * self.prefixes.block if self.prefixes is not None and blocks else 0
            if self._storing(seq, cached):
                busy |= {first} - {None}
            left -= seq.prompt_left - cached + 1
            seqs.append(seq)
            found.append(blocks)
        if not seqs:
            return {}
        entered = {s.request_id for s in seqs}
        self.joining = [s for s in self.joining if s.request_id not in entered]
        try:
            self._enter(seqs, found if self.prefixes is not None and self.parts.on("prefix_cache") else None)
        except Exception as exc:  # noqa: BLE001 - pinned on the rows entering (they leave: the step goes on)
            for seq in seqs:
                del self.running[seq.request_id]
            return {s.request_id: exc for s in seqs}
        finally:  # the rows in the batch in its order (oldest first), then those still joining
            self.running = {rid: self.running[rid] for rid in self.runner.rows if rid in self.running} | {
                s.request_id: s for s in self.joining}
        return {}

    def _storing(self, seq: Sequence, computed: int) -> bool:
        """Whether the row, `computed` prompt tokens in (or read from the cache), has whole blocks of its prompt
        left to compute and store: a row whose prompt starts the same way reads them if it waits."""
        if self.prefixes is None:
            return False
        return (len(seq.request.prompt_token_ids) - 1) // self.prefixes.block * self.prefixes.block > computed

    def _enter(self, seqs: list[Sequence], found: list[list[prefix_cache.Block]] | None) -> None:
        """`seqs` join the target's batch with their cached prefixes loaded (nothing computed) and the planner."""
        prompts = [list(s.request.prompt_token_ids[:-1]) for s in seqs]
        ids = [s.request_id for s in seqs]
        features = self.planner.needs_hidden  # proposers that read the target's features get the prefix's
        while True:
            prefixes = [prefix_cache.concat(blocks) if blocks else None for blocks in found] if found else None
            cached = [kv[0].shape[2] if kv is not None else 0 for kv in prefixes or [None] * len(seqs)]
            try:
                hidden = self.runner.join(ids, [p[:c] for p, c in zip(prompts, cached, strict=True)],
                                          hidden=features, prefixes=prefixes)  # nothing computed: [0, hidden]
                if hidden is not None and found:  # the cached prefix's features
                    hidden = [torch.cat([prefix_cache.concat_features(blocks), h]) if blocks else h
                              for blocks, h in zip(found, hidden, strict=True)]
                break
            except Exception as exc:
                if not found:
                    raise
                if ids[0] in self.runner.rows:  # joined, but the cached features did not fit: undone
                    self.runner.leave(set(ids))
                self.parts.failed("prefix_cache", exc)  # what it held did not load: all of it computed
                found = None
        self.runner.kv.expect(max(s.prompt_left for s in seqs))  # the longest prompt's columns, at once
        if hidden is not None and self.prefixes is not None:
            for seq, h in zip(seqs, hidden, strict=True):
                seq.features = [h]
        try:
            self.planner.join(seqs, hidden, found)
        except BaseException:
            self.planner.leave(seqs)  # all or nothing: no half-joined rows stay behind
            self.runner.leave(set(ids))
            raise
        for seq, prompt, c in zip(seqs, prompts, cached, strict=True):
            seq.stats.cached_tokens = c
            seq.prefill = prompt[c:]
            self.cached_tokens += c
            if not seq.prefill:  # now, not at leave: requests arriving meanwhile share the prompt
                self.remember(seq)

    def prefilled(self, seq: Sequence, tokens: int) -> None:
        """The step's pass computed the next `tokens` of the row's prompt: they are stored in the prefix cache
        (whole blocks) at once, so prompts that start the same way read them from now on."""
        seq.prefill = seq.prefill[tokens:]
        self.prefill_tokens += tokens
        self.remember(seq)

    def _first_block(self, seq: Sequence) -> bytes | None:
        """The name of the prompt's first block in the prefix cache (None: no cache, or a prompt shorter)."""
        if self.prefixes is None or not self.parts.on("prefix_cache"):
            return None
        try:
            names = self.prefixes.names(seq.request.prompt_token_ids[:-1][: self.prefixes.block], seq.cache_salt)
        except Exception as exc:
            self.parts.failed("prefix_cache", exc)
            return None
        return names[0] if names else None

    def _match(self, seq: Sequence) -> list[prefix_cache.Block]:
        """The prefix cache's blocks the row's prompt (but its last token) starts with; none when it fails."""
        if self.prefixes is None or not self.parts.on("prefix_cache"):
            return []
        try:
            return self.prefixes.match(seq.request.prompt_token_ids[:-1], seq.cache_salt, self.planner.needs_hidden)
        except Exception as exc:
            self.parts.failed("prefix_cache", exc)
            return []

    # ---- leaving ---------------------------------------------------------------------------------------
    def leave(self, request_ids: set[str], failed: Collection[str] = ()) -> None:
        """Rows leave the batch (finished, aborted or failed); what the cache computed for those that did
        not fail is kept for later prompts that start the same way."""
        leaving = [self.running[rid] for rid in request_ids if rid in self.running]
        waiting = {s.request_id for s in self.joining} & request_ids  # never entered the batch: nothing to undo
        self.joining = [s for s in self.joining if s.request_id not in waiting]
        for rid in waiting:
            del self.running[rid]
        leaving = [s for s in leaving if s.request_id not in waiting]
        if not leaving:
            return
        for seq in leaving:
            if seq.request_id not in failed:
                self.remember(seq)
        self.runner.leave({s.request_id for s in leaving})
        self.planner.leave(leaving)
        for seq in leaving:
            del self.running[seq.request_id]

    def remember(self, seq: Sequence) -> None:
        """Store a row's computed tokens in the prefix cache (blocks it holds already are not read again):
        the cache's live tokens are the sequence's first ones (a stop may have cut the output shorter than
        what was computed). Nothing without a prefix cache; a failure stores nothing."""
        if self.prefixes is None or not self.parts.on("prefix_cache"):
            return
        try:
            tokens = seq.tokens[: self.runner.cached(seq.request_id)]
            features = torch.cat(seq.features) if seq.features else None  # one per fed token: the live ones
            if features is not None and self.planner.feature_dtype is not None:
                features = features.to(self.planner.feature_dtype)  # what the head rounds them to anyway (bf16
                # for a quantized target on CPU: half the bytes of float32, ~8% of what a prefix costs)
            if seq.features and len(seq.features) > 1:
                seq.features = [features]  # stored again at leave: joined once
            states = self.planner.prefix_states(seq, self.prefixes.block)  # what proposers computed of it
            self.prefixes.store(tokens, seq.cache_salt, self.runner.live(seq.request_id), features, states)
        except Exception as exc:
            self.parts.failed("prefix_cache", exc)
