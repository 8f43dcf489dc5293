"""The per-step plan: for every row of the batch, which proposer drafts, how many tokens, and q.

The engine hands the planner its running sequences and gets back one `StepPlan`; after the target's
verify pass it hands back the verdict (`commit`). Everything about proposers lives here: building
them from the registry, telling them who joins and leaves, asking lookahead proposers first (so
`auto` knows what they offer), the `auto` choice per row, each row's share of a batch's verify pass,
dropping a model proposer that a whole batch would pay for but not gain from, and timing proposers
whose cost is not declared. The engine never names a proposer.

Every part the planner calls is optional (server/failsafe.py): a proposer that raises is dropped for
the rows of that call (they leave it and go on with the others, or plain), the cost model and the
acceptance estimates that raise teach nothing that step, the grammar's fast path that raises leaves its
row without drafts, and a plan that raises is a plain step for every row (the proposers returned to the
step's checkpoint). `auto` rows plan no drafts once the cost model or the acceptance estimates are off.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from server.failsafe import OptionalParts
from server.model.attention import packs
from server.model.kv_cache import KVShape
from server.model.prefix_cache import Block, StateReader, leading_states
from server.model.runner import ModelRunner
from server.speculation.adaptive import MIN_GAIN, AdaptivePolicy, BatchRow, Choice, CostModel, Offer
from server.speculation.model_proposer import ModelProposer
from server.speculation.proposer import BuildContext, Proposal, Proposer, SequenceView
from server.speculation.registry import AUTO, BUILTIN, PLAIN, Registry

FORCED = "grammar"  # the drafter named for a row whose drafts are the tokens its grammar forces
RowOffers = dict[str, tuple[list[int], int]]  # lookahead proposer -> (its drafts for a row, their confidence level)


class PlannedSequence(SequenceView, Protocol):
    """What the planner reads of a sequence besides what proposers read."""

    @property
    def mode(self) -> str: ...  # the request's method: "none", a proposer's name, or "auto"
    @property
    def sampled(self) -> bool: ...  # temperature > 0
    def num_drafts(self) -> int: ...  # the most drafts this step may carry
    @property
    def grammar(self) -> Constraint | None: ...  # the request's grammar (constrained decoding), or None
    @property
    def prefilling(self) -> bool: ...  # this step also computes prompt tokens: no target features of them yet
    @property
    def stop_ids(self) -> frozenset[int]: ...  # token ids that end the request when emitted


class Constraint(Protocol):
    """What the planner asks of a constrained sequence's grammar (server/grammar.py's GrammarState)."""

    def valid_prefix(self, drafts: list[int]) -> int: ...  # how many leading drafts the grammar allows
    def forced(self, limit: int) -> list[int]: ...  # up to `limit` tokens the grammar forces next


@dataclass(frozen=True)
class RowPlan:
    """One row's part of a step: its proposer (None: plain decoding; FORCED: its grammar's forced
    tokens), drafts and their q."""

    proposer: str | None
    drafts: list[int]
    q: torch.Tensor | None = None  # [len(drafts), vocab] from a model proposer; None: one-hot (or no drafts)
    level: int = 0  # the drafts' confidence level (proposer.Traits.confidence_priors)
    proposed: list[int] | None = None  # what the proposer drafted, when its grammar cut the drafts short

    @property
    def own_drafts(self) -> list[int]:
        """The drafts the row's proposer made this step (its commit needs them all)."""
        return self.proposed if self.proposed is not None else self.drafts


@dataclass(frozen=True)
class StepPlan:
    rows: list[RowPlan]

    @property
    def drafts(self) -> list[list[int]]:
        return [r.drafts for r in self.rows]

    @property
    def q(self) -> list[torch.Tensor | None]:
        return [r.q for r in self.rows]


