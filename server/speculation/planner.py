"""The per-step plan: for every row of the batch, which proposer drafts, how many tokens, and q.

The engine hands the planner its running sequences and the step's token budget and gets back one
`StepPlan` (plan.py); after the target's pass it hands back what each row kept (`commit`) or the features
of a prompt chunk (`prefilled`). The planner owns the proposers: it tells them who joins and leaves, splits
the budget (budget.py), asks the lookahead ones what they offer every row (nearly free), hands each row to
`auto`'s policy as a `Candidate` (policy.py decides every row's proposer and k, and the batch's), asks the
model proposers for the drafts of the rows that chose them (timing those whose cost is not declared), and
cuts drafts at a constrained row's grammar. The engine never names a proposer.

Every part the planner calls is optional (server/failsafe.py): a proposer that raises is dropped for
the rows of that call (they leave it and go on with the others, or plain), the cost model and the
acceptance model that raise teach nothing that step, the grammar's fast path that raises leaves its
row without drafts, and a plan that raises is a plain step for every row (the proposers returned to the
step's checkpoint). `auto` rows plan no drafts once the cost model or the acceptance model is off.

A row a proposer is dropped for (its call raised, or the proposer was switched off) has lost it: the planner
keeps that account per request (`fallbacks_of`: which proposer, and why), and so does a row that joins asking for
a proposer already switched off, so the request's answer can say its method fell back (server/types.py
`Fallback`) instead of looking like a method that ran and drafted nothing.
"""

from __future__ import annotations

import functools
import time

import torch

from server.failsafe import OptionalParts
from server.model.attention import packs
from server.model.kv_shape import KVShape
from server.model.prefix_cache import Block, StateReader, leading_states
from server.model.runner import ModelRunner
from server.speculation.acceptance import AcceptanceModel
from server.speculation.budget import Split, StepBudget, fit, split
from server.speculation.cost import CostModel
from server.speculation.drafting import Drafting, PlannedSequence, RowOffers
from server.speculation.model_proposer import ModelProposer
from server.speculation.plan import FORCED, IDLE_ROW, PLAIN_ROW, RowPlan, StepPlan
from server.speculation.policy import PLAIN as PLAIN_CHOICE
from server.speculation.policy import AutoPolicy, Candidate, Choice, DraftPolicy, Offer
from server.speculation.proposer import BuildContext, Proposal, Proposer
from server.speculation.registry import AUTO, BUILTIN, PLAIN, Registry
from server.speculation.tuning import AutoTuning
from server.types import Fallback, FallbackReason


