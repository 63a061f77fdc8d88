"""A host lost, frozen or cut off under an elastic run on two real hosts (tests/hosts.py), in
restart and per-step modes: the run finishes, every id is trained exactly once per epoch, it
goes on at 2 workers on the host left, and it grows back to 4 when the host returns (its node
supervised). The recovery times are benchmarks/real_hosts.py's figures (RESULTS.md section 30);
here a bound only says it was a failure handled, never a hang. Scenario stage: each case takes
3-5 minutes on 2 cores; CI keeps tests/test_hosts_ray.py (two hosts train, no fault)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from hosts import skip_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import real_hosts  # noqa: E402

pytestmark = [
    pytest.mark.scenario,
    pytest.mark.ray,  # a Ray node on each of two hosts of its own (not the session's Ray)
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]


@pytest.mark.parametrize(
    "mode, fault",
    [
        ("restart", "partition"),
        ("restart", "frozen"),
        ("restart", "lost"),
        ("per-step", "partition"),
        ("per-step", "frozen"),
        ("per-step", "lost"),
    ],
)
def test_a_failed_host_is_a_failure_handled_and_taken_back_when_it_returns(tmp_path, mode, fault):
    args = argparse.Namespace(
        down_s=60.0, step_s=0.5, epochs=30, back_wait_s=180.0, ray_defaults=False, collective_timeout_s=None
    )
    row = real_hosts.case(tmp_path / f"{mode}-{fault}", fault, mode, args)
    print(row)
    assert row["exit"] == 0 and row["status"] == "finished", row
    sizes = row["sizes"].split("→")
    # On at the host left, then back to both (per-step places the two replicas one at a time).
    assert sizes[:2] == ["4", "2"] and sizes[-1] == "4" and "4" not in sizes[1:-1], row
    assert row["exactly_once"], row
    assert row["again_s"] is not None and row["again_s"] < 90, row  # a failure handled, not the 600 s timeout
    assert row["back_s"] is not None, row


# Per-step's pause is bounded below by torchft's lighthouse: a replica that leaves is out of the
# next quorum only once its heartbeat is 1 s old (HEARTBEAT_TIMEOUT_S), and torchft has no call
# that leaves a quorum sooner: 1.6 s measured for a SIGTERM, 0.6 s for a drain (RESULTS §33).
HEARTBEAT_FLOOR = "the survivors wait out the leaver's heartbeat (1 s): torchft cannot leave a quorum sooner"


@pytest.mark.parametrize(
    "mode, fault",
    [
        ("restart", "drain"),
        ("restart", "sigterm"),
        ("per-step", "drain"),
        pytest.param("per-step", "sigterm", marks=pytest.mark.xfail(reason=HEARTBEAT_FLOOR, strict=False)),
    ],
)
def test_a_preemption_notice_loses_no_step_and_the_run_goes_on_before_the_deadline(tmp_path, mode, fault):
    """The second host drained (reason PREEMPTION, 30 s deadline) or one of its workers sent
    SIGTERM, then the host killed at the deadline, on a head with Ray's default health checks:
    restart mode takes no step twice and trains on the first host within 15 s of the notice;
    per-step's survivors pause at most two usual steps (the pace, 0.5 s)."""
    args = argparse.Namespace(
        down_s=20.0, step_s=0.5, epochs=30, back_wait_s=120.0, ray_defaults=True, collective_timeout_s=None,
        notice_s=30.0,
    )  # fmt: skip
    row = real_hosts.case(tmp_path / f"{mode}-{fault}", fault, mode, args)
    print(row)
    assert row["exit"] == 0 and row["status"] == "finished" and row["exactly_once"], row
    assert row["sizes"].split("→")[:2] == ["4", "2"] and row["back_s"] is not None and row["back_s"] <= 60, row
    if mode == "restart":
        assert row["steps_again"] == 0 and row["again_s"] <= 15, row
    else:
        assert row["pause_s"] <= 2 * args.step_s, row


def test_a_slow_host_is_named_and_with_evict_stragglers_the_run_goes_on_without_it(tmp_path):
    """The second host's training workers stopped 3/4 of every 0.2 s: the straggler event names
    that host, the run resizes without it and never takes it back, and every id is trained once."""
    args = argparse.Namespace(
        down_s=120.0, step_s=0.1, epochs=20, back_wait_s=60.0, ray_defaults=False, collective_timeout_s=None,
        evict_stragglers=True,
    )  # fmt: skip
    row = real_hosts.case(tmp_path / "restart-slow", "slow", "restart", args)
    print(row)
    assert row["exit"] == 0 and row["status"] == "finished", row
    assert row["straggler"] and "10.77.0.2" in row["straggler"], row  # the second host (tests/hosts.py)
    assert row.get("evicted_host") == "10.77.0.2" and row["evicted_s"] is not None, row
    sizes = row["sizes"].split("→")
    assert sizes[:2] == ["4", "2"] and "4" not in sizes[1:], row  # not taken back
    assert row["exactly_once"], row
