"""The run directory outlives its driver: a lock file raytrain did not write is named with the fix
(never a traceback, never taken over, nothing killed); workers whose driver is gone, or whose run
another driver took over, stop writing; a resume's checkpoint pruned before it was read is chosen
again. Pure tier (real files, real processes, no Ray), and one scenario with a real run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from raytrain import Pipeline
from raytrain.cli import main
from raytrain.errors import CheckpointError, StorageError
from raytrain.instruments.window import LossWindow, sync
from raytrain.rules import resume
from raytrain.rules.position import Position
from raytrain.rundir import RunDir, Store, claimed, files
from raytrain.rundir import checkpoints as ckpt
from raytrain.rundir.buffered import BufferedLogs
from raytrain.rundir.faults import DEFAULT_RETRY_S
from raytrain.rundir.files import (
    LOCK_FILE,
    DriverGone,
    DriverWatch,
    LockUnreadable,
    RunLock,
    RunLocked,
    beat_name,
    parse_lock,
    pid_alive,
    read_beat,
    self_record,
)
from raytrain.rundir.host import host_id
from raytrain.rundir.publish import Publish
from raytrain.rundir.records import EVENTS, LIVE, Kind
from raytrain.rundir.storage import LocalStore
from raytrain.rundir.writer import RunWriter
from raytrain.worker.state import TrainingState

REPO = Path(__file__).resolve().parents[1]


def ended_pid() -> int:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


# -- a lock file that is not raytrain's record ---------------------------------------------------

MALFORMED = {  # what the lock holds -> what the refusal says is wrong
    "a list": ("[1, 2]", "it holds a list, not an object"),
    "a string": ('"held"', "it holds a string, not an object"),
    "no JSON": ("pid=12", "it is not JSON"),
    "since in words": ({"since": "yesterday"}, 'its since "yesterday" is not a time'),
    "since past year 9999": ({"since": 1e300}, "its since 1e+300 is not a time"),
    "a pid too large": ({"pid": 2**70}, f"its pid {2**70} is not a process id"),
    "a pid not a number": ({"pid": "12"}, 'its pid "12" is not a process id'),
    "an empty record": ({}, "it names no process (no pid)"),
    "a host not a string": ({"host": ["a"]}, 'its host ["a"] is not a string'),
    "nested deep": ("[" * 200_000, "it holds more than 1024 bytes, and a lock's record is smaller"),
}


def write_malformed(run_dir: Path, content) -> str:
    if isinstance(content, dict):  # a record of this host whose fields are replaced
        record = {"pid": ended_pid(), "host": "here", "host_id": host_id(), "since": 0.0}
        record = {} if not content else record | content
        content = json.dumps(record)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(content)
    return content


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_a_lock_that_is_not_a_locks_record_is_named_with_the_fix_and_never_taken_over(tmp_path, case):
    content, problem = MALFORMED[case]
    text = write_malformed(tmp_path / "run", content)
    with pytest.raises(LockUnreadable) as refused:
        RunLock(tmp_path / "run").acquire()
    message = str(refused.value)
    assert f"{tmp_path}/run/.lock: {problem}" in message
    assert "no `raytrain train ... --name run`" in message and f"then delete {tmp_path}/run/.lock" in message
    assert "`pgrep -af -- '--name[= ]run'`" in message  # --name run and --name=run alike
    assert (tmp_path / "run" / LOCK_FILE).read_text() == text  # never taken over


@pytest.mark.parametrize("case", ["a list", "since past year 9999", "a pid too large"])
def test_the_command_line_refuses_an_unreadable_lock_with_exit_2_and_no_traceback(tmp_path, capsys, case):
    write_malformed(tmp_path / "run", MALFORMED[case][0])
    status = main(["train", "digits", "--storage", str(tmp_path), "--name", "run", "--workers", "1"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and MALFORMED[case][1] in err and "delete" in err


def test_a_lock_nested_too_deep_or_a_directory_is_unreadable_not_a_traceback(tmp_path):
    with pytest.raises(ValueError, match="it is not JSON .nested too deep to read."):
        parse_lock("[" * 200_000)
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(LockUnreadable, match=f"{tmp_path}/.lock: it is a directory, not a lock's file.*then delete"):
        RunLock(tmp_path).acquire()
    # A worker's look: a lock it cannot read (half-written, replaced by hand) is no evidence by
    # itself; its driver's beat decides (a healthy run's workers were once stopped by a garbled read).
    watch = DriverWatch(Store.of(tmp_path), "driver-a")
    assert watch.why_gone() is None
    watch.beat_seen -= watch.silent_limit_s + 1
    assert "has not refreshed its beat" in watch.why_gone()


def test_a_lock_that_cannot_be_read_is_a_storage_error_never_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).symlink_to(LOCK_FILE)  # a link to itself: every read fails (ELOOP)
    with pytest.raises(StorageError, match=f"cannot read the run's lock {tmp_path}/.lock: .*ELOOP") as refused:
        RunLock(tmp_path, owner="driver-b").acquire()
    assert not isinstance(refused.value, (RunLocked, LockUnreadable))
    assert os.readlink(tmp_path / LOCK_FILE) == LOCK_FILE  # never deleted, never taken


def test_a_lock_naming_a_live_process_with_a_bad_time_leaves_the_process_alone(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_malformed(tmp_path, {"pid": child.pid, "since": "yesterday"})
        with pytest.raises(LockUnreadable):
            RunLock(tmp_path).acquire()
        assert child.poll() is None and pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()


def test_parse_lock_takes_what_raytrain_writes_old_and_new():
    assert parse_lock(json.dumps({"pid": 7, "host": "a", "since": 0}))["pid"] == 7  # an older raytrain's
    record = self_record() | {"since": time.time(), "owner": "abc"}
    assert parse_lock(json.dumps(record)) == record
    with pytest.raises(ValueError, match="its since true is not a time"):
        parse_lock(json.dumps(record | {"since": True}))
    with pytest.raises(ValueError, match=r'its owner "../x" is not a driver.s id'):
        parse_lock(json.dumps(record | {"owner": "../x"}))  # it names the beat file: never a path


def test_a_zombie_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not pid_alive(child.pid)  # ended, not yet reaped: a killed driver whose parent has not waited
    child.wait()


# -- the driver's lock: its owner, its beat, a takeover ---------------------------------------------


def test_the_lock_names_its_owner_and_its_beat_moves_in_a_file_of_its_own(tmp_path):
    lock = RunLock(tmp_path, owner="driver-a", beat_s=0.05)
    lock.acquire()
    try:
        text = (tmp_path / LOCK_FILE).read_text()
        assert lock.holder()["owner"] == "driver-a" and "beat" not in lock.holder()
        deadline = time.monotonic() + 10
        while read_beat(Store.of(tmp_path), "driver-a") is None:
            assert time.monotonic() < deadline, "the beat never came"
            time.sleep(0.02)
        first = read_beat(Store.of(tmp_path), "driver-a")
        while read_beat(Store.of(tmp_path), "driver-a") == first:
            assert time.monotonic() < deadline, "the beat did not move"
            time.sleep(0.02)
        assert (tmp_path / LOCK_FILE).read_text() == text  # the lock itself is never rewritten
    finally:
        lock.release()
    assert not (tmp_path / LOCK_FILE).exists() and not (tmp_path / beat_name("driver-a")).exists()


def test_a_lock_taken_from_a_driver_is_never_written_or_deleted_by_it(tmp_path):
    lock = RunLock(tmp_path, owner="driver-a", beat_s=0.05)
    lock.acquire()
    (tmp_path / LOCK_FILE).unlink()  # removed by hand, then taken by another driver
    taker = RunLock(tmp_path, owner="driver-b", beat_s=0.05)
    taker.acquire()
    try:
        other = (tmp_path / LOCK_FILE).read_text()
        time.sleep(0.3)  # the old driver beats on, into its own file only
        assert (tmp_path / LOCK_FILE).read_text() == other
        lock.release()
        assert (tmp_path / LOCK_FILE).read_text() == other  # not deleted either: it is not this driver's
        assert not (tmp_path / beat_name("driver-a")).exists() and (tmp_path / beat_name("driver-b")).exists()
    finally:
        taker.release()


def test_beats_that_keep_failing_are_said_once(tmp_path, monkeypatch):
    real = LocalStore.write_bytes

    def no_beat(store, name, data):
        if name.startswith(f"{LOCK_FILE}.beat-"):
            raise OSError(5, "the store does not answer")
        real(store, name, data)

    monkeypatch.setattr(LocalStore, "write_bytes", no_beat)
    lines = []
    lock = RunLock(tmp_path, owner="driver-a", beat_s=0.05, echo=lines.append)
    lock.acquire()
    time.sleep(0.6)  # 3 periods are 0.15 s
    lock.release()
    assert len(lines) == 1, lines
    assert f"could not refresh its beat {tmp_path}/.lock.beat-driver-a for " in lines[0]
    assert "the store does not answer" in lines[0] and "stop once it has not moved for 240 s" in lines[0]


def test_a_takeover_from_an_ended_driver_says_its_workers_are_fenced(tmp_path):
    run_dir = tmp_path / "run"
    write_malformed(run_dir, {"pid": ended_pid(), "host": "node-1", "owner": "driver-a", "since": 1.0e9})
    lines = []
    with claimed(Store.of(run_dir), owner="driver-b", echo=lines.append):
        assert json.loads((run_dir / LOCK_FILE).read_text())["owner"] == "driver-b"
    assert len(lines) == 1
    assert "was held by process" in lines[0] and "on node-1 since 2001-09-" in lines[0]
    assert "which has ended; its workers, if any still run, are fenced" in lines[0]


def test_a_takeover_of_an_empty_stale_lock_says_so(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")
    os.utime(tmp_path / LOCK_FILE, (time.time() - 30, time.time() - 30))
    lines = []
    with claimed(Store.of(tmp_path), owner="driver-b", echo=lines.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["owner"] == "driver-b"
    assert len(lines) == 1 and "had an empty lock, 30 s old, left by a driver that died writing it" in lines[0]
    assert "are fenced" in lines[0]


def test_a_live_holder_is_still_refused_with_its_last_beat(tmp_path):
    first = RunLock(tmp_path, owner="driver-a")
    first.acquire()
    try:
        with pytest.raises(RunLocked, match=rf"in use by process {os.getpid()} .*\(no beat yet; it beats every 10 s\)"):
            RunLock(tmp_path, owner="driver-b").acquire()
        (tmp_path / beat_name("driver-a")).write_text(json.dumps(time.time() - 7))
        with pytest.raises(RunLocked, match=r"\(its last beat 7 s ago; it beats every 10 s\); wait for it"):
            RunLock(tmp_path, owner="driver-b").acquire()
    finally:
        first.release()


# -- is my driver alive? -------------------------------------------------------------------------------


def holder(**fields):
    return {"pid": 41, "host": "head", "host_id": "h1", "since": 1.0, "owner": "driver-a", **fields}


def gone(record, owner="driver-a", same_host=True, pid_alive=True, silent_s=0.0, limit_s=240.0):
    return resume.driver_gone(
        record, owner, same_host=same_host, pid_alive=pid_alive, silent_s=silent_s, limit_s=limit_s
    )


def test_a_driver_on_this_host_holds_the_run_while_its_process_lives():
    assert gone(holder()) is None
    assert gone(holder(), pid_alive=False) == "its driver, process 41 on this host, has ended"


def test_a_driver_on_another_host_holds_the_run_while_its_beat_moves():
    assert gone(holder(), same_host=False, pid_alive=None, silent_s=240) is None
    why = gone(holder(), same_host=False, pid_alive=None, silent_s=241)
    assert why == "its driver, process 41 on head, has not refreshed its beat for 241 s (240 s allowed)"


def test_the_silence_allowed_outlasts_the_stores_retries():
    """A beat held up in the store's retries (DEFAULT_RETRY_S, 120 s) is a driver alive."""
    assert resume.driver_silent_limit_s(DEFAULT_RETRY_S) == 2 * DEFAULT_RETRY_S > DEFAULT_RETRY_S
    assert resume.driver_silent_limit_s(5.0) == 180.0
    assert DriverWatch(Store.of("/tmp/x"), "driver-a").silent_limit_s == 2 * DEFAULT_RETRY_S
    assert DriverWatch(Store("/tmp/x", retry_s=300.0), "driver-a").silent_limit_s == 600.0


