"""A run's goodput accounted from its records (`raytrain.rules.accounting`): kept steps, start,
checkpoint stalls, recovery and steps redone, across resumes (pure: synthetic records)."""

from __future__ import annotations

import pytest

from raytrain.rules.accounting import account, measured_costs, shares
from raytrain.rundir.records import Event, Goodput, Kind, MetricsRow, Progress, Summary

STARTED = 1000.0


def progress(step=40, steady_steps=40, steady_time_s=4.0, **extra) -> Progress:
    values = {"checkpoint_wait_s": 0.5, "checkpoints": 2, "steady_time_s": steady_time_s, **extra}
    return Progress.from_json({"step": step, "steady_steps": steady_steps, **values})


def row(step: int, at: float) -> MetricsRow:
    return MetricsRow(epoch=0, step=step, time_s=at)


def restart_run():
    events = [Event(Kind.PLAN, "plan", time=1010.0), Event(Kind.RESTORE, "restored", time=1040.0, extra={"step": 20})]
    # a row every 10 steps at 0.1 s a step; the failure after step 30; the checkpoint at step 20
    rows = [row(10, 1012.0), row(20, 1013.0), row(20, 1013.5), row(30, 1014.5), row(30, 1042.0), row(40, 1043.0)]
    return events, rows


def test_a_restart_split_into_where_the_time_went():
    events, rows = restart_run()
    g = account(wall_s=50.0, started=STARTED, events=events, rows=rows, progress=progress())
    assert g.step_s == pytest.approx(0.1)
    assert g.kept_steps_s == pytest.approx(4.0)  # 40 kept steps at 0.1 s
    # start: 10 s to the plan, then the first window took 2 s for 10 steps of 0.1 s
    assert g.start_s == pytest.approx(11.0)
    assert g.failures == 1
    assert g.redone_s == pytest.approx(1.0)  # steps 21..30 again
    # from the last record (step 30 at 1014.5) to the restore (1040), then 1 s more than the steps of the window
    assert g.recovery_s == pytest.approx(26.5)
    assert g.checkpoint_stall_s == 0.5
    assert g.validation_s is None  # not recorded: part of other
    assert g.other_s == pytest.approx(50 - 4 - 11 - 1 - 26.5 - 0.5)
    assert g.goodput == pytest.approx(4.0 / 50)
    assert sum(seconds or 0 for _, seconds, _ in shares(g)) == pytest.approx(50.0)


def test_per_step_quorum_loss_redoes_one_step():
    events = [
        Event(Kind.PLAN, "plan", time=1010.0),
        Event(Kind.QUORUM, "3 → 2", time=1020.0, extra={"step": 25, "world_size": 2, "previous_world_size": 3}),
        Event(Kind.QUORUM, "2 → 3", time=1030.0, extra={"step": 30, "world_size": 3, "previous_world_size": 2}),
    ]
    rows = [row(10, 1011.0), row(20, 1013.0), row(40, 1035.0)]
    g = account(wall_s=40.0, started=STARTED, events=events, rows=rows, progress=progress())
    assert g.failures == 1  # a rejoin is no failure
    assert g.redone_s == pytest.approx(0.1)
    # 7 s from the last row to the quorum, less the 5 steps taken meanwhile and the one taken again
    assert g.recovery_s == pytest.approx(7.0 - 0.5 - 0.1)


def test_validation_when_the_position_records_it():
    events, rows = restart_run()
    g = account(wall_s=50.0, started=STARTED, events=events, rows=rows, progress=progress(validation_s=3.0))
    assert g.validation_s == 3.0
    assert g.other_s == pytest.approx(50 - 4 - 11 - 1 - 26.5 - 0.5 - 3.0)


def test_across_resumes_the_earlier_invocations_add_up():
    events, rows = restart_run()
    earlier = Goodput(goodput=0.5, start_s=20.0, recovery_s=5.0, redone_s=2.0, failures=2).to_json()
    g = account(wall_s=150.0, started=STARTED, events=events, rows=rows, progress=progress(), earlier=earlier)
    assert (g.start_s, g.recovery_s, g.redone_s, g.failures) == pytest.approx((31.0, 31.5, 3.0, 3))
    assert g.wall_s == 150.0


def test_records_of_earlier_invocations_are_left_out():
    events, rows = restart_run()
    old = [Event(Kind.RESTORE, "old", time=900.0, extra={"step": 5})]
    g = account(wall_s=50.0, started=STARTED, events=old + events, rows=[row(5, 950.0), *rows], progress=progress())
    assert g.failures == 1 and g.start_s == pytest.approx(11.0)


def test_a_fresh_start_again_redoes_everything_before_it():
    events = [Event(Kind.PLAN, "plan", time=1010.0), Event(Kind.PLAN, "again", time=1030.0)]
    rows = [row(10, 1012.0), row(10, 1032.0)]
    g = account(wall_s=40.0, started=STARTED, events=events, rows=rows, progress=progress(step=10))
    assert g.failures == 1 and g.redone_s == pytest.approx(1.0)


def test_none_without_a_steady_step_time():
    assert account(wall_s=5.0, started=STARTED, events=[], rows=[], progress=None) is None
    assert account(wall_s=5.0, started=STARTED, events=[], rows=[], progress=progress(steady_steps=0)) is None


def test_summary_carries_it_as_strict_json():
    g = Goodput(goodput=0.9, wall_s=10.0)
    summary = Summary(status="finished", goodput=g.to_json())
    assert Summary.from_json(summary.to_json()).goodput["goodput"] == 0.9
    assert "goodput" not in Summary(status="finished").to_json()


def test_measured_costs_for_the_planner():
    g = Goodput(goodput=0.9, step_s=0.2, recovery_s=30.0, failures=2).to_json()
    assert measured_costs(g, 1.5) == {"step_s": 0.2, "stall_s": 1.5, "recovery_s": 15.0}
    assert measured_costs(None, None) == {}


def test_the_rows_a_restart_dropped_are_named_by_its_event():
    # metrics.jsonl lost the rows past the checkpoint (step 20); the restore names step 30 at 1014.5
    events = [
        Event(Kind.PLAN, "plan", time=1010.0),
        Event(Kind.RESTORE, "restored", time=1040.0, extra={"step": 20, "last_step": 30, "last_step_time": 1014.5}),
    ]
    rows = [row(10, 1012.0), row(20, 1013.0), row(30, 1042.0), row(40, 1043.0)]
    g = account(wall_s=50.0, started=STARTED, events=events, rows=rows, progress=progress())
    assert g.redone_s == pytest.approx(1.0)
    assert g.recovery_s == pytest.approx(26.5)


def test_the_last_line_names_what_took_a_short_runs_wall_time():
    from raytrain.rules.accounting import goodput_phrase

    short = {"goodput": 0.07, "wall_s": 29.2, "start_s": 24.1, "other_s": 2.0, "recovery_s": 0.0}
    assert goodput_phrase(short, 92) == ", goodput 7%: the start took 24 s of 29 s"
    long = {"goodput": 0.91, "wall_s": 3600.0, "start_s": 25.0}
    assert goodput_phrase(long, 9000) == ", goodput 91%"
    failing = {"goodput": 0.3, "wall_s": 100.0, "start_s": 10.0, "recovery_s": 55.0}
    assert goodput_phrase(failing, 50) == ", goodput 30%: recovery took 55 s of 100 s"
    assert goodput_phrase(None, 3) == ", goodput not measured (3 steps: too few for a steady step time)"
    assert goodput_phrase({"goodput": None}, 1) == ", goodput not measured (1 step: too few for a steady step time)"
