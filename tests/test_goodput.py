"""The goodput model of `raytrain.rules.goodput`: Young's and Daly's intervals, the expected goodput
per fault-tolerance mode and where the rest of the wall time goes (pure: no Ray, no torch)."""

from __future__ import annotations

import math

import pytest

from raytrain.rules import goodput
from raytrain.rules.goodput import HOUR_S, Scenario


def test_llama3_default_mtbf():
    # 419 unexpected interruptions in 54 days on 2,048 nodes of 8 GPUs.
    assert goodput.LLAMA3_NODE_MTBF_H == pytest.approx(6334.6, abs=0.1)
    assert goodput.DEFAULT_NODE_MTBF_H == 6335


def test_young_interval():
    assert goodput.young_interval_s(10.0, 3600.0) == pytest.approx(math.sqrt(2 * 10 * 3600))
    assert goodput.young_interval_s(0.0, 3600.0) == 0.0


def test_daly_refines_young_and_saturates():
    stall, mtbf = 60.0, 3600.0
    young = goodput.young_interval_s(stall, mtbf)
    ratio = stall / (2 * mtbf)
    assert goodput.daly_interval_s(stall, mtbf) == pytest.approx(young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall)
    # A cheap save: Daly ≈ Young (the correction is second order).
    assert goodput.daly_interval_s(0.01, 1e6) == pytest.approx(goodput.young_interval_s(0.01, 1e6), rel=1e-3)
    # A save costlier than twice the MTBF: the interval is the MTBF.
    assert goodput.daly_interval_s(100.0, 40.0) == 40.0
    assert goodput.daly_interval_s(0.0, 40.0) == 0.0


def test_daly_interval_maximizes_the_exact_goodput():
    for stall, mtbf, recovery in ((5.0, 3600.0, 30.0), (60.0, 5400.0, 600.0), (300.0, 2000.0, 60.0)):
        best = goodput.daly_interval_s(stall, mtbf)
        top = goodput.restart_goodput(best, stall, mtbf, recovery)
        grid = [best * f for f in (0.5, 0.7, 0.85, 1.2, 1.5, 2.0)]
        assert all(goodput.restart_goodput(t, stall, mtbf, recovery) < top for t in grid)
        # ... and within a hair of the numerical optimum
        numeric = max(goodput.restart_goodput(best * k / 100, stall, mtbf, recovery) for k in range(20, 300))
        assert top == pytest.approx(numeric, abs=2e-3)


def test_restart_goodput_limits():
    # No failures: only the stalls cost.
    assert goodput.restart_goodput(90.0, 10.0, math.inf, 30.0) == pytest.approx(0.9)
    assert goodput.restart_goodput(90.0, 10.0, 1e12, 30.0) == pytest.approx(0.9, abs=1e-6)
    assert goodput.restart_goodput(0.0, 10.0, 3600.0, 30.0) == 0.0
    # First order: τ/(τ + C) · (1 − (R + (τ + C)/2)/M).
    tau, c, m, r = 600.0, 6.0, 36000.0, 60.0
    first_order = tau / (tau + c) * (1 - (r + (tau + c) / 2) / m)
    assert goodput.restart_goodput(tau, c, m, r) == pytest.approx(first_order, abs=2e-4)
    # Costlier recovery, lower goodput.
    assert goodput.restart_goodput(tau, c, m, 600.0) < goodput.restart_goodput(tau, c, m, r)


def test_nodes_from_workers():
    assert Scenario(workers=8).nodes == 1
    assert Scenario(workers=9).nodes == 2
    assert Scenario(workers=16_384).nodes == 2048
    assert Scenario(workers=4, gpus_per_node=1).nodes == 4


def scenario(**changes) -> Scenario:
    values = dict(workers=1024, node_mtbf_s=500 * HOUR_S, step_s=2.0, stall_s=20.0, replace_s=60.0)
    return Scenario(**{**values, **changes})


def test_prediction_shares_add_up():
    for mode in goodput.MODES:
        p = goodput.best(scenario(write_s=30.0), mode)
        assert p.goodput + p.stalls + p.recovery + p.redone == pytest.approx(1.0)
        assert min(p.goodput, p.stalls, p.recovery, p.redone) >= 0
        assert p.failures_per_day == pytest.approx(128 * 24 / 500)