def test_a_read_held_up_by_an_outage_does_not_age_the_beat(tmp_path, monkeypatch):
    """The read starts 100 s after the beat was seen and returns 300 s later (the store's retries,
    a hard NFS mount): the beat is 100 s old, not 400 s."""
    store, clock = Store.of(tmp_path), [1000.0]
    write_malformed(tmp_path, {"host_id": "elsewhere", "owner": "driver-a"})
    (tmp_path / beat_name("driver-a")).write_text("5.0")
    monkeypatch.setattr(files.time, "monotonic", lambda: clock[0])
    watch = DriverWatch(store, "driver-a")
    assert watch.why_gone() is None and watch.beat == 5.0
    real = files.lock_text

    def slow_read(store):
        clock[0] += 300.0
        return real(store)

    clock[0] += 100.0
    monkeypatch.setattr(files, "lock_text", slow_read)
    assert watch.why_gone() is None
    clock[0] += 150.0  # 550 s since the beat moved, counted from this read's start
    assert "has not refreshed its beat for 550 s (240 s allowed)" in watch.why_gone()


def test_a_run_taken_over_or_released_is_no_longer_the_attempts():
    assert gone(holder(owner="driver-b", pid=42)) == "the run is held by another driver now (process 42 on head)"
    assert gone(None) == "the run's lock is gone: its driver ended, or the lock was removed"
    assert gone(None, owner="") is None  # an attempt started without a lock's owner compares nothing


