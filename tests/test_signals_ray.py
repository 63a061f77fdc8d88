"""Real signals to a real `raytrain train` process (its own embedded Ray): SIGTERM and SIGINT stop
the run within seconds with a checkpoint, status "interrupted", exit 143 / 130 and the resume
command; a second Ctrl-C stops at once; nothing is left in /tmp or the run's staging area."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain.rundir.checkpoints import checkpoint_dirs

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
RAYTRAIN = str(Path(sys.executable).with_name("raytrain"))


def start(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    args = [
        RAYTRAIN,
        "train",
        "rt_test_pipelines:SlowDigitsPipeline",
        "--workers",
        "2",
        "--epochs",
        "20",
        "--storage",
        str(tmp_path),
        "--name",
        name,
        "--log-every-steps",
        "2",
        "--progress",
        "plain",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for_training(run_dir: Path, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / "live.jsonl").exists() and (run_dir / "live.jsonl").stat().st_size:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.5)
    raise AssertionError("the run did not start training in time")


def stop_with(tmp_path: Path, name: str, *signals: int) -> tuple[subprocess.Popen, str, str, float]:
    """Start a run, send `signals` (half a second apart) once it trains; (process, stdout,
    stderr, seconds from the last signal to its exit)."""
    process = start(tmp_path, name)
    try:
        wait_for_training(tmp_path / name, process)
        for index, signum in enumerate(signals):
            if index:
                time.sleep(0.5)
            process.send_signal(signum)
        sent = time.monotonic()
        out, err = process.communicate(timeout=120)
        return process, out, err, time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def staging_left(run_dir: Path) -> list[str]:
    return [str(p) for p in (run_dir / ".staging").glob("*")] if (run_dir / ".staging").exists() else []


def test_sigterm_stops_with_a_checkpoint_status_interrupted_exit_143_and_resumes(tmp_path):
    run_dir = tmp_path / "term"
    process, out, err, stopped_after_s = stop_with(tmp_path, "term", signal.SIGTERM)
    assert process.returncode == 143, (out, err)
    assert stopped_after_s < 60, stopped_after_s
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["model_path"] is None
    assert (summary["interruptions"], summary["failures_recovered"]) == (1, 0)  # a stop is not a failure
    assert "--name term" in err and "--resume" in err and "Traceback" not in err
    positions = [json.loads((d / "position.json").read_text()) for d in checkpoint_dirs(run_dir)]
    assert positions and max(p["step"] for p in positions) == summary["steps"]  # checkpointed where it stopped
    assert not staging_left(run_dir) and not (run_dir / ".lock").exists() and not (run_dir / ".stop").exists()

    resumed = subprocess.run(
        [
            RAYTRAIN,
            "train",
            "--name",
            "term",
            "--storage",
            str(tmp_path),
            "--resume",
            "--epochs",
            "1",
            "--progress",
            "off",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    # --epochs 1 while the run stood mid-epoch 1 or later: the epoch finishes (or nothing is left).
    assert resumed.returncode == 0, resumed.stderr
    assert f"from step {summary['steps']}" in resumed.stdout
    after = json.loads((run_dir / "summary.json").read_text())
    counts = [after[key] for key in ("resumes", "failures_recovered", "interruptions")]
    assert counts == [1, 0, 0]  # the resume is a resume


def test_two_ctrl_c_stop_at_once_with_exit_130(tmp_path):
    run_dir = tmp_path / "int"
    before = set(Path("/tmp").glob("raytrain-ckpt-*"))
    process, out, err, stopped_after_s = stop_with(tmp_path, "int", signal.SIGINT, signal.SIGINT)
    assert process.returncode == 130, (out, err)
    assert stopped_after_s < 45, stopped_after_s
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert "stopping" in out + err and "--resume" in err
    assert not staging_left(run_dir) and set(Path("/tmp").glob("raytrain-ckpt-*")) == before