def test_restart_interval_follows_the_job_mtbf_per_step_the_head_nodes():
    s = scenario()
    restart = goodput.best_interval_steps(s, "restart")
    per_step = goodput.best_interval_steps(s, "per-step")
    assert restart == round(goodput.daly_interval_s(20.0, 500 * HOUR_S / 128) / 2.0)
    # Under per-step only the head node's loss rolls back: its interval is the one-node interval
    # (the others' failures, ridden out, pause the job a little longer between rollbacks).
    assert goodput.restart_mtbf_s(s, "per-step") == pytest.approx(500 * HOUR_S, rel=1e-3)
    assert per_step == round(goodput.daly_interval_s(20.0, goodput.restart_mtbf_s(s, "per-step")) / 2.0)
    assert per_step > 10 * restart


def test_per_step_beats_restart_at_scale_and_not_by_much_on_one_node():
    big = scenario(workers=16_384)
    assert goodput.best(big, "per-step").goodput > goodput.best(big, "restart").goodput + 0.01
    one = scenario(workers=8)
    # On one node every failure is the head node's: both modes restart.
    assert goodput.best(one, "per-step").goodput == pytest.approx(goodput.best(one, "restart").goodput)


def test_goodput_falls_with_the_worker_count():
    values = [goodput.best(scenario(workers=n), "restart").goodput for n in (8, 64, 512, 4096, 16_384)]
    assert values == sorted(values, reverse=True)
    assert values[0] > 0.99 and values[-1] < values[0] - 0.02


def test_replica_groups_lose_a_larger_share_per_failure():
    s = scenario(group_size=64)
    assert goodput.best(s, "per-step-groups").recovery > goodput.best(s, "per-step").recovery


def test_async_write_lag_costs_work():
    assert goodput.best(scenario(write_s=120.0), "restart").goodput < goodput.best(scenario(), "restart").goodput


def test_interval_bounds():
    s = scenario()
    assert goodput.best_interval_steps(s, "restart", min_steps=10_000) == 10_000
    assert goodput.best_interval_steps(s, "restart", max_steps=5) == 5
    assert goodput.bound_steps(0.2, 1, None) == 1
    assert goodput.bound_steps(math.inf, 3, 40) == 40


def test_scenario_checks_name_each_input():
    bad = Scenario(workers=0, step_s=0.0, stall_s=-1.0, recovery_s={"restart": -5.0}, gpus_per_node=0)
    names = [name for name, _ in bad.check()]
    assert names == ["workers", "gpus_per_node", "step_s", "stall_s", "recovery_s.restart"]
    assert scenario().check() == []


# -- detection and preemptions ----------------------------------------------------------------


def test_detection_adds_to_each_rollback_and_not_to_a_ride_out():
    # One node, a 10,000 s MTBF, a save every 99 steps of 1 s: a segment of L = 100 s takes, by hand,
    # M·e^((R + D)/M)·(e^(L/M) − 1) = 10,000 · e^0.0052 · (e^0.01 − 1) = 101.02564 s of wall time.
    one = Scenario(workers=8, node_mtbf_s=1e4, step_s=1.0, stall_s=1.0, recovery_s={"restart": 37.0})
    p = goodput.predict_mode(Scenario(**{**one.__dict__, "detection_s": 15.0}), "restart", 99)
    assert p.goodput == pytest.approx(99 / 101.02564, abs=1e-6)
    assert p.recovery == pytest.approx(52.0 / 1e4)  # a rollback per 10,000 s, 37 + 15 s each
    # Per-step at 128 nodes: only the head node's rollbacks wait for the head; the others' failures
    # are found by the survivors' own peer wait, whatever the head's health checks cost.
    quick, slow = scenario(), scenario(detection_s=65.0)
    for mode, rollbacks_per_s in (("restart", 128 / (500 * HOUR_S)), ("per-step", 1 / (500 * HOUR_S))):
        added = goodput.predict_mode(slow, mode, 100).recovery - goodput.predict_mode(quick, mode, 100).recovery
        assert added == pytest.approx(65.0 * rollbacks_per_s, rel=1e-9)


def test_a_preemption_without_notice_is_a_failure():
    # A failure every 2 days a node and half a preemption a day: a node-day MTBF, no preemptions.
    preempted = scenario(node_mtbf_s=2 * 86400.0, preemptions_per_node_day=0.5, detection_s=15.0)
    failing = scenario(node_mtbf_s=86400.0, detection_s=15.0)
    for mode in goodput.MODES:
        got, want = goodput.best(preempted, mode), goodput.best(failing, mode)
        assert got.interval_steps == want.interval_steps
        assert (got.goodput, got.stalls, got.recovery, got.redone) == pytest.approx(
            (want.goodput, want.stalls, want.recovery, want.redone), rel=1e-12
        )
        assert got.failures_per_day == pytest.approx(want.failures_per_day / 2)  # failures only


