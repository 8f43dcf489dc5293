"""A step's plan: for every row, who drafted what and how the sampler judges it (the verify record).

The planner writes one `RowPlan` per row of the batch; the engine places the verified rows one after
another in the target's pass (`place`), and the rejection sampler, the proposers' commits and the
acceptance estimates read the same record. One field says how a row's drafts are judged (`rule`):

* `Rule.COMPARE`: the sampler draws each position's token from p exactly as plain decoding would and
  keeps drafts while they equal what it drew. It is the rule for drafts without a q of their own (n-gram,
  suffix, a grammar's forced tokens: q is one-hot at the draft, and comparing keeps each with probability
  p(x), the p/q rule's law), for greedy rows (p is one-hot: both rules keep a draft exactly when it is p's
  token), and for seeded sampled rows under `auto`, whose text must not depend on which proposer `auto`
  picked: a model proposer then drafts with the uniforms the sampler will use (model_proposer.py).
* `Rule.RATIO`: a model's sampled drafts with their q: accept x with probability min(1, p(x) / q(x)); at
  the first rejection draw from normalize(max(p - q, 0)) (docs/design.md, rejection.py).

A row whose prompt is still being computed feeds a `chunk` of it first (the step's token budget decides
how much: budget.py); `verify` False means the row feeds only that chunk (or nothing) and emits nothing.

Example: a batch of two rows, row 0 drafting [5, 9] with n-gram, row 1 plain, placed: row 0 verifies p's
positions 0..2 (`at` 0, k + 1 = 3 positions), row 1 position 3.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

FORCED = "grammar"  # the proposer named for a row whose drafts are the tokens its grammar forces


class Rule(enum.Enum):
    """How the rejection sampler judges a row's drafts (see the module docstring)."""

    COMPARE = "compare"
    RATIO = "ratio"


@dataclass(frozen=True)
class RowPlan:
    """One row's part of a step: its proposer (None: plain decoding; `FORCED`: its grammar's tokens), its k
    drafts, the rule they are judged by, q for the ratio rule, and where its k + 1 verify positions start
    in the step's p (`at`, set by `place`)."""

    proposer: str | None
    drafts: list[int]
    rule: Rule = Rule.COMPARE
    q: torch.Tensor | None = None  # [k, vocab]: the draft distribution, for `Rule.RATIO` only
    level: int = 0  # the drafts' confidence level (proposer.Traits.confidence_priors)
    proposed: list[int] | None = None  # what the proposer drafted, when the grammar cut the drafts short
    at: int = 0  # the row's first verify position in the step's p (`place`)
    chunk: int = 0  # prompt tokens the row's pass computes first (budget.py): its prompt's next ones
    verify: bool = True  # its last token and drafts are verified (False: a prompt chunk only, or nothing)

    def __post_init__(self) -> None:
        if (self.rule is Rule.RATIO) != (self.q is not None):
            raise ValueError("a q goes with the ratio rule, and only with it")
        if self.q is not None and len(self.q) != len(self.drafts):
            raise ValueError(f"q has {len(self.q)} positions for {len(self.drafts)} drafts")

    @property
    def k(self) -> int:
        return len(self.drafts)

    @property
    def positions(self) -> range:
        """The row's verify positions in the step's p: its k drafts', then the bonus position."""
        return range(self.at, self.at + self.k + 1)

    @property
    def own_drafts(self) -> list[int]:
        """The drafts the row's proposer made this step (its commit needs them all)."""
        return self.proposed if self.proposed is not None else self.drafts

    def cut(self, keep: int) -> RowPlan:
        """The row with its first `keep` drafts only (a grammar forbids the next one); its proposer's commit
        still gets every draft it made (`own_drafts`)."""
        q = self.q[:keep] if self.q is not None and keep else None
        return replace(self, drafts=self.drafts[:keep], q=q, rule=self.rule if q is not None else Rule.COMPARE,
                       proposed=self.own_drafts)


PLAIN_ROW = RowPlan(None, [])
IDLE_ROW = RowPlan(None, [], verify=False)  # a row that feeds nothing this step


@dataclass(frozen=True)
class StepPlan:
    rows: list[RowPlan]  # one per row of the batch, in its order
    budget: int | None = None  # the most tokens the step's pass computes (budget.py); None: no limit

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step's pass computes (its rows' chunks)."""
        return sum(r.chunk for r in self.rows)


def place(rows: list[RowPlan]) -> list[RowPlan]:
    """The rows of one target pass, each with its verify positions after the row before it's."""
    placed, at = [], 0
    for row in rows:
        placed.append(replace(row, at=at))
        at += row.k + 1
    return placed