class Planner(Drafting):
    """Owns the proposers, and asks `auto`'s policy each step. Single-threaded, like the engine."""

    def __init__(
        self,
        proposers: dict[str, Proposer],
        policy: DraftPolicy,
        cost: CostModel,
        device: torch.device,
        parts: OptionalParts | None = None,
    ) -> None:
        self.proposers = proposers
        self.policy, self.cost, self.device = policy, cost, device
        self.parts = parts if parts is not None else OptionalParts()
        # proposer -> the request ids it holds (joined, not yet left or dropped after a failure)
        self.members: dict[str, set[str]] = {name: set() for name in self.proposers}
        self._step_start: dict[str, object] | None = None  # `checkpoint()`'s: the states at the step's start
        self._dropping: dict[str, set[str]] = {}  # rows dropped by a proposer that failed this step (`settle`)
        # request id -> the proposers it lost to their failure, in order, one each (`fallbacks_of`)
        self.fallbacks: dict[str, list[Fallback]] = {}
        # proposers that read the target's features: none can draft for a row whose prompt is still being computed
        self.hidden_readers = frozenset(name for name, p in self.proposers.items() if p.traits.needs_hidden)

    @classmethod
    def build(
        cls,
        ctx: BuildContext,
        registry: Registry = BUILTIN,
        parts: OptionalParts | None = None,
        tuning: AutoTuning | None = None,
        cost: CostModel | None = None,
        acceptance: AcceptanceModel | None = None,
        policy: DraftPolicy | None = None,
    ) -> Planner:
        """The registry's proposers that can run here, and `auto`'s policy over them (`AutoPolicy` on the
        given or new cost and acceptance models, unless a `policy` is given)."""
        built = {e.name: e.build(ctx) for e in registry.entries}
        proposers = {name: p for name, p in built.items() if p is not None}
        tuning = tuning or AutoTuning()
        cost = cost or CostModel(tuning)
        if policy is None:  # a verify pass computes only real tokens when the target's forwards pack
            traits = {name: p.traits for name, p in proposers.items()}
            policy = AutoPolicy(traits, cost, acceptance or AcceptanceModel(tuning), packs(ctx.target.model), tuning)
        return cls(proposers, policy, cost, ctx.target.device, parts)

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this server can run (proposers that could not be built here are left out)."""
        return (PLAIN, *self.proposers, AUTO)

    def model_runners(self) -> list[ModelRunner]:
        """The runners of the proposers that run a model of their own."""
        return [p.runner for p in self.proposers.values() if isinstance(p, ModelProposer)]

    def release_dense(self) -> int:
        """Drop the dense weights the model proposers' packed kernels replace (a server's); bytes dropped."""
        return sum(p.release_dense() for p in self.proposers.values() if isinstance(p, ModelProposer))

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

    @property
    def feature_dtype(self) -> torch.dtype | None:
        """The dtype the target's features can be kept in for every proposer that reads them (proposer.py
        `feature_dtype`): the one they all round them to, else None (as computed)."""
        dtypes = {self.proposers[name].feature_dtype for name in self.hidden_readers}
        return dtypes.pop() if len(dtypes) == 1 else None

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
            users = [i for i, s in enumerate(seqs) if s.method in (name, AUTO)]
            if not users:
                continue
            if not self.parts.on(_part(name)):  # switched off before they came: they go without it
                for i in users:
                    self._lost(seqs[i].request_id, name, "switched_off")
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
            self.parts.call("acceptance", self.policy.forget, s.request_id, default=None)
            self.fallbacks.pop(s.request_id, None)

    def fallbacks_of(self, request_id: str) -> list[Fallback]:
        """The proposers the request lost to their failure so far, in order (none: a copy of an empty list)."""
        return list(self.fallbacks.get(request_id, ()))

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, seqs: list[PlannedSequence], hold: frozenset[str] = frozenset(),
             budget: StepBudget | int | None = None) -> StepPlan:
        """The step's token budget split over the rows (budget.py: decoding rows, prompts that finish, drafts,
        then a chunk of the oldest prompt left; None: no limit), then lookahead proposers (nearly free), the
        policy's choice for every row that decodes, and the drafts of the model proposers chosen. Rows in
        `hold` (request ids) take no part: no proposer looks at them (model proposers ask them for K = 0) and
        they feed nothing, like rows whose prompt the budget does not reach. An `auto` row the policy says
        is not due sits out the step as a plain row. A plan that raises is a plain step (module doc)."""
        shares = split(budget, [None if s.request_id in hold else s.prompt_left for s in seqs],
                       [s.prompt_computed for s in seqs])
        plain = shares.plan([PLAIN_ROW if v else IDLE_ROW for v in shares.verify])
        if not self.parts.on("planner"):
            return plain
        try:
            return shares.plan(self._plan(seqs, hold | {s.request_id for s, v in zip(
                seqs, shares.verify, strict=True) if not v}, shares))
        except Exception as exc:
            self.parts.failed("planner", exc)
            if self._step_start is not None:  # what the failed plan's proposer calls changed
                self.restore(self._step_start)
            return plain

    def _plan(self, seqs: list[PlannedSequence], hold: frozenset[str], shares: Split) -> list[RowPlan]:
        started = time.perf_counter()
        # `auto` rows the policy says are not due sit out this step as plain rows: no lookups, no choice (all of
        # them while the cost model or the acceptance model is off: `auto` would decide blind)
        blind = not (self.parts.on("cost_model") and self.parts.on("acceptance"))
        skip = hold | {s.request_id for s in seqs if s.method == AUTO and s.request_id not in hold
                       and (blind or not self.policy.due(s.request_id))}
        offers = self._lookahead(seqs, skip)
        room = shares.room
        choices = self.policy.decide([self._candidate(s, offers.get(b, {}), s.request_id in skip, room.tokens)
                                      for b, s in enumerate(seqs)], room)
        fitted = fit([c.k for c in choices], room.tokens)  # fixed methods' drafts within the room too
        choices = [c if k == c.k else Choice(c.proposer, k) if k else PLAIN_CHOICE
                   for c, k in zip(choices, fitted, strict=True)]
        rows = []
        for b, choice in enumerate(choices):
            offer = offers.get(b, {}).get(choice.proposer) if choice.proposer else None
            rows.append(RowPlan(choice.proposer, offer[0][: choice.k], level=offer[1]) if offer and choice.k
                        else PLAIN_ROW)
        planned = sum(1 for s in seqs if s.method != PLAIN and s.request_id not in skip)
        self.policy.observe_planning(time.perf_counter() - started, planned)
        rows = self._draft_with_models(seqs, choices, rows)
        rows = [self._constrained(s, r) if s.grammar is not None and s.request_id not in hold else r
                for s, r in zip(seqs, rows, strict=True)]
        fitted = fit([r.k for r in rows], room.tokens)  # a grammar's forced tokens may ask for more
        return [r.cut(k) if k < r.k else r for r, k in zip(rows, fitted, strict=True)]

    def _candidate(self, seq: PlannedSequence, offers: RowOffers, skip: bool, room: int) -> Candidate:
        """The row as the policy sees it: a fixed method's (proposer, k), or for a planned `auto` row what
        it could draft with (offers, proposers it cannot use, model proposers' backlogs); k within `room`."""
        k_max = min(seq.k_max, room)
        blind = self.hidden_readers if seq.prompt_left else frozenset()
        blind |= {name for name in self.proposers if not self._uses(seq, name)}  # dropped after a failure
        fixed: Choice | None = None
        if skip or seq.method == PLAIN or k_max == 0:
            fixed = PLAIN_CHOICE
        elif seq.method != AUTO:
            fixed = PLAIN_CHOICE if seq.method in blind else Choice(seq.method, k_max)
        backlog = {}
        for name, proposer in self.proposers.items():
            if proposer.traits.lookahead or name in blind or (fixed is not None and name != fixed.proposer):
                continue
            try:
                backlog[name] = proposer.backlog([seq.request_id])
            except Exception as exc:
                self._failed(name, exc, {seq.request_id}, planning=True)
                blind |= {name}
                fixed = PLAIN_CHOICE if fixed is not None else None
        return Candidate(seq.request_id, k_max, seq.sampled,
                         {name: Offer(len(d), level) for name, (d, level) in offers.items()}, blind, backlog, fixed)

    # ---- undoing a failed step (server/engine/isolation.py) ---------------------------------------
    def checkpoint(self) -> dict[str, object]:
        """Every proposer's state before a step (see `Proposer.checkpoint`) and who holds which rows;
        also where a failing plan or proposer call of this step returns them to."""
        self._step_start = {
            "proposers": {name: p.checkpoint() for name, p in self.proposers.items()},
            "members": {name: set(ids) for name, ids in self.members.items()},
            "fallbacks": {rid: list(lost) for rid, lost in self.fallbacks.items()},
        }
        return self._step_start

    def restore(self, state: dict[str, object]) -> None:
        proposers: dict[str, object] = state["proposers"]  # type: ignore[assignment]
        for name, proposer in self.proposers.items():
            proposer.restore(proposers[name])
        self.members = {name: set(ids) for name, ids in state["members"].items()}  # type: ignore[attr-defined]
        self.fallbacks = {rid: list(lost) for rid, lost in state["fallbacks"].items()}  # type: ignore[attr-defined]
        self._dropping = {}

    def settle(self) -> None:
        """The step is committed: rows a proposer dropped while planning it leave that proposer now (not
        while planning, which a failed step undoes by `restore`)."""
        dropping, self._dropping = self._dropping, {}
        for name, ids in dropping.items():
            self.members[name] |= ids
            self._drop(name, ids)

    def prefilled(self, seq: PlannedSequence, start: int, hidden: torch.Tensor) -> None:
        """The target computed a chunk of seq's prompt from position `start` (not its last token): the
        proposers that read its features take them now (`Proposer.prefilled`)."""
        for name in self.hidden_readers:
            if self._uses(seq, name):
                try:
                    self.proposers[name].prefilled(seq, start, hidden)
                except Exception as exc:
                    self._failed(name, exc, {seq.request_id})

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
        self.parts.call("acceptance", self.policy.observe, seq.request_id, row.proposer, row.k, len(emitted) - 1,
                        row.level, seq.sampled, default=None)

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
        for rid in ids:  # the rows of the failed call lost it to the error, the others to its switch
            self._lost(rid, name, "error" if rid in request_ids else "switched_off", type(exc).__name__)
        if planning:
            self.members[name] -= ids
            self._dropping.setdefault(name, set()).update(ids)
        else:
            self._drop(name, ids)

    def _lost(self, request_id: str, name: str, reason: FallbackReason, error: str | None = None) -> None:
        """The request goes on without proposer `name` (`Fallback`; once per proposer: it never rejoins it)."""
        lost = self.fallbacks.setdefault(request_id, [])
        if all(f.proposer != name for f in lost):
            lost.append(Fallback(name, reason, error or self.parts.errors.get(_part(name))))

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

def _part(proposer: str) -> str:
    """A proposer's name among the optional parts (server/failsafe.py)."""
    return f"proposer:{proposer}"

