"""`raytrain up`, a run that joins the head it started, `raytrain down`: the real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.driver.head import head_processes

pytestmark = pytest.mark.ray  # starts a Ray head of its own (not the session's)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def raytrain(env, *args, timeout=300):
    return subprocess.run(
        [str(BIN / "raytrain"), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"]
    )


def test_up_then_a_run_joins_it_and_says_so_then_down_ends_every_process(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    record_path = tmp_path / "state" / "head.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        HOME=str(home),  # the run's default storage and Ray's token land in tmp_path
        RAYTRAIN_HEAD_FILE=str(record_path),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
    )
    up = raytrain(env, "up", "--num-cpus", "3", timeout=180)
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert up.stdout.startswith(f"raytrain: started a local Ray head at {record['address']}")
        assert record["ray_version"] and record["pids"]["raylet"] and record["pids"]["gcs_server"]
        started = head_processes(record)
        assert record["pid"] in started and record["pids"]["raylet"] in started

        run = raytrain(
            env, "train", "digits", "--workers", "1", "--max-steps", "2", "--storage", str(tmp_path / "runs")
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        first = run.stdout.splitlines()[0]
        assert first.startswith(
            f"raytrain: joining the local Ray head at {record['address']} (started by `raytrain up`"
        )
        assert json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())["status"] == "finished"
    finally:
        down = raytrain(env, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert down.stdout.startswith(f"raytrain: stopped the local Ray head at {record['address']}")
    assert head_processes(record) == []
    assert not record_path.exists() and not Path(record["temp_dir"]).exists()
    assert raytrain(env, "down").stdout.startswith("raytrain: no local Ray head is recorded")