def test_the_watch_reads_the_real_lock(tmp_path):
    store = Store.of(tmp_path)
    lock = RunLock(store, owner="driver-a")
    lock.acquire()
    assert DriverWatch(store, "driver-a").why_gone() is None
    assert "held by another driver" in DriverWatch(store, "driver-z").why_gone()
    lock.release()
    assert "lock is gone" in DriverWatch(store, "driver-a").why_gone()
    write_malformed(tmp_path, {"pid": ended_pid(), "owner": "driver-a"})
    assert "has ended" in DriverWatch(store, "driver-a").why_gone()
    with pytest.raises(DriverGone, match=f"has ended; this attempt stops without writing more to {tmp_path}"):
        DriverWatch(store, "driver-a").check()


def test_a_beat_is_timed_on_the_workers_own_clock(tmp_path):
    """Another host's driver: its pid means nothing here; a beat that stops moving does."""
    store = Store.of(tmp_path)
    write_malformed(tmp_path, {"host_id": "elsewhere", "owner": "driver-a"})
    (tmp_path / beat_name("driver-a")).write_text("5.0")
    watch = DriverWatch(store, "driver-a")
    assert watch.why_gone() is None
    watch.beat_seen -= watch.silent_limit_s + 5  # as if the beat had not moved for that long
    assert "has not refreshed its beat for" in watch.why_gone()
    (tmp_path / beat_name("driver-a")).write_text("6.0")
    assert watch.why_gone() is None  # it moved: the driver lives