class Planner:
    """Owns the proposers and the `auto` policy. Single-threaded, like the engine."""

    def __init__(
        self,
        ctx: BuildContext,
        registry: Registry = BUILTIN,
        cost: CostModel | None = None,
        parts: OptionalParts | None = None,
    ) -> None:
        built = {e.name: e.build(ctx) for e in registry.entries}
        self.proposers: dict[str, Proposer] = {name: p for name, p in built.items() if p is not None}
        self.parts = parts if parts is not None else OptionalParts()
        # proposer -> the request ids it holds (joined, not yet left or dropped after a failure)
        self.members: dict[str, set[str]] = {name: set() for name in self.proposers}
        self._step_start: dict[str, object] | None = None  # `checkpoint()`'s: the states at the step's start
        self._dropping: dict[str, set[str]] = {}  # rows dropped by a proposer that failed this step (`settle`)
        # proposers that read the target's features: none can draft for a row whose prompt is still being computed
        self.hidden_readers = frozenset(name for name, p in self.proposers.items() if p.traits.needs_hidden)
        # A verify pass computes only real tokens when the target's forwards pack (model/attention.py).
        packed = packs(ctx.target.model)
        self.policy = AdaptivePolicy({name: p.traits for name, p in self.proposers.items()}, cost, packed)
        self.device = ctx.target.device

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this server can run (proposers that could not be built here are left out)."""
        return (PLAIN, *self.proposers, AUTO)

    def model_runners(self) -> list[ModelRunner]:
        """The runners of the proposers that run a model of their own."""
        return [p.runner for p in self.proposers.values() if isinstance(p, ModelProposer)]

    def cache_shapes(self) -> list[KVShape]:
        """What one token costs in each model proposer's own KV cache (for the KV budget's share)."""
        return [ModelRunner.kv_shape(r.model) for r in self.model_runners()]

    def weight_tensors(self) -> list[torch.Tensor]:
        """The weights of the proposers' own models (proposer.py `weight_tensors`)."""
        return [t for p in self.proposers.values() for t in p.weight_tensors()]

    def cache_bytes(self, seen: set[tuple[str, int]]) -> int:
        """Bytes the proposers keep for rows and across requests (their KV caches, indexes); storages in
        `seen` are not counted again."""
        return sum(p.cache_bytes(seen) for p in self.proposers.values())

    @property
    def needs_hidden(self) -> bool:
        return bool(self.hidden_readers)

    # ---- membership --------------------------------------------------------------------------
    def join(
        self,
        seqs: list[PlannedSequence],
        prompt_hidden: list[torch.Tensor] | None,
        prefixes: list[list[Block]] | None = None,
    ) -> None:
        """New sequences join the proposers their method uses (`auto`: all of them). `prefixes[i]`: the
        prefix-cache blocks seqs[i]'s prompt starts with; a proposer that keeps a state of them gets
        that of the leading blocks holding it (`Proposer.load_prefix`)."""
        for name, proposer in self.proposers.items():
            users = [i for i, s in enumerate(seqs) if s.mode in (name, AUTO)]
            if not users or not self.parts.on(_part(name)):
                continue
            ids = {seqs[i].request_id for i in users}
            self.members[name] |= ids
            try:
                hidden = [prompt_hidden[i] for i in users] if proposer.traits.needs_hidden and prompt_hidden else None
                proposer.join([seqs[i] for i in users], hidden)
                for i in users if proposer.caches_prefix and prefixes else ():
                    if states := leading_states(prefixes[i], name):  # type: ignore[index]
                        proposer.load_prefix(seqs[i].request_id, states)
            except Exception as exc:
                self._failed(name, exc, ids)

    def prefix_states(self, seq: PlannedSequence, block: int) -> dict[str, StateReader]:
        """Per proposer the sequence uses that keeps a state of prompt prefixes: a reader of its state of
        the sequence's first blocks of `block` tokens (for the prefix cache, before the sequence leaves)."""
        return {name: functools.partial(p.prefix_state, seq.request_id, block=block)
                for name, p in self.proposers.items() if p.caches_prefix and self._uses(seq, name)}

    def leave(self, seqs: list[PlannedSequence]) -> None:
        ids = {s.request_id for s in seqs}
        for name in self.proposers:
            self._drop(name, ids)
        for s in seqs:
            try:
                self.policy.forget(s.request_id)
            except Exception as exc:
                self.parts.failed("acceptance", exc)

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, seqs: list[PlannedSequence], hold: frozenset[str] = frozenset()) -> StepPlan:
        """Lookahead proposers first (nearly free), then each row's choice, the batch's width, and the
        drafts of the model proposers chosen. Rows in `hold` (request ids) take no part: no proposer
        looks at them (model proposers ask them for K = 0) and they draft nothing. An `auto` row whose
        recent plans gained less than planning it costs sits out some steps (`AdaptivePolicy.due`).
        A plan that raises is a plain step (see the module docstring)."""
        plain = StepPlan([RowPlan(None, []) for _ in seqs])
        if not self.parts.on("planner"):
            return plain
        try:
            return self._plan(seqs, hold)
        except Exception as exc:
            self.parts.failed("planner", exc)
            if self._step_start is not None:  # what the failed plan's proposer calls changed
                self.restore(self._step_start)
            return plain

    def _plan(self, seqs: list[PlannedSequence], hold: frozenset[str]) -> StepPlan:
        started = time.perf_counter()
        # idle `auto` rows sit out this step as plain rows: no lookups, no choice (all of them while the
        # cost model or the acceptance estimates are switched off: `auto` would decide blind)
        blind = not (self.parts.on("cost_model") and self.parts.on("acceptance"))
        idle = {s.request_id for s in seqs if s.mode == AUTO and s.request_id not in hold
                and (blind or not self.policy.due(s.request_id))}
        skip = hold | idle
        offers = self._lookahead(seqs, skip)
        choices = [
            (None, 0) if s.request_id in skip else self._choose(s, offers.get(b, {}), len(seqs))
            for b, s in enumerate(seqs)
        ]
        auto_rows = {b for b, s in enumerate(seqs) if s.mode == AUTO and s.request_id not in skip}
        if len(seqs) > 1 and auto_rows:
            self._widen(seqs, choices, auto_rows, offers)
        rows: list[RowPlan] = []
        for b, (name, k) in enumerate(choices):
            offer = offers.get(b, {}).get(name) if name else None
            rows.append(RowPlan(name, offer[0][:k], None, offer[1]) if offer and k else RowPlan(None, []))
        planned = sum(1 for s in seqs if s.mode != PLAIN and s.request_id not in skip)
        self.policy.observe_planning(time.perf_counter() - started, planned)
        for b in auto_rows:
            self.policy.planned(seqs[b].request_id, len(seqs))
        rows = self._draft_with_models(seqs, choices, rows)
        rows = [
            self._constrained(s, r) if s.grammar is not None and s.request_id not in hold else r
            for s, r in zip(seqs, rows, strict=True)
        ]
        return StepPlan(rows)

    # ---- undoing a failed step (server/engine/engine.py) ------------------------------------------
    def checkpoint(self) -> dict[str, object]:
        """Every proposer's state before a step (see `Proposer.checkpoint`) and who holds which rows;
        also where a failing plan or proposer call of this step returns them to."""
        self._step_start = {
            "proposers": {name: p.checkpoint() for name, p in self.proposers.items()},
            "members": {name: set(ids) for name, ids in self.members.items()},
        }
        return self._step_start

    def restore(self, state: dict[str, object]) -> None:
        proposers: dict[str, object] = state["proposers"]  # type: ignore[assignment]
        for name, proposer in self.proposers.items():
            proposer.restore(proposers[name])
        self.members = {name: set(ids) for name, ids in state["members"].items()}  # type: ignore[attr-defined]
        self._dropping = {}

    def settle(self) -> None:
        """The step is committed: rows a proposer dropped while planning it leave that proposer now (not
        while planning, which a failed step undoes by `restore`)."""
        dropping, self._dropping = self._dropping, {}
        for name, ids in dropping.items():
            self.members[name] |= ids
            self._drop(name, ids)

    def observe_verify(self, tokens: int, seconds: float, record: bool = True, rows: int | None = None) -> float | None:
        """The verify pass of `rows` rows computed `tokens` positions (packed: the real tokens; padded:
        rows x widest row) and took `seconds`; the cost model learns it when `record`. Returns what the
        cost model predicted for such a pass before this timing (None while it has none)."""
        if not self.parts.on("cost_model"):
            return None
        try:
            predicted = self.policy.cost.verify_time(tokens, rows)
            if record:
                self.policy.cost.observe_verify(tokens, seconds, rows=rows)
        except Exception as exc:
            self.parts.failed("cost_model", exc)
            return None
        return predicted

    def commit(
        self,
        seq: PlannedSequence,
        row: RowPlan,
        emitted: list[int],
        hidden: torch.Tensor | None,
    ) -> None:
        """Tell the sequence's proposers what the target kept, and `auto` how the drafts fared."""
        for name, proposer in self.proposers.items():
            if self._uses(seq, name):
                try:
                    proposer.commit(seq, row.own_drafts if row.proposer == name else [], emitted, hidden)
                except Exception as exc:
                    self._failed(name, exc, {seq.request_id})
        if row.proposer == FORCED:
            return
        self.parts.call("acceptance", self.policy.observe, seq.request_id, row.proposer, len(row.drafts),
                        len(emitted) - 1, row.level, seq.sampled, default=None)

    # ---- proposers that fail (server/failsafe.py) -------------------------------------------------
    def _uses(self, seq: PlannedSequence, name: str) -> bool:
        """Whether the sequence is one of `name`'s (it joined and was not dropped)."""
        return seq.request_id in self.members[name]

    def _drop(self, name: str, request_ids: set[str]) -> None:
        """The sequences leave proposer `name` (a failed `leave` is counted: they are gone all the same)."""
        gone = request_ids & self.members[name]
        if gone:
            self.members[name] -= gone
            try:
                self.proposers[name].leave(gone)
            except Exception as exc:
                self.parts.failed(_part(name), exc)

    def _failed(self, name: str, exc: Exception, request_ids: set[str], *, planning: bool = False) -> None:
        """Proposer `name` raised in a call for `request_ids`: they leave it (every row does once the
        proposer is switched off), and the step goes on without its drafts for them. While `planning`,
        they stop being its rows at once but leave it when the step is committed (`settle`)."""
        self.parts.failed(_part(name), exc)
        ids = set(self.members[name]) if not self.parts.on(_part(name)) else request_ids & self.members[name]
        if planning:
            self.members[name] -= ids
            self._dropping.setdefault(name, set()).update(ids)
        else:
            self._drop(name, ids)

    def _propose(self, name: str, seqs: list[PlannedSequence], ks: list[int]) -> tuple[Proposal | None, bool]:
        """(proposer `name`'s proposal for seqs, whether its first call gave it). When the call raises,
        each row asked for drafts is tried alone (the others asked for none; the proposer restored after
        each try), the rows that fail alone are dropped from it (or every row asked, when none or all
        fail alone), and the call is made once more without them. None when no call succeeds."""
        proposer = self.proposers[name]
        try:
            return proposer.propose(seqs, ks), True
        except Exception as exc:
            error = exc
        self._restore(name)
        asking = [i for i, k in enumerate(ks) if k]
        bad: set[int] = set()
        for i in asking if len(asking) > 1 else ():
            try:
                proposer.propose(seqs, [k if j == i else 0 for j, k in enumerate(ks)])
            except Exception:
                bad.add(i)
            self._restore(name)
        proposal = None
        if bad and len(bad) < len(asking):
            try:
                proposal = proposer.propose(seqs, [0 if i in bad else k for i, k in enumerate(ks)])
            except Exception:
                self._restore(name)
        if proposal is None:
            bad = set(asking)
        self._failed(name, error, {seqs[i].request_id for i in bad}, planning=True)
        return proposal, False

    def _restore(self, name: str) -> None:
        """Proposer `name` back to the step's checkpoint (what a failed call of this step changed)."""
        if self._step_start is not None:
            proposers: dict[str, object] = self._step_start["proposers"]  # type: ignore[assignment]
            try:
                self.proposers[name].restore(proposers[name])
            except Exception as exc:
                self.parts.failed(_part(name), exc)

    # ---- planning steps ------------------------------------------------------------------------
    def _lookahead(self, seqs: list[PlannedSequence], hold: frozenset[str]) -> dict[int, RowOffers]:
        """Row -> lookahead proposer -> (its drafts for the row's most drafts, their confidence level)."""
        offers: dict[int, RowOffers] = {}
        for name, proposer in self.proposers.items():
            if not proposer.traits.lookahead:
                continue
            rows = [b for b, s in enumerate(seqs) if self._uses(s, name) and s.request_id not in hold]
            if not rows:
                continue
            found, _ = self._propose(name, [seqs[b] for b in rows], [seqs[b].num_drafts() for b in rows])
            if found is None:
                continue
            levels = found.confidence or [0] * len(rows)
            for i, b in enumerate(rows):
                if drafts := _until_stop(found.drafts[i], seqs[b].stop_ids):
                    offers.setdefault(b, {})[name] = (drafts, levels[i])
        return offers

    def _choose(self, seq: PlannedSequence, offers: RowOffers, batch: int) -> tuple[str | None, int]:
        """(proposer, K) for one row: the request's own method, or the policy's choice for `auto`."""
        k_max = seq.num_drafts()
        if seq.mode == PLAIN or k_max == 0:
            return None, 0
        blind = self.hidden_readers if seq.prefilling else frozenset()
        blind |= {name for name in self.proposers if not self._uses(seq, name)}  # dropped after a failure
        if seq.mode != AUTO:
            return (None, 0) if seq.mode in blind else (seq.mode, k_max)
        choice: Choice = self.policy.choose(
            seq.request_id,
            k_max,
            rows=batch,
            offers={name: Offer(len(d), level) for name, (d, level) in offers.items()},
            sampled=seq.sampled,
            exclude=blind,
        )
        return choice.proposer, choice.k

    def _widen(
        self,
        seqs: list[PlannedSequence],
        choices: list[tuple[str | None, int]],
        auto_rows: set[int],
        offers: dict[int, RowOffers],
    ) -> None:
        """In a batch the policy decides how many drafts each flexible row (auto, with a lookahead offer,
        not drafting with a model this step) verifies: one width for every row when the pass is padded,
        the likeliest draft tokens wherever they are when it is packed (`AdaptivePolicy.batch_drafts`).
        Auto rows that chose a model proposer keep it only if the batch as a whole gains from it (each
        row chose alone, but the model's forwards and the wider pass are paid by every row)."""
        policy = self.policy

        def lookahead(name: str | None) -> bool:
            return name is not None and self.proposers[name].traits.lookahead

        def flexible_offer(b: int) -> tuple[str, int, int] | None:
            """(proposer, drafts, level) of the row's usable lookahead offer: its chosen one, else the first."""
            usable = {
                n: o for n, o in offers.get(b, {}).items()
                if policy.usable(n, {n: Offer(len(o[0]))})
            }
            name = choices[b][0] if choices[b][0] in usable else next(iter(usable), None)
            if name is None:
                return None
            return name, min(len(usable[name][0]), seqs[b].num_drafts()), usable[name][1]

        def rows_for(demote: bool) -> list[BatchRow]:
            rows = []
            for b, seq in enumerate(seqs):
                name, k = choices[b]
                free = b in auto_rows
                if free and demote and name is not None and not lookahead(name):
                    name, k = None, 0
                flex = flexible_offer(b) if free and (name is None or lookahead(name)) else None
                if flex is not None:
                    rows.append(BatchRow(seq.request_id, flex[0], level=flex[2], flexible=flex[1], sampled=seq.sampled))
                elif lookahead(name):
                    drafts, level = offers.get(b, {}).get(name, ([], 0))
                    rows.append(BatchRow(seq.request_id, name, min(k, len(drafts)), level, sampled=seq.sampled))
                else:
                    behind = self.proposers[name].backlog([seq.request_id]) if name and k else 0
                    rows.append(BatchRow(seq.request_id, name, k if name else 0, sampled=seq.sampled, backlog=behind))
            return rows

        rows = rows_for(demote=False)
        best = policy.batch_drafts(rows)
        if best is None:
            return
        if any(not lookahead(choices[b][0]) and choices[b][0] is not None for b in auto_rows):
            without = rows_for(demote=True)
            other = policy.batch_drafts(without)
            # the model's drafts must pay by the margin any drafting needs over plain decoding (MIN_GAIN):
            # each row chose them priced as if the whole batch shared the model's forwards, and what a
            # batch pays besides the pass, the forwards and the rows' backlogs (planning, commits, the
            # model's own bookkeeping) is not in either estimate
            if other is not None and other[1] * MIN_GAIN >= best[1]:
                rows, best = without, other
                for b in auto_rows:
                    if choices[b][0] is not None and not lookahead(choices[b][0]):
                        choices[b] = (None, 0)
        for b, (row, k) in enumerate(zip(rows, best[0], strict=True)):
            if row.flexible:
                choices[b] = (row.proposer, k) if k else (None, 0)

    def _constrained(self, seq: PlannedSequence, row: RowPlan) -> RowPlan:
        """`_constrain`, or no drafts for the row when the grammar's fast path raises or is off (the
        verify pass still applies the grammar's mask: only drafting is lost)."""
        if self.parts.on("grammar"):
            try:
                return self._constrain(seq, row)
            except Exception as exc:
                self.parts.failed("grammar", exc)
        return RowPlan(row.proposer, [], None, row.level, proposed=row.own_drafts)

    def _constrain(self, seq: PlannedSequence, row: RowPlan) -> RowPlan:
        """A constrained row's drafts as its grammar allows them, or the tokens the grammar forces.

        Drafts are cut at the first token the grammar forbids. A deterministic draft (q one-hot) is cut
        before it: the sampler draws each position from p and compares, so a shorter draft changes
        nothing but where the step ends. A draft sampled from a q of its own keeps the forbidden token
        as its last: p is 0 there, so it is rejected and the recovered token comes from the residual
        max(p - q, 0), as the rejection rule requires (cutting before it would draw that position from p
        instead, and the mixture is no longer p: docs/design.md). Then, when the grammar forces more
        tokens than the row drafts and no model drafted for it (a model's cache holds its drafts), the
        forced tokens become the row's drafts: they cost nothing and p allows little else."""
        grammar = seq.grammar
        assert grammar is not None
        valid = grammar.valid_prefix(row.drafts)
        if valid < len(row.drafts):
            keep = valid + 1 if row.q is not None else valid
            q = row.q[:keep] if row.q is not None and keep else None
            row = RowPlan(row.proposer, row.drafts[:keep], q, row.level, proposed=row.own_drafts)
        if seq.mode == PLAIN or (row.proposer is not None and not self.proposers[row.proposer].traits.lookahead):
            return row
        forced = grammar.forced(seq.num_drafts())
        return RowPlan(FORCED, forced) if len(forced) > len(row.drafts) else row

    def _draft_with_models(
        self, seqs: list[PlannedSequence], choices: list[tuple[str | None, int]], rows: list[RowPlan]
    ) -> list[RowPlan]:
        """Ask each non-lookahead proposer for its chosen rows' drafts (every row it holds is asked,
        with K = 0 where it does not draft, so its batch stays aligned), timing it when its cost is
        not declared: as drafting when no drafting row has a backlog to take in first (`Proposer.backlog`),
        else what the backlog took beyond the drafting forwards."""
        for name, proposer in self.proposers.items():
            if proposer.traits.lookahead:
                continue
            members = [b for b, s in enumerate(seqs) if self._uses(s, name)]
            if not members:
                continue
            ks = [choices[b][1] if choices[b][0] == name else 0 for b in members]
            if not any(ks):  # nobody drafts with it: nothing to feed or draw (its pending pairs wait)
                continue
            drafting = [seqs[b].request_id for b, k in zip(members, ks, strict=True) if k]
            # A call that also takes in a backlog (rows entering the proposer's cache, or back after steps
            # they did not draft) is a prefill as well: timed as drafting, it priced the draft head at
            # 4 chat rows at 9.8 ms a draft token (165 prompt pairs fed in the call) against 2.4-4 ms
            # drafting, and `auto` never drafted with it again. The backlog is timed apart: what such a
            # call takes beyond its drafting forwards' time (`CostModel.backlog_time`: the batch's choice
            # prices it, `AdaptivePolicy._fixed`).
            timed = proposer.traits.draft_token_cost is None
            try:
                behind = proposer.backlog(drafting) if timed else 0
            except Exception as exc:
                self._failed(name, exc, set(drafting), planning=True)
                continue
            started = time.perf_counter()
            proposal, clean = self._propose(name, [seqs[b] for b in members], ks)
            if proposal is None:
                continue
            if timed and clean:
                seconds = elapsed_since(started, self.device)
                self.parts.call("cost_model", self._time_drafting, name, ks, len(drafting), behind, seconds,
                                default=None)
            qs = proposal.q or [None] * len(members)
            for i, b in enumerate(members):
                if ks[i] and proposal.drafts[i]:
                    rows[b] = RowPlan(name, proposal.drafts[i], qs[i])
        return rows

    def _time_drafting(self, name: str, ks: list[int], drafting: int, behind: int, seconds: float) -> None:
        """Teach the cost model a timed proposer call (see `_draft_with_models`)."""
        if not behind:
            self.policy.cost.observe_draft(name, max(ks), seconds, rows=drafting)
        elif (forward := self.policy.cost.draft_forward_time(name, drafting)) is not None:
            self.policy.cost.observe_backlog(name, behind, seconds - max(ks) * forward)


def _part(proposer: str) -> str:
    """A proposer's name among the optional parts (server/failsafe.py)."""
    return f"proposer:{proposer}"


def elapsed_since(started: float, device: torch.device) -> float:
    """Seconds since `started` (perf_counter), counting the kernels on a GPU, not just their launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _until_stop(drafts: list[int], stops: frozenset[int]) -> list[int]:
    """`drafts` up to and including the first token that ends the request: nothing after it can be
    emitted, and verifying it would widen the pass for nothing (a copy of an earlier answer runs on past
    its end-of-turn into the next turn's header: 10 of the 16 tokens drafted at an agent answer's end)."""
    for j, token in enumerate(drafts):
        if token in stops:
            return drafts[: j + 1]
    return drafts
