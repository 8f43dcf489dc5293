"""`auto`'s cost model (server/speculation/cost.py): a pass's time is its batch size's plain pass times its
width's ratio to the plain passes of its moment; calibration's timings are priors, scaled to today."""

from __future__ import annotations

import pytest

from server.speculation.acceptance import AcceptanceModel
from server.speculation.cost import CostModel, non_decreasing
from server.speculation.draft_model import DraftModelProposer
from server.speculation.ngram import NgramProposer
from server.speculation.policy import AutoPolicy, StepCosts
from tests.engine_helpers import FixedCosts

# One row's verify times by width (tokens fed), shaped like this project's 2-core machine in fp32: a few
# tokens cost far more per token than many (the matrix multiplies change regime), so no line fits.
CPU_PASSES = {1: 0.060, 4: 0.095, 8: 0.130, 9: 0.155, 36: 0.204, 72: 0.475}


def cpu_costs(prior: bool = False, slowdown: float = 1.0) -> CostModel:
    cost = CostModel()
    for _ in range(3 if not prior else 2):
        for n, seconds in CPU_PASSES.items():
            cost.observe_verify(1, n, seconds * slowdown, prior=prior)
    return cost


def step(cost: CostModel, rows: int, packed: bool = False) -> StepCosts:
    """A step's table of relative costs, for a batch of `rows`."""
    return StepCosts(AutoPolicy({"ngram": NgramProposer.traits}, cost, AcceptanceModel(), packed), rows)


def test_verify_time_is_the_measured_curve_not_a_line():
    cost = cpu_costs()
    for n, seconds in CPU_PASSES.items():
        assert cost.verify_time(1, n) == pytest.approx(seconds)  # a measured width: as measured
    assert cost.verify_time(1, 6) == pytest.approx((0.095 + 0.130) / 2)  # between two: interpolated
    assert cost.verify_time(1, 100) > cost.verify_time(1, 72)  # past the widest: still growing
    assert cost.timed


def test_before_any_timing_passes_are_priced_by_the_prior_in_plain_passes():
    cost = CostModel()
    assert cost.verify_time(1, 1) is None and not cost.timed
    costs = cost.costs(4)  # one-row plain passes: 1 + r (n - 1)
    r = cost.tuning.prior_token_ratio
    assert costs.verify(4) == pytest.approx(1 + 3 * r) and costs.verify(6) == pytest.approx(1 + 5 * r)


def test_a_widths_time_is_robust_to_one_slow_pass_and_never_below_a_narrower_ones():
    cost = cpu_costs()
    cost.observe_verify(1, 4, 1.0)  # one pass stalled (another process took the core)
    assert cost.verify_time(1, 4) == pytest.approx(0.095)
    cost.observe_verify(1, 12, 0.100)  # noise: wider, yet timed below the 9-token pass
    assert cost.verify_time(1, 12) >= cost.verify_time(1, 9)


def test_a_width_timed_once_slowly_does_not_lift_the_widths_timed_often():
    """A 7-token pass timed once at twice its cost (a thread-count probe, a stall) sits below 8 and 16,
    timed eight times each: the curve stays near what 8 and 16 measured instead of rising to the outlier
    for every wider width (so `auto` does not stop drafting wide on one bad timing)."""
    cost = CostModel()
    for _ in range(8):
        for n, seconds in ((1, 0.040), (4, 0.060), (8, 0.078), (16, 0.090)):
            cost.observe_verify(1, n, seconds)
    cost.observe_verify(1, 7, 0.115)
    assert cost.verify_time(1, 8) < 0.083 and cost.verify_time(1, 16) == pytest.approx(0.090)
    assert cost.verify_time(1, 7) <= cost.verify_time(1, 8) <= cost.verify_time(1, 16)
    assert cost.verify_time(1, 4) == pytest.approx(0.060)


