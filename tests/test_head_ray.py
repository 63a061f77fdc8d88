"""`raytrain up`, a run that joins the head it started, `raytrain down`: the real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from raytrain.driver.head import head_processes

pytestmark = pytest.mark.ray  # starts a Ray head of its own (not the session's)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Ray 2.60 binds its gRPC servers to every interface with no setting to move them (README
# "Exposure"); they need the session token. Nothing else of the head may listen there.
GRPC_PROCESSES = ("gcs_server", "raylet", "ray::DashboardAgent")


def raytrain(env, *args, timeout=300):
    return subprocess.run(
        [str(BIN / "raytrain"), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"]
    )


@pytest.fixture
def head(tmp_path):
    """`raytrain up` in a home of its own: (environment, record, up's result); `down` after."""
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
        yield env, record, up
    finally:
        if record_path.exists():
            raytrain(env, "down", timeout=120)


def wildcard_listeners(pids: list[int]) -> list[tuple[str, int, str]]:
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids and conn.laddr.ip in ("0.0.0.0", "::"):
            found.append((conn.laddr.ip, conn.laddr.port, " ".join(psutil.Process(conn.pid).cmdline())))
    return found


def serves_metrics(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as answer:
            return b"# HELP" in answer.read(65536)
    except Exception:  # a gRPC server does not speak HTTP/1.1: refused, reset or malformed
        return False


def test_up_listens_on_no_wildcard_but_rays_grpc_then_a_run_joins_it_then_down_ends_it(head, tmp_path):
    env, record, up = head
    record_path = Path(env["RAYTRAIN_HEAD_FILE"])
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.startswith(f"raytrain: started a local Ray head at {record['address']}")
    assert record["ray_version"] and record["pids"]["raylet"] and record["pids"]["gcs_server"]
    started = head_processes(record)
    assert record["pid"] in started and record["pids"]["raylet"] in started

    # The dashboard's and autoscaler's Prometheus /metrics servers bound 0.0.0.0 before.
    time.sleep(3)  # the monitor starts its server after `ray start` returns
    wildcard = wildcard_listeners(head_processes(record))
    assert [w for w in wildcard if w[0] == "0.0.0.0"] == []
    assert all(any(name in w[2] for name in GRPC_PROCESSES) for w in wildcard), wildcard
    assert [w for w in wildcard if serves_metrics(w[1])] == []

    run = raytrain(env, "train", "digits", "--workers", "1", "--max-steps", "2", "--storage", str(tmp_path / "runs"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    first = run.stdout.splitlines()[0]
    assert first.startswith(f"raytrain: joining the local Ray head at {record['address']} (started by `raytrain up`")
    assert "declares a silent node" not in run.stdout  # up's head has raytrain's health checks
    assert json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())["status"] == "finished"

    down = raytrain(env, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert down.stdout.startswith(f"raytrain: stopped the local Ray head at {record['address']}")
    assert head_processes(record) == []
    assert not record_path.exists() and not Path(record["temp_dir"]).exists()
    assert raytrain(env, "down").stdout.startswith("raytrain: no local Ray head is recorded")


def test_the_heads_death_mid_run_fails_the_run_with_that_cause(head, tmp_path):
    env, record, up = head
    assert up.returncode == 0, up.stdout + up.stderr
    runs = tmp_path / "runs"
    command = [str(BIN / "raytrain"), "train", "digits", "--workers", "1", "--epochs", "200", "--storage", str(runs)]
    run = subprocess.Popen(command, env=env, cwd=env["HOME"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not list(runs.glob("*/checkpoint_*")) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # training has run an epoch: the head is in use
        assert run.poll() is None, run.communicate()
        for pid in head_processes(record):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stdout, stderr = run.communicate(timeout=150)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    named = [line for line in (stdout + stderr).splitlines() if "local Ray head" in line and "stopped during" in line]
    assert len(named) == 1, stdout[-3000:] + stderr[-3000:]
    assert record["address"] in named[0]
