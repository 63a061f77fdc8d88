"""The run's summary.json, from the files rank 0 leaves; the run lock and the heartbeats, which
tell hosts apart by `host_id`, never by hostname alone (pure tier: no Ray)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from design import METRICS_KEYS
from hosts import skip_reason

from raytrain.driver.summary import write_summary
from raytrain.rundir.files import RunLock, RunLocked
from raytrain.rundir.heartbeats import Heartbeat
from raytrain.rundir.host import host_id, identity

REPO = Path(__file__).resolve().parents[1]


def test_summary_carries_the_steady_step_count(tmp_path, make_config):
    progress = {
        "epoch": 2,
        "step": 90,
        "samples_seen": 2876,
        "steady_steps": 84,
        "steady_samples": 2688,
        "steady_samples_per_s": 2500.0,
    }
    (tmp_path / "progress.json").write_text(json.dumps(progress))
    summary = write_summary(tmp_path, make_config(), None, None, started=0.0)
    assert (summary.steady_steps, summary.steady_samples_per_s) == (84, 2500.0)
    assert json.loads((tmp_path / "summary.json").read_text())["steady_steps"] == 84


def test_summary_of_a_run_without_progress_has_no_steady_figures(tmp_path, make_config):
    summary = write_summary(tmp_path, make_config(), None, RuntimeError("boom"), started=0.0)
    assert summary.steady_steps is None and summary.status == "failed"


def test_under_compile_the_summary_and_the_report_say_the_graphs_and_an_eager_rank(tmp_path, make_config):
    from raytrain.observe.report import _compiled

    progress = {"epoch": 1, "step": 9, "compile_graphs": [2, 0], "compile_s": [14.2, 0.0]}
    (tmp_path / "progress.json").write_text(json.dumps(progress))
    cfg = make_config(compile=True)
    summary = write_summary(tmp_path, cfg, None, None, started=0.0)
    record = json.loads((tmp_path / "summary.json").read_text())["compile"]
    assert record == {"compiled": False, "graphs": [2, 0], "seconds": [14.2, 0.0]}
    assert _compiled(summary.compile) == (
        "Compile: **not compiled** on rank 1, which ran eager (graphs built by rank 2, 0, in 14.2, 0.0 s)."
    )
    progress["compile_graphs"] = [2, 1]
    (tmp_path / "progress.json").write_text(json.dumps(progress))
    assert write_summary(tmp_path, cfg, None, None, started=0.0).compile["compiled"] is True
    (tmp_path / "progress.json").unlink()  # no sync counted them: never reported compiled
    assert write_summary(tmp_path, cfg, None, None, started=0.0).compile["compiled"] is False
    plain = write_summary(tmp_path, make_config(), None, None, started=0.0)
    assert plain.compile is None and "compile" not in json.loads((tmp_path / "summary.json").read_text())


def test_records_round_trip_with_the_keys_design_fixes(tmp_path):
    from raytrain.rundir import Event, Kind, MetricsRow, RunDir, Summary

    run = RunDir(tmp_path)
    assert run.summary() is None and run.update_summary(status="stopped") is None and run.metrics() == []
    step = MetricsRow(
        epoch=1,
        step=3,
        samples_seen=96,
        world_size=2,
        global_batch_size=32,
        lr=1e-3,
        loss=0.5,
        samples_per_s=10.0,
        time_s=1.0,
    )
    end = MetricsRow(
        epoch=1, step=4, loss=float("nan"), epoch_end=True, extra={"val_loss": 0.4, "val_accuracy": 0.9, "own": 1}
    )
    run.append_metrics(step)
    run.append_metrics(end)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(lines[0]) == METRICS_KEYS
    assert (
        lines[1]["epoch_end"] is True and lines[1]["loss"] is None and lines[1]["own"] == 1
    )  # strict JSON, extra kept
    assert [row.step for row in run.epoch_rows()] == [4] and run.epoch_rows()[0].validation == {
        "val_loss": 0.4,
        "val_accuracy": 0.9,
    }
    run.append_event(Event(Kind.RESIZE, "Resized 2 → 1", extra={"world_size": 1, "previous_world_size": 2, "step": 4}))
    run.append_event(Event(Kind.RESIZE, "Resized 1 → 2", extra={"world_size": 2, "previous_world_size": 1, "step": 8}))
    assert [e.recovers_a_failure for e in run.events()] == [True, False] and run.events()[0].step == 4
    run.write_summary(Summary(status="failed", error="boom"))
    assert json.loads((tmp_path / "summary.json").read_text())["error"] == "boom"
    changed = run.update_summary(status="stopped", error=None, stopped_by="ASHA")
    written = json.loads((tmp_path / "summary.json").read_text())
    assert changed.status == "stopped" and "error" not in written and written["stopped_by"] == "ASHA"


# -- what summary.json counts: failures apart from resumes, interruptions and skipped checkpoints -----


def attempt_events(*kinds_and_sizes, start: float = 100.0) -> list:
    """Events at times start, start+1, ...: (kind, world_size, previous_world_size) each."""
    from raytrain.rundir.records import Event

    events = []
    for index, (kind, size, previous) in enumerate(kinds_and_sizes):
        extra = {"world_size": size, **({"previous_world_size": previous} if previous else {})}
        events.append(Event(kind, f"{kind} {size}", time=start + index, extra=extra))
    return events


def test_a_resume_is_counted_as_a_resume_not_a_failure():
    from raytrain.rules.attempt import Tally, tally
    from raytrain.rundir.records import Kind

    fresh = attempt_events((Kind.PLAN, 2, None), (Kind.RESTORE, 2, None))  # a worker died once
    assert tally(fresh) == Tally(failures_recovered=1)
    resumed = attempt_events((Kind.RESTORE, 2, None))  # --resume continues from a checkpoint
    assert tally(resumed) == Tally(resumes=1)
    resized = attempt_events((Kind.RESIZE, 1, 2), (Kind.RESIZE, 2, 1))  # --resume at another size, then growth
    assert tally(resized) == Tally(resumes=1)
    lost = attempt_events((Kind.PLAN, 2, None), (Kind.QUORUM, 1, 2), (Kind.QUORUM, 2, 1))  # per-step
    assert tally(lost) == Tally(failures_recovered=1)
    # Before the first checkpoint a restart starts from scratch again: a failure, unless it grew.
    early = attempt_events((Kind.PLAN, 2, None), (Kind.PLAN, 2, None), (Kind.PLAN, 3, None))
    assert tally(early) == Tally(failures_recovered=1)


def test_an_interruption_and_what_follows_the_stop_request_are_not_failures():
    from raytrain.rules.attempt import Tally, tally
    from raytrain.rundir.records import Event, Kind

    events = attempt_events((Kind.PLAN, 2, None), (Kind.RESTORE, 2, None), (Kind.RESTORE, 2, None))
    assert tally(events, interrupted=True, stop_requested_at=101.5) == Tally(failures_recovered=1, interruptions=1)
    skipped = [
        Event(Kind.SKIPPED, "skipped unusable checkpoint(s): a", time=100, extra={"checkpoints": ["c30"]}),
        *attempt_events((Kind.RESTORE, 2, None), start=101),
        Event(Kind.SKIPPED, "skipped unusable checkpoint(s): a", time=102, extra={"checkpoints": ["c30"]}),
        *attempt_events((Kind.RESTORE, 2, None), start=103),
    ]
    assert tally(skipped) == Tally(failures_recovered=1, resumes=1, checkpoints_skipped=1)


def test_summary_json_keeps_designs_keys_and_adds_the_counts(tmp_path, make_config):
    from raytrain.rundir import RunDir
    from raytrain.rundir.records import Kind

    run = RunDir(tmp_path)
    for event in attempt_events((Kind.RESTORE, 2, None), start=10.0):
        run.append_event(event)
    write_summary(tmp_path, make_config(), None, None, started=10.5, interrupted=2)
    written = json.loads((tmp_path / "summary.json").read_text())
    design = {"status", "epochs", "steps", "samples_seen", "wall_time_s", "steady_samples_per_s", "world_sizes"}
    design |= {"failures_recovered", "final_metrics", "best_checkpoint", "model_path"}
    assert design <= set(written)
    counts = {key: written[key] for key in ("failures_recovered", "resumes", "interruptions", "checkpoints_skipped")}
    assert counts == {"failures_recovered": 0, "resumes": 1, "interruptions": 1, "checkpoints_skipped": 0}
    assert written["status"] == "interrupted"


def test_a_signal_after_the_last_epoch_leaves_the_run_finished(tmp_path, make_config):
    progress = {"epoch": 2, "step": 90, "samples_seen": 2876, "status": "finished", "time": 20.0}
    (tmp_path / "progress.json").write_text(json.dumps(progress))
    cfg = make_config(epochs=2)
    summary = write_summary(tmp_path, cfg, None, None, started=10.0, interrupted=2, stop_requested_at=30.0)
    assert (summary.status, summary.interruptions) == ("finished", 1)
    (tmp_path / "progress.json").write_text(json.dumps({**progress, "epoch": 1, "status": "interrupted"}))
    summary = write_summary(tmp_path, cfg, None, None, started=10.0, interrupted=2, stop_requested_at=30.0)
    assert summary.status == "interrupted"


# -- which host holds the lock ---------------------------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has ended (on this host)."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


def write_lock(run_dir: Path, **record) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".lock").write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "since": 0} | record))


def test_a_lock_of_another_host_with_this_hostname_is_refused_never_taken(tmp_path):
    # Hosts sharing a hostname (containers, cloned images, network namespaces): the holder's pid
    # is dead here, yet it may be alive there.
    write_lock(tmp_path, host_id="0123456789abcdef")
    with pytest.raises(RunLocked) as refused:
        RunLock(tmp_path).acquire()
    message = str(refused.value)
    assert f"on another host named {socket.gethostname()} (same hostname, different machine" in message
    assert f"leaves {tmp_path}/.lock: delete it" in message
    assert json.loads((tmp_path / ".lock").read_text())["host_id"] == "0123456789abcdef"  # untouched


def test_a_lock_of_this_host_whose_holder_is_dead_is_taken_over(tmp_path):
    write_lock(tmp_path, host_id=host_id())
    lock = RunLock(tmp_path)
    lock.acquire()
    record = json.loads((tmp_path / ".lock").read_text())
    assert (record["pid"], record["host"], record["host_id"]) == (os.getpid(), socket.gethostname(), host_id())
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_lock_of_an_older_raytrain_without_host_id_is_refused_never_taken(tmp_path):
    write_lock(tmp_path)  # what raytrain wrote before host_id: pid, hostname, since
    with pytest.raises(RunLocked, match=r"older raytrain.*cannot be checked from here.*/\.lock: delete it"):
        RunLock(tmp_path).acquire()
    assert "host_id" not in json.loads((tmp_path / ".lock").read_text())


def test_host_id_rests_on_boot_and_namespaces_not_on_the_hostname_alone():
    assert host_id() == host_id() and len(host_id()) == 16
    assert identity("vm", "boot-a", [1, 2]) != identity("vm", "boot-b", [1, 2])  # cloned images
    assert identity("vm", "boot-a", [1, 2]) != identity("vm", "boot-a", [3, 2])  # network namespaces
    assert identity("vm", None, [None, None]) != identity("other", None, [None, None])  # no /proc: the hostname


@pytest.mark.slow  # starts a Python in a network namespace of its own
@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_a_lock_left_in_another_network_namespace_is_refused_here(tmp_path):
    """Two hosts on one machine that share hostname, file system and boot id, as raytrain's test
    hosts do: a lock the other left behind, its pid dead here, is another host's."""
    netns = f"rtid{secrets.token_hex(3)}"
    leave_lock = (
        "import sys; from raytrain.rundir.files import RunLock; from raytrain.rundir.host import host_id; "
        "RunLock(sys.argv[1]).acquire(); print(host_id())"
    )
    subprocess.run(["ip", "netns", "add", netns], check=True, timeout=30)
    try:
        there = subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-c", leave_lock, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        subprocess.run(["ip", "netns", "del", netns], timeout=30)
    assert there.returncode == 0, there.stderr
    assert there.stdout.strip() != host_id()
    with pytest.raises(RunLocked, match="on another host named .*same hostname"):
        RunLock(tmp_path).acquire()


# -- heartbeats -------------------------------------------------------------------------------------


def test_a_heartbeat_names_its_host_by_host_id_and_its_node_when_given(tmp_path):
    Heartbeat(tmp_path, 0, enabled=False).write()
    Heartbeat(tmp_path, 1, enabled=False, node="10.77.0.2").write()
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first["host_id"] == second["host_id"] == host_id() and "node" not in first
    assert second["node"] == "10.77.0.2"
