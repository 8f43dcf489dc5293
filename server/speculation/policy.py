"""Method `auto`'s policy: each step, which proposer drafts how many tokens for each `auto` row.

The objective is the batch's expected tokens per second. K drafts at per-token acceptance a, each costing
c of a plain step (verifying it and producing it), give

    speedup(a, K, c) = (1 - a^(K+1)) / ((1 - a) (c K + 1))

tokens per unit of plain-decoding time (Leviathan et al. 2023). The policy reads a per draft position
from the acceptance model (acceptance.py) and what passes cost from the cost model (cost.py), through a
table of this step's costs (`StepCosts`, made once per step). docs/auto.md states the rules; in short:

1. per row (`choose`): the (proposer, k) of highest predicted speedup, if it beats plain decoding by
   `min_gain`; else now and then a one-token probe of an unused proposer (`_probe`), within a budget;
2. per batch (`decide`): the pass's draft tokens go where they are likeliest kept (packed passes: each
   token costs its own share), or one width for all (padded passes: widening costs the same whoever
   drafts); a model proposer the rows chose is kept only if the batch gains by `min_gain` with it, its
   forwards and its rows' backlogs counted (each row chose it priced as if the batch shared them);
3. a row whose recent plans gained less than planning it costs sits out some steps (`due`).

Only which tokens are proposed changes: the sampler's rule keeps the output distribution, and greedy
output is identical whatever `auto` picks. `FixedPolicy` is the trivial policy for comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from server.speculation.acceptance import AcceptanceModel, best_k, expected_tokens_upto
from server.speculation.budget import Room
from server.speculation.cost import CostModel, PassCosts
from server.speculation.proposer import Traits
from server.speculation.tuning import AutoTuning


@dataclass(frozen=True)
class Offer:
    """What a lookahead proposer has ready for a row before planning: drafts and their confidence."""

    drafts: int
    level: int = 0


@dataclass(frozen=True)
class Choice:
    proposer: str | None  # None: decode plainly this step
    k: int
    predicted_speedup: float = 1.0


PLAIN = Choice(None, 0)


@dataclass(frozen=True)
class Candidate:
    """One row of the step's batch as a policy sees it (the planner writes these)."""

    request_id: str
    k_max: int = 0  # the most drafts this step may carry
    sampled: bool = False  # temperature > 0: acceptance is kept apart from greedy rows
    offers: Mapping[str, Offer] = field(default_factory=dict)  # lookahead proposers' drafts, registry order
    blind: frozenset[str] = frozenset()  # proposers that cannot draft for the row this step
    backlog: Mapping[str, int] = field(default_factory=dict)  # model proposer it may use -> tokens to take in first
    fixed: Choice | None = None  # not the policy's to choose: a fixed method, or an `auto` row not planned


class DraftPolicy(Protocol):
    """What the planner asks of `auto`'s policy each step."""

    def due(self, request_id: str) -> bool: ...  # is the `auto` row planned this step (asked once a step)
    def decide(self, rows: list[Candidate], room: Room | None = None) -> list[Choice]: ...  # every row's (proposer, k)
    def observe(self, request_id: str, proposer: str | None, drafted: int, accepted: int, level: int = 0,
                sampled: bool = False) -> None: ...  # what verification kept of a row's drafts
    def observe_planning(self, seconds: float, rows: int) -> None: ...  # planning `rows` rows took `seconds`
    def forget(self, request_id: str) -> None: ...


