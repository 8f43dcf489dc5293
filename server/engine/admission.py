"""Rows joining and leaving the engine's batch: prompts prefilled (or read from the prefix cache), the KV
budget, and what a leaving row leaves behind for later prompts that start the same way.

`Admission` owns the running rows (`running`, in no particular order: the target cache's row order is the
batch's). A request joins when the scheduler adds it and leaves at the end of the step that finishes it,
when it is aborted, or when its step failed. The prefix cache is optional (server/failsafe.py): when it
raises, a prompt is prefilled in full and nothing is stored.
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
from server.model.memory import budget_bytes
from server.model.runner import ModelRunner
from server.speculation.planner import Planner
from server.types import GenerationRequest

log = logging.getLogger(__name__)

RIDE_TOKENS = 128  # the longest prompt tail that rides with a row's first step: beyond it, the rows already
# decoding would attend padded to it for a pass's worth of tokens (attention is padded: model/attention.py)
ROW_SLACK = 33  # KV columns a row may need beyond its prompt + max_tokens: one step's (K <= 32, + 1)


def kv_slots(settings: Settings, device: torch.device, shapes: list[KVShape], reserved: int) -> int | None:
    """Token slots `kv_cache_memory` buys when the target's cache and every model proposer's cache (`shapes`)
    hold as many tokens each (the proposers' caches grow on demand within about that share); None without
    a budget. `reserved`: bytes a fraction of free memory leaves to the prefix cache."""
    if settings.kv_cache_memory is None:
        return None
    budget = budget_bytes(settings.kv_cache_memory, device, reserved=reserved)
    slots = slots_for(budget, shapes)
    per_token = sum(s.bytes_per_token for s in shapes)
    if slots < ROW_SLACK + 16:
        raise ValueError(f"kv_cache_memory {settings.kv_cache_memory!r} ({budget} bytes) holds {slots} tokens at "
                         f"{per_token} bytes per token; at least {ROW_SLACK + 16} are needed")
    log.info("KV budget %s: %d bytes = %d tokens (%d bytes per token over %d caches)",
             settings.kv_cache_memory, budget, slots, per_token, len(shapes))
    return slots


def _reservation(request: GenerationRequest) -> int:
    """The KV columns a row may need: its prompt, its max_tokens, and one step's columns."""
    return len(request.prompt_token_ids) + request.sampling.max_tokens + ROW_SLACK


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
    ) -> None:
        """`start`: a joining request's `Sequence`; `kv_slots`: the KV budget in tokens per cache, or None;
        `max_rows`: the batch's size limit (what `usage` counts against without a budget)."""
        self.runner, self.planner, self.parts, self.start = runner, planner, parts, start
        self.prefixes, self.kv_slots, self.max_rows = prefixes, kv_slots, max_rows
        self.running: dict[str, Sequence] = {}
        self.prefill_tokens = 0  # prompt tokens prefilled since the last `take_counts`
        self.cached_tokens = 0  # prompt tokens read from the prefix cache since then

    # ---- the KV budget -------------------------------------------------------------------------------
    def fits(self, requests: list[GenerationRequest]) -> bool:
        """Whether `requests` can join the running rows now within the KV budget (always, without one).
        The cache's rows share one column space (model/kv_cache.py), so a batch needs rows x its longest
        row's reservation (prompt + max_tokens + one step's columns) token slots."""
        if self.kv_slots is None:
            return True
        need = [_reservation(s.request) for s in self.running.values()] + [_reservation(r) for r in requests]
        return len(need) * max(need, default=0) <= self.kv_slots

    def usage(self, max_context: int) -> float:
        """With a KV budget, the fraction of it the running rows hold (rows x the largest reservation, what
        `fits` counts); without, live KV tokens over what `max_rows` full-context rows would hold."""
        if self.kv_slots is None:
            return self.runner.kv.live_tokens / (self.max_rows * max_context)
        need = [_reservation(s.request) for s in self.running.values()]
        return len(need) * max(need, default=0) / self.kv_slots

    def take_counts(self) -> tuple[int, int]:
        """(prompt tokens prefilled, prompt tokens read from the prefix cache) since the last call."""
        counts = self.prefill_tokens, self.cached_tokens
        self.prefill_tokens = self.cached_tokens = 0
        return counts

    # ---- joining ---------------------------------------------------------------------------------------
    def join(self, requests: list[GenerationRequest]) -> None:
        """Prefill every prompt token but the last (which the next step feeds), together, and tell the
        planner. All or nothing: when one request cannot join, none has. With the prefix cache, requests
        whose prompt starts like another's in the same call (the `n` choices of one request; clients
        sending one system prompt at once) join after it and read its prefill from the cache."""
        seqs = [self.start(r) for r in requests]
        for seq in seqs:
            if seq.request_id in self.running:
                raise ValueError(f"duplicate request id {seq.request_id!r}")
        leaders, followers = self._followers(seqs)
        self._join(leaders, ride=not followers)  # followers read the leaders' prompts from the cache
        if followers:
            try:
                self._join(followers, ride=True)
            except BaseException:
                self.leave({s.request_id for s in leaders})  # their prompts stay cached: they were computed
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
            self.cached_tokens += c
            self.prefill_tokens += len(prompt) - c
            if not seq.prefill:  # now, not at leave: requests arriving meanwhile share the prompt
                self.remember(seq)  # (a riding row's once its first step computed it: the engine's commit)

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

    # ---- leaving ---------------------------------------------------------------------------------------
    def leave(self, request_ids: set[str], failed: Collection[str] = ()) -> None:
        """Rows leave the batch (finished, aborted or failed); what the cache computed for those that did
        not fail is kept for later prompts that start the same way."""
        leaving = [self.running[rid] for rid in request_ids if rid in self.running]
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
            if seq.features and len(seq.features) > 1:
                seq.features = [features]  # stored again at leave: joined once
            states = self.planner.prefix_states(seq, self.prefixes.block)  # what proposers computed of it
            self.prefixes.store(tokens, seq.cache_salt, self.runner.live(seq.request_id), features, states)
        except Exception as exc:
            self.parts.failed("prefix_cache", exc)