def test_non_decreasing_is_the_weighted_isotonic_fit():
    assert non_decreasing([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert non_decreasing([1.0, 3.0, 2.0, 4.0], [1, 1, 3, 1]) == [1.0, 2.25, 2.25, 4.0]
    assert non_decreasing([5.0, 1.0, 1.0], [1, 1, 2]) == pytest.approx([2.0, 2.0, 2.0])


def test_a_batch_where_nobody_drafted_still_prices_a_draft():
    """Every pass of a batch where nobody drafts has the plain width: a wider pass is priced by the prior's
    share of a row per token until one is timed."""
    cost = CostModel()
    for _ in range(8):
        cost.observe_verify(8, 8, 0.08)
    assert cost.verify_time(8, 8) == pytest.approx(0.08)
    assert cost.verify_time(8, 16) > cost.verify_time(8, 8)


def test_a_calibration_taken_on_a_busy_machine_is_scaled_to_the_speed_steps_run_at():
    """Several servers starting at once time every pass ~20x too slow. Scaled by what plain steps measure
    now, the curve keeps calibration's ratios at today's speed: a wide pass costs what it costs, so `auto`
    still drafts, and draft forwards are scaled alike."""
    cost = cpu_costs(prior=True, slowdown=20.0)
    cost.observe_draft("draft", 1, 4, 4 * 0.050 * 20.0, prior=True)
    for _ in range(20):
        cost.observe_verify(1, 1, CPU_PASSES[1])
    assert cost.scale() == pytest.approx(1 / 20)
    for n, seconds in CPU_PASSES.items():
        assert cost.verify_time(1, n) == pytest.approx(seconds)
    assert cost.draft_time("draft") == pytest.approx(0.050)
    assert step(cost, 1).token_cost(8) == pytest.approx((0.155 - 0.060) / (8 * 0.060))


def test_a_width_traffic_times_slower_than_calibration_did_outweighs_it():
    """Calibration timed one-row passes; traffic, between plain passes that agree with calibration's, times
    the 9-token pass at twice calibration's ratio: its evidence soon outweighs calibration's (8 timings
    against 2), and the 36-token width, which calibration timed cheaper than that, is pooled with it (a wider
    pass never costs less). The host itself runs as fast as at calibration: widths traffic never timed keep
    calibration's ratio at about calibration's time."""
    cost = cpu_costs(prior=True)
    for _ in range(20):
        cost.observe_verify(1, 1, CPU_PASSES[1])
    for _ in range(8):
        cost.observe_verify(1, 1, CPU_PASSES[1])
        cost.observe_verify(1, 9, 0.310)
    assert cost.scale() == pytest.approx(1.0, rel=0.1)
    assert cost.verify_time(1, 9) == pytest.approx(cost.verify_time(1, 36)) and cost.verify_time(1, 9) > 0.27
    assert cost.verify_time(1, 72) == pytest.approx(0.475, rel=0.1)


def test_a_batch_size_whose_rows_always_draft_still_follows_the_hosts_speed():
    """One row drafting at every step times no plain pass: its wider passes, over their width's ratio, say
    how fast a plain pass would run now (here the host got three times slower than at calibration)."""
    cost = cpu_costs(prior=True)
    for _ in range(8):
        cost.observe_verify(1, 9, 3 * CPU_PASSES[9])
    assert cost.plain_time(1) == pytest.approx(3 * CPU_PASSES[1], rel=0.05)
    assert cost.verify_time(1, 4) == pytest.approx(3 * CPU_PASSES[4], rel=0.05)


def test_a_model_proposers_draft_cost_is_read_per_number_of_rows_drafting():
    """A draft head's forward for one row costs a fraction of its forward for eight (CPU): each batch size
    reads its own timing, between timed sizes a linear mix, beyond them the nearest, and traffic's timings
    replace calibration's for the sizes traffic drafted at."""
    cost = cpu_costs(prior=True)
    cost.observe_draft("eagle", 1, 4, 4 * 0.003, prior=True)
    cost.observe_draft("eagle", 8, 4, 4 * 0.010, prior=True)
    assert cost.draft_time("eagle", 1) == pytest.approx(0.003)
    assert cost.draft_time("eagle", 8) == pytest.approx(0.010)
    assert cost.draft_time("eagle", 4) == pytest.approx(0.003 + 3 / 7 * 0.007)
    assert cost.draft_time("eagle", 16) == pytest.approx(0.010)
    cost.observe_draft("eagle", 1, 2, 2 * 0.002)  # traffic at one row: read instead of calibration's
    assert cost.draft_time("eagle", 1) == pytest.approx(0.002)
    assert cost.draft_time("eagle", 8) == pytest.approx(0.010)
    assert cost.draft_time("other") is None


def test_a_step_reads_one_table_and_the_next_step_sees_new_timings():
    """`auto` reads each proposer's cost per k from the step's table (every row of a step asks for the same
    list); a new verify or draft timing reaches the next step's table."""
    cost = cpu_costs()
    cost.observe_draft("draft", 4, 4, 4 * 0.02)
    first = StepCosts(AutoPolicy({"draft": DraftModelProposer.traits}, cost, AcceptanceModel(), packed=True), 4)
    before = first.method_costs("draft", 3)
    assert first.method_costs("draft", 3) is before  # asked again within a step: the same list
    for _ in range(8):
        cost.observe_verify(4, 4, 0.095)
        cost.observe_verify(4, 5, 0.2)  # the marginal token of a 4-row batch turns out dear
    dearer = StepCosts(first.policy, 4).method_costs("draft", 3)
    assert dearer[0] > before[0]


def test_a_wider_pass_is_priced_against_the_plain_passes_of_its_moment():
    """A 4-row batch: plain passes 30 ms and, now and then, a pass with two drafts at 36 ms (x1.2). The
    machine then runs slower for a while (plain passes 45 ms) and no draft is timed meanwhile: a draft
    still costs what it did against a plain pass, 1.2x the plain passes of now, not the 36 ms of earlier
    (which would make drafting look nearly free exactly when plain passes run slow)."""
    cost = CostModel()
    for _ in range(8):
        for _ in range(3):
            cost.observe_verify(4, 4, 0.030)
        cost.observe_verify(4, 6, 0.036)
    before = step(cost, 4, packed=True).token_cost(2)
    for _ in range(8):
        cost.observe_verify(4, 4, 0.045)
    assert cost.verify_time(4, 4) == pytest.approx(0.045)
    assert cost.verify_time(4, 6) == pytest.approx(0.054)
    assert step(cost, 4, packed=True).token_cost(2) == pytest.approx(before)


def test_one_slow_pass_does_not_reprice_a_width_calibration_measured():
    """Start-up calibration timed 12 tokens of a 4-row batch at 1.27x its plain pass, three times. Traffic
    times that width once, at 1.85x (a burst of the host, or noise): the width stays at what calibration
    measured. Timed slow again and again, the evidence wins."""
    cost = CostModel()
    for _ in range(3):
        cost.observe_verify(4, 4, 0.030, prior=True)
        cost.observe_verify(4, 12, 0.030 * 1.27, prior=True)
    for _ in range(8):
        cost.observe_verify(4, 4, 0.030)
    cost.observe_verify(4, 12, 0.030 * 1.85)
    assert cost.verify_time(4, 12) == pytest.approx(0.030 * 1.27)
    for _ in range(6):
        cost.observe_verify(4, 4, 0.030)
        cost.observe_verify(4, 12, 0.030 * 1.85)
    assert cost.verify_time(4, 12) == pytest.approx(0.030 * 1.85)


def test_each_batch_size_reads_its_own_curve():
    """8 tokens cost less as one row drafting 7 than as 8 plain rows, and one draft token in a batch of 8
    costs what its packed pass measured; a batch size with no wider pass timed borrows another's."""
    cost = CostModel()
    for _ in range(3):
        cost.observe_verify(1, 1, 0.045)
        cost.observe_verify(1, 8, 0.070)  # one row, 7 drafts
        cost.observe_verify(8, 8, 0.086)  # eight rows, nobody drafting
        cost.observe_verify(8, 9, 0.105)  # eight rows, one drafting one token
    assert cost.verify_time(1, 8) == pytest.approx(0.070)
    assert cost.verify_time(8, 8) == pytest.approx(0.086)
    assert step(cost, 8, packed=True).token_cost(1) == pytest.approx(8 * 0.019 / 0.086)
    assert cost.verify_time(8, 20) > cost.verify_time(8, 9)  # past its widths: its line continues
    # A batch size timed at its plain width only adds what the same drafts added at the next larger batch
    # size with a curve (a closed loop's 7 rows between two requests read the 8-row costs).
    cost.observe_verify(4, 4, 0.060)
    assert cost.verify_time(4, 5) == pytest.approx(0.060 + 0.019)
    assert step(cost, 4, packed=True).token_cost(1) == pytest.approx(4 * 0.019 / 0.060)
    assert cost.verify_time(9, 10) > cost.verify_time(9, 9)  # above every curve: the largest below's
    assert cost.plain_time(6) == pytest.approx((0.060 + 0.086) / 2)  # between timed batch sizes: linear


def test_fixed_costs_price_every_pass_on_one_line():
    """The tests' fixed costs (engine_helpers.FixedCosts): 1 + r (n - 1) one-row passes, whatever the rows."""
    cost = FixedCosts(token_ratio=0.1)
    for rows, tokens in ((1, 1), (1, 9), (4, 4), (4, 12), (8, 40)):
        assert cost.verify_time(rows, tokens) == pytest.approx(1 + 0.1 * (tokens - 1))