def test_a_notice_that_covers_a_save_turns_a_rollback_into_a_save_and_a_restart():
    # 128 nodes, a tenth of a preemption a day each; a step 2 s, a save stalls 20 s: the notice must
    # cover 22 s. With 30 s, each preemption pauses the job 20 + 37 s and loses nothing (no detection).
    noticed = scenario(preemptions_per_node_day=0.1, preemption_notice_s=30.0, detection_s=15.0)
    assert goodput.notice_needed_s(noticed) == 22.0
    assert goodput.notice_needed_s(scenario(write_s=8.0)) == 30.0  # the node's shard durable too
    rollbacks, saves = 128 / (500 * HOUR_S), 128 * 0.1 / 86400  # the failures alone roll back
    assert goodput.events(noticed, "restart") == (pytest.approx(rollbacks), [(pytest.approx(saves), 20.0, 37.0, 0.0)])
    exposed = goodput.exposed_rate(rollbacks, [(saves, 20.0, 37.0, 0.0)])
    assert exposed == pytest.approx(rollbacks / (1 - saves * 57.0), rel=1e-3)  # 0.8 % of the time paused
    p = goodput.predict_mode(noticed, "restart", 300)
    want = goodput.restart_goodput(600.0, 20.0, 1 / exposed, 37.0 + 15.0) * rollbacks / exposed
    assert p.goodput == pytest.approx(want, rel=1e-12)
    assert p.stalls == pytest.approx(20.0 * p.goodput / 600.0 + saves * 20.0, rel=1e-12)
    assert goodput.restart_mtbf_s(noticed, "restart") == pytest.approx(1 / exposed)
    # 21 s is a second short of the save: the preemption rolls back like a failure, with detection.
    short = scenario(preemptions_per_node_day=0.1, preemption_notice_s=21.0, detection_s=15.0)
    none = scenario(preemptions_per_node_day=0.1, detection_s=15.0)
    assert goodput.best(short, "restart") == goodput.best(none, "restart")
    assert goodput.best(noticed, "restart").goodput > goodput.best(none, "restart").goodput + 0.005


def test_pauses_lengthen_the_time_a_rollback_can_strike():
    assert goodput.exposed_rate(0.001, []) == 0.001
    # By hand: with B = 1/2, B = e^(−(λ + μ − μB)·c) holds for (0.001 + 0.002/2)·c = ln 2, and the
    # rate is λ + μ(1 − B) = 0.002 (the pauses take 69 % of the wall time).
    assert goodput.exposed_rate(0.001, [(0.002, 0.0, math.log(2) / 0.002, 0.0)]) == pytest.approx(0.002, rel=1e-12)
    # Short pauses: the rate over the share of the time not paused (2 %), two kinds as one.
    assert goodput.exposed_rate(1e-5, [(1e-3, 5.0, 10.0, 0.0), (1e-3, 0.0, 0.0, 5.0)]) == pytest.approx(
        1e-5 / 0.98, rel=1e-4
    )


def test_per_step_with_notice_keeps_the_step_in_flight():
    # Per-step rides out another node's preemption either way; a notice that covers the step under
    # way (2 s) spares the step retaken, and only one that covers a save spares the head node's rollback.
    def per_step(notice_s: float) -> goodput.ModeGoodput:
        return goodput.predict_mode(
            scenario(preemptions_per_node_day=1.0, preemption_notice_s=notice_s), "per-step", 500
        )

    none, step_only, save = per_step(0.0), per_step(2.0), per_step(22.0)
    assert none.goodput < step_only.goodput < save.goodput
    spared_steps = 127 * 1.0 / 86400 * 2.0  # the others' preemptions, a step each
    assert none.redone - step_only.redone == pytest.approx(spared_steps, rel=0.02)
    assert none.recovery == pytest.approx(step_only.recovery, rel=1e-12)  # the same wait either way


def test_the_notice_saves_more_the_more_nodes():
    def saved(workers: int) -> float:
        with_notice = scenario(workers=workers, preemptions_per_node_day=0.2, preemption_notice_s=60.0)
        without = scenario(workers=workers, preemptions_per_node_day=0.2)
        return goodput.best(with_notice, "restart").goodput - goodput.best(without, "restart").goodput

    gains = [saved(n) for n in (8, 512, 16_384)]
    assert gains == sorted(gains) and gains[0] > 0 and gains[-1] > 0.02


def test_negative_detection_and_preemption_inputs_are_named():
    bad = scenario(detection_s=-1.0, preemptions_per_node_day=-0.5, preemption_notice_s=math.inf)
    assert [name for name, _ in bad.check()] == ["detection_s", "preemptions_per_node_day", "preemption_notice_s"]
