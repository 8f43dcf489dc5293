"""`auto`'s tuning constants, in one frozen object (docs/auto.md says what each one does).

The engine logs the values it runs with at start-up. The `auto_tuning` setting overrides some for
experiments (YAML `auto_tuning: {min_gain: 1.05}`, or `SPECULA_AUTO_TUNING='{"min_gain": 1.05}'`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoTuning:
    # the objective (policy.py)
    min_gain: float = 1.03  # drafting must beat plain decoding by this factor: the estimates are noisy
    # acceptance (acceptance.py)
    row_decay: float = 0.9  # per observed step of a row: recent drafts matter more (text alternates copying and not)
    engine_decay: float = 0.99  # per observed step, for the engine-wide figures a new row starts from
    row_prior_weight: float = 4.0  # comparisons' worth of the engine-wide figures in a row's estimate
    level_prior_weight: float = 4.0  # comparisons' worth of a proposer's declared prior in the engine-wide figures
    run_weight: float = 2.0  # comparisons' worth of the position before, for a draft position with little evidence
    sampled_prior_scale: float = 0.7  # a sampled row keeps a right draft with probability p(x) <= 1: priors start lower
    # costs (cost.py)
    timings_kept: int = 8  # verify timings kept per batch size and width: their median is the estimate
    draft_timings_kept: int = 128  # a model proposer's draft and backlog timings kept per batch size
    prior_token_ratio: float = 0.05  # before a wider pass is timed: what each extra token adds to a one-row pass
    untimed_draft_cost: float = 0.75  # a model proposer's draft token before it is timed, in plain passes
    # probes (policy.py)
    probe_budget: float = 0.02  # probes of an unused proposer cost at most this fraction of a row's steps
    min_probe_interval: int = 2  # ... come at most this often (steps)
    max_probe_interval: int = 64  # ... and at least this often
    # planning rows whose plans gain nothing (policy.py)
    idle_planning: float = 0.005  # idle rows are planned within this fraction of a plain step
    max_idle_gap: int = 8  # ... and at least every this many steps
    planning_decay: float = 0.9  # per plan: planning's time per row, and a row's gain from being planned
    gain_prior_decay: float = 0.99  # per plan: every row's gain, the prior of a new row's

    def with_overrides(self, overrides: Mapping[str, float]) -> AutoTuning:
        """These values with `overrides` (a name each); a ValueError names any it does not know."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(f"auto_tuning: unknown constant(s) {', '.join(unknown)} (known: {', '.join(fields)})")
        values = {name: (int(v) if fields[name].type == "int" else float(v)) for name, v in overrides.items()}
        return dataclasses.replace(self, **values)
