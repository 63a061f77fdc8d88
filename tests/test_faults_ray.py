"""CPU Ray tier: failures that must end or recover a run, never hang it."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from rt_test_pipelines import RecordingPipeline, StallingPipeline, read_jsonl

import raytrain

pytestmark = pytest.mark.ray


def test_stalled_rank_fails_the_attempt_naming_it_within_the_timeout(ray_session, tmp_path, make_config):
    timeout_s = 10
    cfg = make_config(
        workers=2, epochs=1, batch_size_per_worker=8, max_failures=0, collective_timeout_s=timeout_s, name="stall"
    )
    with pytest.raises(raytrain.RunFailed) as failure:
        raytrain.fit(StallingPipeline(str(tmp_path), stall_rank=1, stall_at_step=3), cfg)
    stalled_for_s = time.time() - float((tmp_path / "stalled_at").read_text())
    message = str(failure.value)
    assert "stalled rank(s): 1" in message
    assert "rank 1 (STALLED): step 3, in forward" in message
    assert stalled_for_s < timeout_s + 30, stalled_for_s


CORRUPT_BASE = dict(workers=2, batch_size_per_worker=8, name="corrupt", num_checkpoints_to_keep=3, schedule="constant")


@pytest.fixture(scope="module")
def two_epoch_run(ray_session, tmp_path_factory):
    """One 2-worker, 2-epoch RecordingPipeline run (64 rows: a checkpoint at steps 4 and 8) and
    an untouched copy of its directory, for each case of
    test_corrupt_latest_checkpoint_falls_back_to_the_previous_good_one to corrupt and resume
    in place: the cases differ only after this run."""
    from raytrain.rundir.checkpoints import checkpoint_dirs

    storage = tmp_path_factory.mktemp("corrupt")
    first = storage / "first"
    first.mkdir()
    config = raytrain.TrainConfig(epochs=2, storage=str(storage), **CORRUPT_BASE)
    result = raytrain.fit(RecordingPipeline(str(first), num_rows=64), config)
    checkpoints = checkpoint_dirs(result.run_dir)
    pristine = storage / "pristine"
    shutil.copytree(result.run_dir, pristine, symlinks=True)
    return Path(result.run_dir), pristine, [c.name for c in checkpoints]


@pytest.mark.parametrize("corrupt", [("train_state.pt",), ("train_state.pt", "model.pt")])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_good_one(two_epoch_run, tmp_path, corrupt):
    from raytrain.rundir.checkpoints import checkpoint_dirs

    run_dir, pristine, checkpoint_names = two_epoch_run
    assert len(checkpoint_names) == 2
    # The run as it ended, back at its own path (Ray Train's records name absolute paths).
    shutil.rmtree(run_dir)
    shutil.copytree(pristine, run_dir, symlinks=True)
    checkpoints = checkpoint_dirs(run_dir)
    assert [c.name for c in checkpoints] == checkpoint_names
    for name in corrupt:  # a crash mid-write, or a bad disk
        (checkpoints[-1] / name).write_bytes(b"truncated")

    second = tmp_path / "second"
    second.mkdir()
    resumed = raytrain.fit(
        RecordingPipeline(str(second), num_rows=64),
        raytrain.TrainConfig(epochs=3, resume=True, storage=str(run_dir.parent), **CORRUPT_BASE),
    )
    assert resumed.summary["status"] == "finished" and resumed.summary["epochs"] == 3
    steps = sorted({row["step"] for row in read_jsonl(second / "ids-rank0.jsonl")})
    assert steps == list(range(4, 12))  # from the epoch-1 checkpoint (step 4), not the corrupt epoch-2 one
    # ...and it says so, at the default verbosity (an event line, echoed by the driver).
    skipped = [e for e in read_jsonl(run_dir / "events.jsonl") if "skipped unusable checkpoint" in e["message"]]
    assert skipped and checkpoints[-1].name in skipped[0]["message"]
    # A resume that passed over a bad checkpoint recovered no failure; each is counted for what it is.
    counts = {k: resumed.summary[k] for k in ("failures_recovered", "resumes", "interruptions", "checkpoints_skipped")}
    assert counts == {"failures_recovered": 0, "resumes": 1, "interruptions": 0, "checkpoints_skipped": 1}


def test_driver_killed_mid_run_then_resume_finishes_the_run(tmp_path):
    """The driver (and the embedded Ray it started) dies; `--resume --name` continues from storage."""
    import os
    import signal
    import subprocess
    import sys

    raytrain_bin = str(Path(sys.executable).with_name("raytrain"))
    args = [
        raytrain_bin,
        "train",
        "digits",
        "--workers",
        "2",
        "--epochs",
        "6",
        "--storage",
        str(tmp_path),
        "--name",
        "killed",
    ]
    run_dir = tmp_path / "killed"
    # Ray's own report pace (one per 2 s; raytrain's 0.25 s wins only when nothing is exported)
    # keeps the run going for a while after its first checkpoint, for the kill to land mid-run.
    paced = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}
    driver = subprocess.Popen(
        args, env=paced, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # Wait for a checkpoint that loads: Ray copies a checkpoint's files into storage one by
        # one, and a kill mid-copy leaves a partial one that resume (rightly) skips.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not _loadable_checkpoint(run_dir):
            time.sleep(0.5)
        assert _loadable_checkpoint(run_dir), "no complete checkpoint before the deadline"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the Ray it started, as a crash would
        driver.wait()
    assert not (run_dir / "summary.json").exists()

    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "Restarted from the checkpoint" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs"] == 6
    assert (run_dir / "model.pt").exists()


def _loadable_checkpoint(run_dir: Path) -> bool:
    from raytrain.errors import CheckpointError
    from raytrain.rundir import checkpoints as ckpt

    for directory in ckpt.checkpoint_dirs(run_dir):
        try:
            ckpt.load_state(directory)
            return True
        except CheckpointError:
            continue
    return False
