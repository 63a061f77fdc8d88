"""`ray job submit --working-dir . -- raytrain train ...` against a real Ray head (issue 7).

The test starts a head of its own: `ray start --head --block` on 127.0.0.1 with free ports,
its own --temp-dir (so /tmp/ray/ray_current_cluster of other tests is never touched), token
auth with a token file of its own (RAY_AUTH_TOKEN_PATH, never ~/.ray/auth_token), in its own
process group. It submits a short digits job with the Jobs CLI, follows its logs, checks the
status and the run files, then stops only that head: never `ray stop`, which kills every Ray
process on the machine (RAY_NOTES, "Jobs and clusters").
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the head's processes through /proc"),
]

BIN = Path(sys.executable).parent  # the venv's bin: `ray` and `raytrain` live next to python
MARKER = "RAYTRAIN_JOBTEST_HEAD"  # env var every process of the test's head inherits


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _processes_of(head_sid: int, marker: str, temp_dir: str) -> dict[int, str]:
    """pid -> command line of every live process of this head: in the session `ray start`
    leads, or carrying the marker in its environment (inherited from `ray start`; the job
    driver runs in a session of its own), or naming the head's temp dir on its command line,
    or a descendant of any of those. (Ray renames many of its processes — ray::IDLE,
    ray-dashboard-JobHead-0 — which can overwrite both the command line and the environ.)"""
    table, ours = {}, set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = b""
            with contextlib.suppress(OSError):
                environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile
            continue
        state, ppid, sid = stat[0], int(stat[1]), int(stat[4])
        if state in ("Z", "X"):  # exited; waiting to be reaped
            continue
        pid = int(entry.name)
        table[pid] = (ppid, cmdline)
        if sid == head_sid or f"{MARKER}={marker}".encode() in environ.split(b"\0") or temp_dir in cmdline:
            ours.add(pid)
    grown = True
    while grown:
        more = {pid for pid, (ppid, _) in table.items() if ppid in ours} - ours
        ours |= more
        grown = bool(more)
    return {pid: table[pid][1] for pid in sorted(ours)}


def _signal_all(pids, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Head:
    """One isolated `ray start --head --block`, and the means to stop only it."""

    def __init__(self, root: Path):
        self.temp_dir = tempfile.mkdtemp(prefix="rtjob-", dir="/tmp")  # short: Unix socket paths ≤ 107 bytes
        self.marker = uuid.uuid4().hex
        gcs, self.dash_port, agent, client = _free_ports(4)
        self.gcs_address = f"127.0.0.1:{gcs}"
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        self.token = secrets.token_hex(32)
        token_path = root / "auth_token"
        token_path.write_text(self.token)
        token_path.chmod(0o600)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", MARKER))}
        auth = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the job's `raytrain`
        }
        self.cli_env = {**base, **auth}
        self.head_env = {**self.cli_env, MARKER: self.marker}
        self.log = open(root / "ray-start.log", "w")
        cmd = [
            str(BIN / "ray"), "start", "--head", "--block",
            f"--temp-dir={self.temp_dir}",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dash_port}",
            f"--dashboard-agent-listen-port={agent}",
            f"--ray-client-server-port={client}",
            "--include-dashboard=true",
            "--num-cpus=4",
            "--num-gpus=0",
            "--disable-usage-stats",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=self.head_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root
        )

    def ray(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "ray"), *args], env=self.cli_env, capture_output=True, text=True, timeout=timeout
        )

    def get(self, path: str, token: str | None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.dashboard + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ray start exited with {self.proc.returncode}: {self.log_text()}")
            with contextlib.suppress(OSError):
                if self.get("/api/jobs/", self.token)[0] == 200:
                    return
            time.sleep(0.5)
        raise AssertionError(f"the head's Jobs API did not answer within {timeout} s: {self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> dict[int, str]:
        """End the head's process group, then whatever of it outlived that (agents, workers,
        the job driver, which runs in a session of its own). Returns what could not be ended.

        SIGTERM first; `ray start` then drains for up to 30 s, which a throwaway test head
        does not need, so what is left after a short grace gets SIGKILL."""
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            left = _processes_of(self.proc.pid, self.marker, self.temp_dir)
            _signal_all(left, sig)
            deadline = time.monotonic() + grace
            while left and time.monotonic() < deadline:
                time.sleep(0.2)
                left = _processes_of(self.proc.pid, self.marker, self.temp_dir)
            if not left:
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.log.close()
        left = _processes_of(self.proc.pid, self.marker, self.temp_dir)
        if not left:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


@pytest.fixture
def ray_head(tmp_path):
    started = time.monotonic()
    head = Head(tmp_path)
    try:
        head.wait_ready(timeout=120)
        print(f"head ready after {time.monotonic() - started:.1f} s")
        yield head
    finally:
        stopping = time.monotonic()
        left = head.stop()
        print(f"head stopped in {time.monotonic() - stopping:.1f} s")
        assert not left, f"processes of the test's Ray head outlived it: {left}"


def test_job_submit_trains_digits(ray_head, tmp_path):
    head = ray_head
    # Token auth is on: the Jobs API refuses a request without the token.
    assert head.get("/api/jobs/", token=None)[0] in (401, 403)

    work = tmp_path / "work"  # the uploaded --working-dir: small
    work.mkdir()
    (work / "note.txt").write_text("uploaded with the job\n")
    storage = tmp_path / "storage"
    job_id = f"raytrain-jobtest-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    submit = [
        "job", "submit", "--address", head.dashboard, "--working-dir", str(work),
        "--submission-id", job_id, "--no-wait", "--",
        "raytrain", "train", "digits", "--workers", "2", "--epochs", "2",
        "--storage", str(storage), "--name", "jobtest",
    ]  # fmt: skip
    # The Jobs API answers before the head's job agent is up; on a loaded host the first
    # submissions can be dropped ("Remote end closed connection"): try again, once per id.
    deadline = time.monotonic() + 90
    while True:
        submitted = head.ray(*submit, timeout=90)
        if submitted.returncode == 0 or head.get(f"/api/jobs/{job_id}", head.token)[0] == 200:
            break
        assert time.monotonic() < deadline, submitted.stdout + submitted.stderr
        time.sleep(3)

    # `ray job logs --follow` returns when the job ends. (~60 s on an idle 2-core machine;
    # the limit leaves room for a loaded CI host.)
    try:
        followed = head.ray("job", "logs", "--address", head.dashboard, "--follow", job_id, timeout=300)
    except subprocess.TimeoutExpired as exc:
        code, body = head.get(f"/api/jobs/{job_id}", head.token)
        pytest.fail(f"job {job_id} still running after {exc.timeout} s: {code} {body[:500]!r}\n{(exc.stdout or b'')[-3000:]!r}")
    logs = followed.stdout
    code, body = head.get(f"/api/jobs/{job_id}", head.token)
    info = json.loads(body or b"{}")
    print(f"job {job_id}: {info.get('status')} after {time.monotonic() - started:.1f} s")
    assert code == 200 and info.get("status") == "SUCCEEDED", (
        f"{code} {info}\n--- job logs ---\n{logs[-4000:]}\n{followed.stderr[-2000:]}"
    )
    assert f"Job '{job_id}' succeeded" in followed.stdout + followed.stderr
    assert "raytrain: jobtest" in logs, logs[-4000:]
    assert "epoch 2/2" in logs, logs[-4000:]

    run_dir = storage / "jobtest"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["epochs"] == 2
    assert summary["world_sizes"] == [2]
    assert summary["model_path"] == str(run_dir / "model.pt")
    assert (run_dir / "model.pt").is_file()
