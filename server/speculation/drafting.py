"""How the planner gathers a step's drafts (a part of `Planner`, planner.py): the lookahead proposers' offers for
every row (nearly free, asked before `auto` chooses), the model proposers' drafts for the rows that chose them
(every row a proposer holds asked, K = 0 where it does not draft, timed where its cost is not declared), and a
constrained row's drafts cut at its grammar.

`Drafting` is mixed into `Planner`, whose proposers, optional parts (`parts`), cost model, device and calls
(`_propose`, `_uses`, `_failed`: a proposer's fault isolation and fallback accounting) it uses.
"""

from __future__ import annotations

import time
from typing import Protocol

from server.speculation.constrain import Constraint, constrain, until_stop
from server.speculation.cost import elapsed_since
from server.speculation.plan import RowPlan
from server.speculation.policy import Choice
from server.speculation.proposer import SequenceView
from server.speculation.registry import PLAIN

RowOffers = dict[str, tuple[list[int], int]]  # lookahead proposer -> (its drafts for a row, their confidence level)


class PlannedSequence(SequenceView, Protocol):
    """What the planner reads of a sequence besides what proposers read."""

    @property
    def method(self) -> str: ...  # the request's method: "none", a proposer's name, or "auto"
    @property
    def sampled(self) -> bool: ...  # temperature > 0
    @property
    def k_max(self) -> int: ...  # the most drafts this step may carry
    @property
    def grammar(self) -> Constraint | None: ...  # the request's grammar (constrained decoding), or None
    @property
    def prompt_left(self) -> int: ...  # prompt tokens (before its last) not computed yet: no target features
    @property
    def prompt_computed(self) -> int: ...  # prompt tokens computed (or read from the prefix cache) so far
    @property
    def stop_ids(self) -> frozenset[int]: ...  # token ids that end the request when emitted


class Drafting:
    """The planner's drafting calls (module docstring)."""
    def _lookahead(self, seqs: list[PlannedSequence], hold: frozenset[str]) -> dict[int, RowOffers]:
        """Row -> lookahead proposer -> (its drafts for the row's most drafts, their confidence level)."""
        offers: dict[int, RowOffers] = {}
        for name, proposer in self.proposers.items():
            if not proposer.traits.lookahead:
                continue
            rows = [b for b, s in enumerate(seqs) if self._uses(s, name) and s.request_id not in hold]
            if not rows:
                continue
            found, _ = self._propose(name, [seqs[b] for b in rows], [seqs[b].k_max for b in rows])
            if found is None:
                continue
            levels = found.confidence or [0] * len(rows)
            for i, b in enumerate(rows):
                if drafts := until_stop(found.drafts[i], seqs[b].stop_ids):
                    offers.setdefault(b, {})[name] = (drafts, levels[i])
        return offers

    def _constrained(self, seq: PlannedSequence, row: RowPlan) -> RowPlan:
        """`_constrain`, or no drafts for the row when the grammar's fast path raises or is off (the
        verify pass still applies the grammar's mask: only drafting is lost)."""
        if self.parts.on("grammar"):
            try:
                return self._constrain(seq, row)
            except Exception as exc:
                self.parts.failed("grammar", exc)
        return row.cut(0)

    def _constrain(self, seq: PlannedSequence, row: RowPlan) -> RowPlan:
        """constrain.py's `constrain` for the row (a model's drafts are never replaced by forced tokens)."""
        assert seq.grammar is not None
        model = row.proposer is not None and not self.proposers[row.proposer].traits.lookahead
        return constrain(row, seq.grammar, seq.k_max, may_force=seq.method != PLAIN and not model)

    def _draft_with_models(
        self, seqs: list[PlannedSequence], choices: list[Choice], rows: list[RowPlan]
    ) -> list[RowPlan]:
        """Ask each model proposer for its chosen rows' drafts (every row it holds is asked, with K = 0 where
        it does not draft, so its batch stays aligned), timing it when its cost is not declared: as drafting
        when no drafting row has a backlog to take in first (`Proposer.backlog`), else what the backlog took
        beyond the drafting forwards. A call that also takes in a backlog (rows entering the proposer's cache,
        or back after steps they did not draft) is a prefill as well: timed as drafting it would price the
        proposer at several times its cost per draft token, and `auto` would never draft with it again."""
        for name, proposer in self.proposers.items():
            if proposer.traits.lookahead:
                continue
            members = [b for b, s in enumerate(seqs) if self._uses(s, name)]
            ks = [choices[b].k if choices[b].proposer == name else 0 for b in members]
            if not any(ks):  # nobody drafts with it: nothing to feed or draw (its pending pairs wait)
                continue
            drafting = [seqs[b].request_id for b, k in zip(members, ks, strict=True) if k]
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
                    rows[b] = RowPlan(name, proposal.drafts[i], seqs[b].rule, qs[i])
        return rows

    def _time_drafting(self, name: str, ks: list[int], drafting: int, behind: int, seconds: float) -> None:
        """Teach the cost model a timed proposer call (see `_draft_with_models`)."""
        if not behind:
            self.cost.observe_draft(name, drafting, max(ks), seconds)
        elif (forward := self.cost.draft_time(name, drafting)) is not None:
            self.cost.observe_backlog(name, behind, seconds - max(ks) * forward)
