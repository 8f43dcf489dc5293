"""Drafts within what a request can emit: cut at its stop tokens, or under its grammar (constrained
decoding, server/grammar.py) cut where the grammar forbids them or replaced by the tokens it forces."""

from __future__ import annotations

from typing import Protocol

from server.speculation.plan import FORCED, RowPlan, Rule


class Constraint(Protocol):
    """What the planner asks of a constrained sequence's grammar (server/grammar.py's GrammarState)."""

    def valid_prefix(self, drafts: list[int]) -> int: ...  # how many leading drafts the grammar allows
    def forced(self, limit: int) -> list[int]: ...  # up to `limit` tokens the grammar forces next


def constrain(row: RowPlan, grammar: Constraint, k_max: int, may_force: bool) -> RowPlan:
    """A constrained row's drafts as its grammar allows them, or the tokens the grammar forces.

    Drafts are cut at the first token the grammar forbids. A compared draft is cut before it: the
    sampler draws each position from p and compares, so a shorter draft changes nothing but where the
    step ends. A draft judged by the ratio rule keeps the forbidden token as its last: p is 0 there, so
    it is rejected and the recovered token comes from the residual max(p - q, 0), as the rule requires
    (cutting before it would draw that position from p instead, and the mixture is no longer p:
    docs/design.md). Then, when `may_force` (the row's method drafts, and no model drafted for it: a
    model's cache holds its drafts) and the grammar forces more tokens than the row drafts (at most
    `k_max`), the forced tokens become the row's drafts: they cost nothing and p allows little else."""
    valid = grammar.valid_prefix(row.drafts)
    if valid < row.k:
        row = row.cut(valid + 1 if row.rule is Rule.RATIO else valid)
    if not may_force:
        return row
    forced = grammar.forced(k_max)
    return RowPlan(FORCED, forced) if len(forced) > row.k else row


def until_stop(drafts: list[int], stops: frozenset[int]) -> list[int]:
    """`drafts` up to and including the first token that ends the request: nothing after it can be
    emitted, and verifying it would widen the pass for nothing (a copy of an earlier answer runs on past
    its end-of-turn into the next turn's header: 10 of the 16 tokens drafted at an agent answer's end)."""
    for j, token in enumerate(drafts):
        if token in stops:
            return drafts[: j + 1]
    return drafts
