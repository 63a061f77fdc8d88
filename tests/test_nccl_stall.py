"""A collective that times out on NCCL: the watchdog ends the worker before it can name the
stalled rank, so the driver names it from the heartbeats; the error handling chosen per mode."""

from __future__ import annotations

import json
import time

import pytest
from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy

from raytrain.config import TrainConfig
from raytrain.driver.failfast import FailFastPolicy
from raytrain.driver.launch import nccl_env
from raytrain.errors import DataError
from raytrain.faults.restart import RestartMode, stall_reporter
from raytrain.instruments.agreement import ReplicaMismatch, ReplicaMismatchRecurred
from raytrain.rules.stall import stall_seen_by_heartbeats
from raytrain.rundir import RunDir
from raytrain.rundir.heartbeats import read_last_attempt
from raytrain.rundir.records import HEARTBEATS, Kind


def beat(rank, step, phase, since, attempt=1000.0, now=2000.0):
    return {"rank": rank, "step": step, "phase": phase, "phase_since": since, "attempt_start": attempt, "time": now}


def test_a_collective_that_waited_out_its_timeout_names_the_rank_behind_it():
    now = 2000.0
    records = {
        0: beat(0, 12, "all_reduce", now - 610),
        1: beat(1, 11, "data", now - 615),  # never reached step 12's collective
        2: beat(2, 12, "all_reduce", now - 609),
    }
    message = stall_seen_by_heartbeats(records, now, 600.0)
    assert message.startswith("A collective waited out --collective-timeout-s 600 and a worker was ended")
    assert "stalled rank(s): 1" in message and "rank 1 (STALLED): step 11, in data" in message


def test_a_worker_killed_seconds_after_the_others_waited_is_no_stall():
    now = 2000.0
    records = {0: beat(0, 12, "all_reduce", now - 5), 1: beat(1, 12, "forward", now - 4)}
    assert stall_seen_by_heartbeats(records, now, 600.0) is None
    assert stall_seen_by_heartbeats({}, now, 600.0) is None


def test_nccl_error_handling_per_mode_and_a_users_value_wins(monkeypatch):
    from raytrain.config import TrainConfig
    from raytrain.faults import mode_of

    restart, per_step = (mode_of(TrainConfig(fault_tolerance=m, max_failures=1)) for m in ("restart", "per-step"))
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert nccl_env(restart) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}  # ends without ncclCommAbort; Ray restarts it
    assert nccl_env(per_step) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"
    }  # the survivor lives on, torchft re-forms the quorum
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert nccl_env(per_step) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def write_beats(directory, records):
    directory.mkdir(parents=True, exist_ok=True)
    for rank, record in records.items():
        (directory / f"rank{rank}.json").write_text(json.dumps(record))


def test_the_driver_reads_only_the_last_attempts_heartbeats(tmp_path):
    now = time.time()
    write_beats(
        tmp_path,
        {0: beat(0, 5, "all_reduce", now, attempt=now), 3: beat(3, 90, "forward", now, attempt=now - 3600)},
    )
    (tmp_path / "rank9.json").write_text("{torn")
    assert sorted(read_last_attempt(tmp_path)) == [0]


class Inner(FailurePolicy):
    def __init__(self):
        super().__init__(FailureConfig(max_failures=3))

    def make_decision(self, training_failed_error):
        return FailureDecision.RETRY


@pytest.mark.parametrize(
    "error, told",
    [
        (RuntimeError("worker died"), True),
        (ReplicaMismatch("replicas disagree at step 15"), True),  # the first time: retried
        (DataError("bad row 7"), False),
        (ReplicaMismatchRecurred("the same replica mismatch recurred at step 15"), False),  # deterministic
    ],
)
def test_the_policy_tells_of_worker_failures_but_not_of_the_users_errors(error, told):
    seen = []
    policy = FailFastPolicy(Inner(), RestartMode(TrainConfig()), seen.append)  # it retries all, as --max-failures -1
    decision = policy.make_decision(error)
    assert decision == (FailureDecision.RETRY if told else FailureDecision.RAISE)
    assert seen == ([error] if told else [])


def test_the_stall_reporter_writes_an_event_the_console_prints(tmp_path):
    now = time.time()
    write_beats(
        tmp_path / HEARTBEATS,
        {
            0: beat(0, 7, "all_reduce", now - 30, attempt=now - 60, now=now),
            1: beat(1, 6, "data", now - 31, attempt=now - 60, now=now),
        },
    )
    report = stall_reporter(tmp_path, collective_timeout_s=20.0)
    report(RuntimeError("ActorDiedError: the worker process exited (SIGABRT)"))
    report(RuntimeError("A collective timed out on rank 0 ...; stalled rank(s): 1"))  # said by the worker: once
    events = [e for e in RunDir(tmp_path).events() if e.kind == Kind.STALL]
    assert len(events) == 1 and "stalled rank(s): 1" in events[0].message