def test_only_rank_0_looks_and_the_sync_ends_the_attempt_on_every_rank(tmp_path):
    write_malformed(tmp_path, {"pid": ended_pid(), "owner": "driver-a"})
    assert RunWriter(tmp_path, enabled=False, driver="driver-a").driver_gone() is None
    why = RunWriter(tmp_path, enabled=True, driver="driver-a").driver_gone()
    assert "has ended" in why
    beat = type("Beat", (), {"mark": lambda self, step, phase: None})()
    vectors = []

    class Rank:
        world_size = 2

        def __init__(self, rank, summed=None):
            self.world_rank, self.summed = rank, summed

        def all_reduce_sum(self, values):
            vectors.append(values)
            return self.summed or values

    window = LossWindow.on(torch.device("cpu"))
    with pytest.raises(DriverGone, match="has ended; this attempt stops without writing more"):
        sync(Rank(0), beat, window, 10, driver_gone=why)
    sync(Rank(1), beat, window, 10)  # alone, rank 1 knows nothing
    summed = [a + b for a, b in zip(*vectors)]
    with pytest.raises(DriverGone, match="rank 0 found"):
        sync(Rank(1, summed), beat, window, 10)  # rank 1 learns it from the sum alone
    assert sync(Rank(1, [0.0] * len(summed)), beat, window, 10).count == 0  # no one gone: the sync goes on


