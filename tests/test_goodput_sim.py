"""`raytrain.rules.goodput`'s expected goodput against a seeded event simulation of 20,000 hours of
failures (tests/goodput_sim.py): the formula must be within 1 percentage point of the simulated
goodput, and Daly's interval must beat half and twice itself in the simulation too."""

from __future__ import annotations

import pytest
from goodput_sim import simulate

from raytrain.rules import goodput
from raytrain.rules.goodput import HOUR_S, Scenario

TOLERANCE = 0.01  # goodput, absolute: 1 percentage point
HOURS = 20_000.0

# Harsh enough that goodput is far from 1 (a job MTBF of 1.6 h; costly saves and restarts),
# so that the formula is tested where it matters.
HARSH = Scenario(
    workers=512,
    node_mtbf_s=100 * HOUR_S,
    step_s=2.0,
    stall_s=60.0,
    recovery_s={"restart": 600.0, "per-step": 5.0, "per-step-groups": 30.0},
)
ASYNC = Scenario(**{**HARSH.__dict__, "write_s": 120.0})
CASES = {
    "restart": (HARSH, "restart"),
    "restart, async write": (ASYNC, "restart"),
    "per-step": (ASYNC, "per-step"),
    "per-step-groups": (
        Scenario(**{**ASYNC.__dict__, "group_size": 32, "replace_s": 300.0}),
        "per-step-groups",
    ),
    "llama3 scale": (
        Scenario(workers=16_384, step_s=5.0, stall_s=30.0, write_s=60.0, recovery_s={"restart": 600.0}),
        "restart",
    ),
    "one node": (Scenario(workers=8, node_mtbf_s=5 * HOUR_S, step_s=0.5, stall_s=20.0), "per-step"),
    # A preemption every 2 node-days on top (with notice, a quarter of the wall time goes to the
    # saves and restarts they cost: the pauses lengthen the time a rollback can strike), and a
    # minute to find a silent node: a notice of 182 s covers the step, the save's stall and its
    # write; one of 10 s only the step.
    **{
        f"{mode}, preempted, {notice_s:g} s notice": (
            Scenario(
                **{
                    **ASYNC.__dict__,
                    "detection_s": 60.0,
                    "preemptions_per_node_day": 0.5,
                    "preemption_notice_s": notice_s,
                }
            ),
            mode,
        )
        for mode, notice_s in (("restart", 0.0), ("restart", 182.0), ("per-step", 10.0), ("per-step", 182.0))
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_formula_matches_the_simulation(name):
    scenario, mode = CASES[name]
    best = goodput.best_interval_steps(scenario, mode)
    for steps in (best // 2, best, 2 * best):
        predicted = goodput.predict_mode(scenario, mode, steps)
        simulated = simulate(scenario, mode, steps, HOURS, seed=7)
        assert simulated.restarts + simulated.ridden > 100, "too few failures to compare"
        assert predicted.goodput == pytest.approx(simulated.goodput, abs=TOLERANCE), (steps, predicted, simulated)
        assert predicted.stalls == pytest.approx(simulated.stalled_s / simulated.wall_s, abs=TOLERANCE / 4)


@pytest.mark.parametrize("name", ["restart", "restart, async write", "llama3 scale"])
def test_daly_interval_is_the_best_of_half_and_twice_in_the_simulation(name):
    scenario, mode = CASES[name]
    best = goodput.best_interval_steps(scenario, mode)
    runs = {steps: simulate(scenario, mode, steps, HOURS, seed=11).goodput for steps in (best // 2, best, 2 * best)}
    assert runs[best] > runs[best // 2] and runs[best] > runs[2 * best], runs


def test_the_simulation_is_seeded():
    scenario, mode = CASES["restart"]
    one, two = (simulate(scenario, mode, 300, 2000.0, seed=3) for _ in range(2))
    assert one == two
    assert simulate(scenario, mode, 300, 2000.0, seed=4) != one


def test_without_failures_the_simulation_loses_only_the_stalls():
    scenario = Scenario(workers=8, node_mtbf_s=1e15, step_s=1.0, stall_s=10.0)
    run = simulate(scenario, "restart", 90, 100.0, seed=0)
    assert run.restarts == 0
    assert run.goodput == pytest.approx(0.9, abs=0.001)
