"""`--checkpoint-every auto`'s interval (`raytrain.rules.interval.AutoInterval`): Daly's interval
from the measured stall and step time and a failure rate learnt from the run (pure)."""

from __future__ import annotations

import pytest

from raytrain.rules import goodput
from raytrain.rules.goodput import HOUR_S
from raytrain.rules.interval import AutoInterval


def auto(**changes) -> AutoInterval:
    values = dict(mtbf_hours=1000.0, nodes=10, min_steps=10, max_steps=100_000, per_step=False)
    return AutoInterval(**{**values, **changes})


def test_min_steps_until_a_save_is_measured():
    interval = auto()
    assert interval.held == 10
    assert interval.due(10) and not interval.due(9)
    assert "the first save measures its stall" in interval.describe()
    interval.on_steps(10, 1.0)
    assert interval.held == 10  # a step time, but no stall yet


def test_daly_interval_from_the_measured_costs():
    interval = auto()
    interval.on_steps(100, 10.0)  # 0.1 s a step
    change = interval.on_save(2.0)
    # prior: one failure per 1000 node-hours (plus the few seconds trained), over 10 nodes
    mtbf = (1000.0 + 12.0 * 10 / HOUR_S) * HOUR_S / 10
    expected = round(goodput.daly_interval_s(2.0, mtbf) / 0.1)
    assert interval.held == expected
    assert change is not None and (change.before, change.after, change.cause) == (10, expected, "save")
    assert f"10 → {expected:,} steps" in change.line and "a save stalls 2.00 s" in change.line
    assert "0 failures" in change.line and "prior 1,000 h per node" in change.line


def test_stall_is_the_median_of_the_last_saves():
    interval = auto()
    interval.on_steps(100, 10.0)
    for stall in (30.0, 1.0, 1.2, 0.8, 1.1):  # the first save allocates: it weighs no more than another
        interval.on_save(stall)
    assert interval.stall_s == pytest.approx(1.1)
    for stall in (2.0,) * 5:
        interval.on_save(stall)
    assert interval.stall_s == 2.0  # only the last five count


def test_failures_shorten_the_interval_and_training_without_them_lengthens_it():
    interval = auto()
    interval.on_steps(100, 10.0)
    interval.on_save(2.0)
    first = interval.held
    change = interval.on_failure()
    # one failure in ~0 node-hours beyond the prior: the rate doubles, the interval shrinks by about √2
    assert change is not None and change.cause == "failure" and "1 failure in" in change.line
    assert interval.held == pytest.approx(first / 2**0.5, rel=0.02)
    interval.on_steps(360_000_000, 36_000_000.0)  # 100,000 node-hours more without a failure
    interval.on_save(2.0)
    assert interval.held > first
    assert interval.node_mtbf_s == pytest.approx((1000.0 + interval.node_hours) / 2 * HOUR_S)


def test_per_step_rolls_back_on_the_head_node_only():
    restart, per_step = auto(), auto(per_step=True)
    for interval in (restart, per_step):
        interval.on_steps(100, 10.0)
        interval.on_save(2.0)
    assert per_step.rollback_mtbf_s == pytest.approx(10 * restart.rollback_mtbf_s)
    assert per_step.held == pytest.approx(restart.held * 10**0.5, rel=0.05)
    assert "per-step" in per_step.describe()


def test_bounds_and_their_line():
    low = auto(max_steps=50)
    low.on_steps(100, 10.0)
    change = low.on_save(2.0)
    assert low.held == 50 and "(at --checkpoint-max-steps)" in change.line
    high = auto(min_steps=50_000)  # Daly says about 12,000: the minimum holds
    high.on_steps(100, 10.0)
    assert high.on_save(2.0) is None  # held at the minimum: nothing changed
    assert high.held == 50_000 and "(at --checkpoint-min-steps)" in high.describe()


def test_small_moves_are_not_changes():
    interval = auto()
    interval.on_steps(100, 10.0)
    interval.on_save(2.0)
    held = interval.held
    assert interval.on_save(2.1) is None  # the median moves 2.5 %: the interval stays
    assert interval.held == held
    for _ in range(3):
        last = interval.on_save(8.0)  # the stall quadruples: the interval doubles
    assert last is not None and interval.held > 1.5 * held


def test_step_time_is_the_median_of_the_recent_steps():
    interval = auto()
    interval.on_steps(10, 1.0)
    interval.on_steps(10, 2.0)
    assert interval.step_s == pytest.approx(0.15)
    interval.on_steps(0, 5.0)  # nothing taken: nothing learnt
    assert interval.step_s == pytest.approx(0.15)
    for _ in range(20):
        interval.on_steps(1, 0.1)
    interval.on_steps(1, 3.0)  # one slow step (a loaded machine) does not move it
    assert interval.step_s == pytest.approx(0.1)


def test_state_round_trip_across_a_restart():
    interval = auto()
    interval.on_steps(100, 10.0)
    interval.on_save(2.0)
    interval.on_failure()
    again = AutoInterval.from_state(
        interval.state(), mtbf_hours=1000.0, nodes=10, min_steps=10, max_steps=100_000, per_step=False
    )
    assert again == interval
    assert (
        AutoInterval.from_state(None, mtbf_hours=1000.0, nodes=10, min_steps=10, max_steps=100_000, per_step=False)
        == auto()
    )
    # new bounds apply to the held interval
    bounded = AutoInterval.from_state(
        interval.state(), mtbf_hours=1000.0, nodes=10, min_steps=10, max_steps=20, per_step=False
    )
    assert bounded.held == 20


def test_refuses_nonsense():
    with pytest.raises(goodput.GoodputError, match="positive MTBF"):
        auto(mtbf_hours=0.0)
    with pytest.raises(goodput.GoodputError, match="min <= max"):
        auto(min_steps=100, max_steps=10)