def test_a_gone_drivers_queued_rows_are_dropped_never_written(tmp_path):
    """On an object store rank 0's rows wait in BufferedLogs: once its driver is found gone, a
    resume may be rewriting the same objects, so the rows are dropped and nothing is rewritten."""
    write_malformed(tmp_path, {"pid": ended_pid(), "owner": "driver-a"})
    for found_by in ("sync", "publish"):
        writer = RunWriter(tmp_path, enabled=True, driver="driver-a")
        writer.logs = BufferedLogs(writer.store, keep_last=(LIVE,), interval_s=0.05)  # as on a store
        writer.event(Kind.NOTE, "queued before the driver was found gone")
        if found_by == "sync":
            assert "has ended" in writer.driver_gone()
        else:
            with pytest.raises(DriverGone):
                writer.driver.check()  # the publish fence
        writer.event(Kind.NOTE, "queued after")
        time.sleep(0.2)  # the background rewrite's period, four times over
        writer.close()
        assert not (tmp_path / EVENTS).exists(), found_by
    logs = BufferedLogs(Store.of(tmp_path), interval_s=0.05)
    logs.append(EVENTS, "{}\n")
    logs.flush()  # a driver that holds the run: its rows are written
    assert (tmp_path / EVENTS).read_text() == "{}\n"


def test_a_fenced_publish_makes_nothing_visible(tmp_path):
    staging, target = tmp_path / ".staging" / "checkpoint_s000000010_x", Store.of(tmp_path / "checkpoint_s000000010_x")
    staging.mkdir(parents=True)
    (staging / "position.json").write_text("{}")
    write_malformed(tmp_path, {"pid": ended_pid(), "owner": "driver-a"})
    fence = DriverWatch(Store.of(tmp_path), "driver-a").check
    publish = Publish(staging, target, lambda: None, rank=None, coordinator=True, step=10, fence=fence)
    with pytest.raises(DriverGone):
        publish.run(then=lambda: pytest.fail("pruned after a fenced publish"))
    assert staging.is_dir() and not target.path.exists()


# -- the chosen checkpoint vanished: choose again ---------------------------------------------------


def test_a_choice_that_vanished_is_made_again_and_one_that_is_there_is_the_checkpoints_fault():
    choices = iter(["c10", "c15"])

    def read(choice):
        if choice != "c15":
            raise CheckpointError(f"{choice} does not exist")
        return "read"

    assert resume.read_chosen("c5", read, vanished=lambda c: c != "c15", choose_again=lambda: next(choices)) == (
        "c15",
        "read",
    )
    with pytest.raises(CheckpointError, match="c5 does not exist"):
        resume.read_chosen("c5", read, vanished=lambda c: False, choose_again=lambda: "c15")
    with pytest.raises(CheckpointError, match="removed faster than they could be read"):
        resume.read_chosen("c5", read, vanished=lambda c: True, choose_again=lambda: "c5")


class Linear(Pipeline):
    def build_model(self, cfg):
        return torch.nn.Linear(3, 2)


def save_checkpoint(run_dir: Path, step: int) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), Position(step=step))
    runtime = type("Runtime", (), {"world_rank": 0, "world_size": 1, "is_rank0": True})()
    runtime.all_gather_object = lambda value: [value]
    state.save(run_dir / ckpt.checkpoint_name(step), runtime, {}, distributed=False).wait(30)