@dataclass
class FixedPolicy:
    """The trivial policy: every planned `auto` row drafts `k` tokens with `proposer` where it can (a
    lookahead proposer: what it offers), or nothing (`proposer` None, `k` 0: `auto` decodes as `none`)."""

    proposer: str | None = None
    k: int = 0

    def due(self, request_id: str) -> bool:
        return True

    def decide(self, rows: list[Candidate], room: Room | None = None) -> list[Choice]:
        def one(row: Candidate) -> Choice:
            name = self.proposer
            if row.fixed is not None:
                return row.fixed
            if name in row.offers:  # a lookahead proposer: what it offers
                k = min(self.k, row.k_max, row.offers[name].drafts)
            else:  # a model proposer the row may use (its backlog is known), or nothing
                k = min(self.k, row.k_max) if name in row.backlog else 0
            return Choice(name, k) if k else PLAIN

        return [one(r) for r in rows]

    def observe(self, *args: object, **kwargs: object) -> None:
        pass

    def observe_planning(self, seconds: float, rows: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


@dataclass
class _RowState:
    steps: int = 0  # choices made for the row
    last_used: dict[str, int] = field(default_factory=dict)  # proposer -> the step it was last chosen
    wait: int = 0  # steps the row sits out of planning before the next (`due`)
    planned_in: int = 0  # the batch size this step's plan was made in (0: not planned this step)
    gain: float | None = None  # kept draft tokens per planned step (decayed)


@dataclass(frozen=True)
class BatchRow:
    """A row of the batch for `allot`: the drafts it verifies whatever the others do (`k` by `proposer`),
    or for a flexible row (`auto`, with a lookahead offer) how many of `proposer`'s drafts it may verify."""

    request_id: str
    proposer: str | None = None
    k: int = 0
    level: int = 0
    flexible: int = 0
    sampled: bool = False
    backlog: int = 0


class StepCosts:
    """Costs relative to a plain step of this step's batch, computed once each and read by every row: the
    step's table (a new one each step, so nothing outlives the timings it was computed from). `room`: what
    the step's token budget leaves drafts (budget.py), None: no limit."""

    def __init__(self, policy: AutoPolicy, rows: int, room: Room | None = None) -> None:
        self.policy, self.rows = policy, rows
        self.room = room.tokens if room is not None else None  # the most draft tokens in all
        self.passes: PassCosts = policy.cost.costs(rows)
        self.plain = self.passes.verify(rows)  # a plain pass of this batch, as the curve prices it
        self._memo: dict[tuple[object, ...], object] = {}
        self._displacing: tuple[int, float] | None = None
        if room is not None and room.displacing:  # where drafts start displacing prompt tokens, and a token's price
            self._displacing = rows + room.free, (self.passes.verify(rows + room.tokens) - self.plain) / room.tokens

    def verify(self, tokens: int) -> float:
        """A pass whose decoding rows feed `tokens` tokens. Once drafts displace prompt tokens (a chunk of a
        prompt would have taken their place: budget.py), the pass is no wider, but each displaced token is
        computed by a later pass: such a draft token costs a prompt token, the curve's slope over the room."""
        if self._displacing is None or tokens <= self._displacing[0]:
            return self.passes.verify(tokens)
        start, per_token = self._displacing
        return self.passes.verify(start) + (tokens - start) * per_token

    def _cached(self, key: tuple[object, ...], make):  # noqa: ANN001, ANN202
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def token_cost(self, k: int) -> float:
        """One row's k more verified tokens, per token, over the row's share of a plain step. Packed, only
        its k tokens are added; padded, every row's pass widens by k."""
        plain, rows = self.plain, self.rows
        if self.policy.packed:
            return rows * max(self.verify(rows + k) - plain, 0.0) / (k * plain)
        return max(self.verify(rows * (k + 1)) - plain, 0.0) / (k * plain)

    def own_cost(self, proposer: str) -> float:
        """One of `proposer`'s draft tokens over a plain step: declared, else timed, else untimed's."""
        def make() -> float:
            declared = self.policy.traits[proposer].draft_token_cost
            if declared is not None:
                return declared
            forward = self.policy.cost.draft_time(proposer, self.rows)
            return forward / self.plain if forward is not None else self.policy.tuning.untimed_draft_cost

        return self._cached(("own", proposer), make)

    def method_costs(self, proposer: str, k_max: int) -> list[float]:
        """c for `proposer` drafting k = 1..k_max (index k - 1): verifying and producing, per token."""
        own = self.own_cost(proposer)
        return self._cached(("c", proposer, k_max), lambda: [self.token_cost(k) + own for k in range(1, k_max + 1)])

    def ceiling(self, proposer: str, k_max: int) -> float:
        """The speedup `proposer` would give if every draft were kept: what no acceptance can beat."""
        return self._cached(("top", proposer, k_max), lambda: best_k(1.0, self.method_costs(proposer, k_max), k_max)[1])

    def drafting_seconds(self, proposer: str, k: int, backlog: int) -> float:
        """A proposer's k draft forwards for the batch and the backlog its rows take in first, in seconds."""
        return k * self.own_cost(proposer) * self.plain + self.policy.cost.backlog_time(proposer, backlog)


class AutoPolicy:
    """`auto`'s policy (see the module docstring): pure bookkeeping, fed outcomes and asked each step."""

    def __init__(
        self,
        traits: dict[str, Traits],
        cost: CostModel,
        acceptance: AcceptanceModel,
        packed: bool = False,
        tuning: AutoTuning | None = None,
    ) -> None:
        """`traits`: every proposer `auto` may choose, in order of preference on ties. `packed`: the target's
        verify passes compute only real tokens (else every row is padded to the widest)."""
        self.traits, self.cost, self.acceptance, self.packed = traits, cost, acceptance, packed
        self.tuning = tuning or AutoTuning()
        self.rows: dict[str, _RowState] = {}
        self._plan_row_s: float | None = None  # seconds of planning per row planned (decayed mean)
        self._gain = 1.0  # kept draft tokens per planned step, every row's (decayed): a new row's prior

    # ---- per row ---------------------------------------------------------------------------------
    def rates(self, request_id: str, proposer: str, k_max: int, level: int = 0, sampled: bool = False) -> list[float]:
        """Per draft position, the chance the row keeps `proposer`'s drafts at confidence `level`."""
        priors = self.traits[proposer].confidence_priors
        prior = priors[min(level, len(priors) - 1)] * (self.tuning.sampled_prior_scale if sampled else 1.0)
        return self.acceptance.rates(request_id, proposer, k_max, level, sampled, prior)

    def _usable(self, proposer: str, row: Candidate) -> bool:
        """A lookahead proposer only with something to offer; a model proposer always."""
        return proposer not in row.blind and (not self.traits[proposer].lookahead or proposer in row.offers)

    def choose(self, row: Candidate, step: StepCosts) -> Choice:
        """The row's own best (proposer, k), as if the batch's other rows did not change its costs."""
        state = self.rows.setdefault(row.request_id, _RowState())
        state.steps += 1
        best = PLAIN
        for name in self.traits:
            if not self._usable(name, row):
                continue
            offer = row.offers.get(name, Offer(row.k_max))
            limit = min(row.k_max, offer.drafts)
            if step.ceiling(name, limit) <= self.tuning.min_gain:  # cannot pay even if every draft were kept
                continue
            a = self.rates(row.request_id, name, limit, offer.level, row.sampled)
            k, gain = best_k(a, step.method_costs(name, limit), limit)
            if k and gain > best.predicted_speedup * (self.tuning.min_gain if best.proposer is None else 1.0):
                best = Choice(name, k, gain)
        # In a padded batch one row's lone probe widens the pass for every row: there, rows draft only
        # within the batch's width (`allot`).
        if best.proposer is None and row.k_max and (step.rows == 1 or self.packed):
            costs = {m: step.method_costs(m, 1)[0] for m in self.traits if self._usable(m, row)}
            best = self._probe(state, costs, row.k_max) or best
        if best.proposer is not None:
            state.last_used[best.proposer] = state.steps
        return best

    def _probe(self, state: _RowState, costs: dict[str, float], k_max: int) -> Choice | None:
        """Now and then one draft token with an unused proposer, so a row whose text turns predictable is
        noticed. A probe costs c; probing every c / probe_budget steps keeps probes within that fraction
        of the steps (a cheap lookup is tried every few steps, a model rarely). A proposer that cannot pay
        even if every draft were kept is never probed."""
        t = self.tuning
        for name, cost in costs.items():
            if best_k(1.0, cost, k_max)[1] < t.min_gain:
                continue
            interval = min(max(math.ceil(cost / t.probe_budget), t.min_probe_interval), t.max_probe_interval)
            if state.steps - state.last_used.get(name, 0) >= interval:
                return Choice(name, 1)
        return None

    # ---- per batch ---------------------------------------------------------------------------------
    def decide(self, rows: list[Candidate], room: Room | None = None) -> list[Choice]:
        """Every row's (proposer, k) this step: the planned `auto` rows' choices, then the batch's, within the
        `room` the step's token budget leaves drafts (the planner cuts what is over it)."""
        step = StepCosts(self, len(rows), room)
        choices = [r.fixed if r.fixed is not None else self.choose(r, step) for r in rows]
        planned = [b for b, r in enumerate(rows) if r.fixed is None]
        for b in planned:
            self.rows[rows[b].request_id].planned_in = len(rows)
        if len(rows) > 1 and planned:
            choices = self._batch(rows, choices, step)
        return choices

    def _batch(self, rows: list[Candidate], choices: list[Choice], step: StepCosts) -> list[Choice]:
        """The batch's drafts: each flexible row's share of the pass (`allot`), and the model proposers the
        `auto` rows chose kept only if the batch gains by `min_gain` with them."""
        def lookahead(name: str | None) -> bool:
            return name is not None and self.traits[name].lookahead

        def batch_rows(demote: bool) -> list[BatchRow]:
            out = []
            for row, choice in zip(rows, choices, strict=True):
                name, k, free = choice.proposer, choice.k, row.fixed is None
                if free and demote and name is not None and not lookahead(name):
                    name, k = None, 0
                # a planned row not drafting with a model: its lookahead offer (the chosen one, else the first)
                usable = [n for n in row.offers if n not in row.blind]
                offer = None if not free or not usable or not (name is None or lookahead(name)) else (
                    name if name in usable else usable[0])
                if offer is not None:  # flexible: the pass decides how many of its lookahead drafts it verifies
                    out.append(BatchRow(row.request_id, offer, level=row.offers[offer].level, sampled=row.sampled,
                                         flexible=min(row.offers[offer].drafts, row.k_max)))
                elif lookahead(name):
                    got = row.offers.get(name, Offer(0))
                    out.append(BatchRow(row.request_id, name, min(k, got.drafts), got.level, sampled=row.sampled))
                else:
                    out.append(BatchRow(row.request_id, name, k if name else 0, sampled=row.sampled,
                                         backlog=row.backlog.get(name, 0) if name and k else 0))
            return out

        brows = batch_rows(demote=False)
        ks, rate = self.allot(brows, step)
        if any(not lookahead(c.proposer) and c.proposer is not None for r, c in zip(rows, choices, strict=True)
               if r.fixed is None):
            without = batch_rows(demote=True)
            other_ks, other_rate = self.allot(without, step)
            # the model's drafts must pay by the margin any drafting needs: each row chose them priced as if
            # the whole batch shared its forwards, and what the batch pays besides (planning, commits, the
            # model's bookkeeping) is in neither estimate
            if other_rate * self.tuning.min_gain >= rate:
                brows, ks = without, other_ks
                choices = [PLAIN if r.fixed is None and not lookahead(c.proposer) else c
                           for r, c in zip(rows, choices, strict=True)]
        return [(Choice(br.proposer, k) if k else PLAIN) if br.flexible else c
                for br, k, c in zip(brows, ks, choices, strict=True)]

    def allot(self, rows: list[BatchRow], step: StepCosts) -> tuple[list[int], float]:
        """How many drafts each row verifies (a flexible row's share of its offer; other rows keep their k)
        and the expected tokens per second that gives."""
        fixed_tokens, drafting_s, expected = 0.0, 0.0, []
        for r in rows:
            if r.flexible:  # its expected tokens with 0..flexible drafts
                expected.append(expected_tokens_upto(self.rates(r.request_id, r.proposer, r.flexible, r.level,
                                                                r.sampled), r.flexible))
            elif r.proposer is not None:
                rates = self.rates(r.request_id, r.proposer, r.k, r.level, r.sampled)
                fixed_tokens += expected_tokens_upto(rates, r.k)[-1]
            else:
                fixed_tokens += 1.0
        for name in {r.proposer for r in rows if r.k and not r.flexible and r.proposer is not None}:
            mine = [r for r in rows if r.proposer == name and r.k and not r.flexible]
            drafting_s += step.drafting_seconds(name, max(r.k for r in mine), sum(r.backlog for r in mine))
        if self.packed:
            return self._packed(rows, step, fixed_tokens, drafting_s, expected)
        return self._padded(rows, step, fixed_tokens, drafting_s, expected)

    def _packed(self, rows: list[BatchRow], step: StepCosts, fixed_tokens: float, drafting_s: float,
                expected: list[list[float]]) -> tuple[list[int], float]:
        """A pass costs the tokens it computes: a flexible row's j-th draft adds its chance of being kept (its
        earlier ones kept too: non-increasing in j) and one token; the likeliest drafts go first, as many
        as maximise expected tokens per second (stopping once even every draft left, all kept, could not
        beat the best so far: wider passes take at least as long)."""
        flexible = [b for b, r in enumerate(rows) if r.flexible]
        fed = sum(1 + (0 if r.flexible else r.k) for r in rows)
        gains = sorted(((e[j] - e[j - 1], b) for b, e in zip(flexible, expected, strict=True)
                        for j in range(1, len(e))), key=lambda g: -g[0])
        tokens = fixed_tokens + len(flexible)
        if step.room is not None:  # the budget's room for drafts: those of fixed rows, then these
            gains = gains[: max(0, step.room - sum(0 if r.flexible else r.k for r in rows))]
        best_n, best = 0, tokens / (step.verify(fed) + drafting_s)
        floor = best * (self.tuning.min_gain if fed == len(rows) else 1.0)
        rest = sum(gain for gain, _ in gains)
        for n, (gain, _) in enumerate(gains, start=1):
            seconds = step.verify(fed + n) + drafting_s
            if (tokens + rest) / seconds <= max(best, floor):
                break
            tokens += gain
            rest -= gain
            if tokens / seconds > max(best, floor):
                best_n, best = n, tokens / seconds
        ks = [0 if r.flexible else r.k for r in rows]
        for _, b in gains[:best_n]:
            ks[b] += 1
        return ks, best

    def _padded(self, rows: list[BatchRow], step: StepCosts, fixed_tokens: float, drafting_s: float,
                expected: list[list[float]]) -> tuple[list[int], float]:
        """Every row is computed as wide as the widest, so widening costs the same whoever drafts: one width
        W for the batch (the rows with fixed drafts set the least), every flexible row drafting up to it."""
        fixed_w = max((r.k for r in rows), default=0)
        top = max([fixed_w, *(r.flexible for r in rows if r.flexible)])

        def score(w: int) -> float:
            tokens = fixed_tokens + sum(e[min(w, len(e) - 1)] for e in expected)
            return tokens / (step.verify(len(rows) * (w + 1)) + drafting_s)

        best_w, best = fixed_w, score(fixed_w)
        floor = best * (self.tuning.min_gain if fixed_w == 0 else 1.0)
        for w in range(fixed_w + 1, top + 1):
            if (s := score(w)) > max(best, floor):
                best_w, best = w, s
        return [min(best_w, r.flexible) if r.flexible else r.k for r in rows], best

    # ---- what verification said -------------------------------------------------------------------
    def observe(self, request_id: str, proposer: str | None, drafted: int, accepted: int, level: int = 0,
                sampled: bool = False) -> None:
        """What verification did to one row's drafts (none: a plain step)."""
        state = self.rows.setdefault(request_id, _RowState())
        if state.planned_in:
            self._score_plan(state, accepted if proposer is not None and drafted else 0)
        if proposer is not None:
            self.acceptance.observe(request_id, proposer, drafted, accepted, level, sampled)

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)
        self.acceptance.forget(request_id)

    # ---- how often a row whose plans gain nothing is planned -------------------------------------------
    # Planning a row (its lookups, its choice, its share of the batch's) costs the same whether or not it
    # ends in drafts: in a full batch on a CPU a few percent of a step, and open text rarely offers a draft
    # that pays there. A row whose drafts gained less per planned step than planning it costs sits out the
    # next steps: as many as keep idle rows' planning within `idle_planning` of a step. Alone, planning is
    # cheap and a row is planned every step; a copying row always is.
    def observe_planning(self, seconds: float, rows: int) -> None:
        """Planning `rows` rows (lookups, choices, the batch's drafts; not model drafting) took `seconds`."""
        if rows:
            per_row, last, d = seconds / rows, self._plan_row_s, self.tuning.planning_decay
            self._plan_row_s = per_row if last is None else d * last + (1 - d) * per_row

    def planning_share(self, rows: int) -> float:
        """What planning one row of a batch of `rows` costs, over the row's share of a plain step."""
        step = self.cost.plain_time(rows) if self._plan_row_s is not None else None
        return self._plan_row_s * rows / step if step else 0.0

    def idle_gap(self, rows: int) -> int:
        """Every how many steps an idle row of a batch of `rows` is planned."""
        t = self.tuning
        return max(1, min(t.max_idle_gap, math.ceil(self.planning_share(rows) / t.idle_planning)))

    def due(self, request_id: str) -> bool:
        state = self.rows.get(request_id)
        if state is None or state.wait <= 0:
            return True
        state.wait -= 1
        return False

    def _score_plan(self, state: _RowState, accepted: int) -> None:
        rows, state.planned_in = state.planned_in, 0
        d, g = self.tuning.planning_decay, self.tuning.gain_prior_decay
        state.gain = d * (self._gain if state.gain is None else state.gain) + (1 - d) * accepted
        self._gain = g * self._gain + (1 - g) * accepted
        state.wait = 0 if state.gain >= self.planning_share(rows) else self.idle_gap(rows) - 1