def test_a_resume_whose_checkpoint_is_pruned_before_it_is_read_chooses_again(tmp_path, make_config):
    """A pruning writer (the earlier attempt's workers) removes the checkpoint the driver chose:
    the driver chooses the furthest one left, instead of saying it 'does not exist'."""
    from raytrain.driver.run import check_resume, check_run_dir

    cfg = make_config(resume=True, epochs=1)
    run_dir = Store.of(tmp_path) / "run"
    run_dir.make_dir()
    RunDir(run_dir).write_config({**cfg.to_dict(), "pipeline": "Linear"})
    for step in (10, 15):
        save_checkpoint(tmp_path / "run", step)
    stored = check_run_dir(run_dir, cfg, "Linear")
    assert ckpt.stored_step(stored.checkpoint) == 15
    ckpt.remove(stored.checkpoint)  # pruned under the resume
    lines = []
    check_resume(Linear(), cfg, stored, {"train": object()}, lines.append)
    assert any(line.startswith("Resuming run from step 10") for line in lines), lines


# -- a real run whose driver is killed --------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.scenario
def test_a_killed_drivers_workers_stop_writing_and_a_resume_continues(tmp_path):
    """SIGKILL a driver at step 8 of a run checkpointing every 5 steps, on its embedded Ray, whose
    actors outlive it: its workers stop at their next sync and publish nothing after; --resume
    then takes the run over, says it fenced them, and finishes."""
    name, run_dir = "orphans", tmp_path / "orphans"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rto-", dir="/tmp"))  # short: Ray's socket paths
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "RAY_TMPDIR": str(ray_tmp)}
    common = ["--storage", str(tmp_path), "--name", name, "--progress", "off"]
    raytrain = str(Path(sys.executable).with_name("raytrain"))
    driver = subprocess.Popen(
        [raytrain, "train", "rt_test_pipelines:SlowDigitsPipeline", "--workers", "2", "--epochs", "20",
         "--checkpoint-every-steps", "5", "--log-every-steps", "2", *common],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        try:
            step_at_kill = wait_for_step(run_dir / "live.jsonl", driver, 8)
        finally:
            driver.send_signal(signal.SIGKILL)  # the driver alone: its Ray and the workers live on
            driver.wait()
        killed = time.time()
        before = {d.name for d in ckpt.checkpoint_dirs(run_dir)}
        time.sleep(10)  # unfenced, the workers trained on and checkpointed 1-17 s after the kill
        assert session_of(driver.pid), "the embedded Ray did not outlive its driver: nothing is tested"
        after = [d for d in ckpt.checkpoint_dirs(run_dir) if d.name not in before]
        late_rows = [row for row in rows(run_dir / "live.jsonl") if row["time"] > killed]
        late = [row["step"] for row in late_rows]
        said = [f.name for f in ray_tmp.rglob("*") if f.is_file() and "DriverGone" in f.read_text(errors="replace")]
        print(
            f"killed at step {step_at_kill}; live rows after it at steps {late}, the last "
            f"{max((row['time'] - killed for row in late_rows), default=0.0):.1f} s after the kill; checkpoints "
            f"published after it: {[d.name for d in after]}; Ray's logs naming DriverGone: {said}"
        )
        assert all(ckpt.stored_step(d) <= step_at_kill for d in after), [d.name for d in after]
        # the next sync (every 2 steps) ends them; a live row may show a step before it
        assert max(late, default=step_at_kill) <= step_at_kill + 4, late
        resumed = subprocess.run(
            [raytrain, "train", "--resume", "--epochs", "1", *common],
            cwd=REPO, env={**env, "RAY_TMPDIR": str(ray_tmp / "resume")}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        for pid in session_of(driver.pid):  # the killed driver's embedded Ray, started by this test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(resumed.stdout[-1500:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "which has ended; its workers, if any still run, are fenced" in resumed.stdout
    assert not list(run_dir.glob(".lock*"))  # the killed driver's beat removed with its lock, the resume's released
    assert "does not exist" not in resumed.stdout + resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


def session_of(sid: int) -> list[int]:
    """The live processes of session `sid` (the killed driver's, which this test started)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if entry.name.isdigit() and int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def wait_for_step(live: Path, driver: subprocess.Popen, step: int, timeout_s: float = 240) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert driver.poll() is None, f"the driver ended with {driver.returncode} before step {step}"
        seen = [row["step"] for row in rows(live)]
        if seen and max(seen) >= step:
            return max(seen)
        time.sleep(0.1)
    raise AssertionError(f"the run did not reach step {step} within {timeout_s} s")


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
