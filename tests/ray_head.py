"""A Ray head of a test's own, and the means to stop only it (tests/test_jobs.py,
tests/test_autoscaler_ray.py).

`ray start --head --block` on 127.0.0.1 with free ports, its own --temp-dir (so
/tmp/ray/ray_current_cluster of other tests is never touched), token auth with a token file
of its own (RAY_AUTH_TOKEN_PATH, never ~/.ray/auth_token), in its own process group, every
process of it marked by an environment variable. `Head.stop` ends that group and whatever of
the head outlived it: never `ray stop`, which kills every Ray process on the machine
(RAY_NOTES, "Jobs and clusters").
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Iterator, Sequence

import yaml

BIN = Path(sys.executable).parent  # the venv's bin: `ray` and `raytrain` live next to python
MARKER = "RAYTRAIN_JOBTEST_HEAD"  # env var every process of a test's head inherits


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
    """One isolated `ray start --head --block`, and the means to stop only it.

    `num_cpus`: the head's logical CPUs. `env`: extra environment of `ray start` (and so of
    every process the head starts). `args`: extra `ray start` arguments. `autoscaling_config`:
    a cluster config (dict) for the head's autoscaler; it is written next to the log with
    `provider.gcs_address` set to this head (the fake_multinode provider starts its nodes
    against that address) and passed as --autoscaling-config.
    """

    def __init__(
        self,
        root: Path,
        *,
        num_cpus: int = 4,
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        autoscaling_config: dict[str, Any] | None = None,
    ):
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
        self.head_env = {**self.cli_env, **(env or {}), MARKER: self.marker}
        self.log = open(root / "ray-start.log", "w")
        cmd = [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--temp-dir={self.temp_dir}",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dash_port}",
            f"--dashboard-agent-listen-port={agent}",
            f"--ray-client-server-port={client}",
            "--include-dashboard=true",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            "--disable-usage-stats",
            *args,
        ]
        if autoscaling_config is not None:
            config = {
                **autoscaling_config,
                "provider": {**autoscaling_config["provider"], "gcs_address": self.gcs_address},
            }
            config_path = root / "autoscaling.yaml"
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            cmd.append(f"--autoscaling-config={config_path}")
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

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process of this head (see `_processes_of`)."""
        return _processes_of(self.proc.pid, self.marker, self.temp_dir)

    def stop(self) -> dict[int, str]:
        """End the head's process group, then whatever of it outlived that (agents, workers,
        the job driver, which runs in a session of its own, nodes the autoscaler started).
        Returns what could not be ended.

        SIGTERM first; `ray start` then drains for up to 30 s, which a throwaway test head
        does not need, so what is left after a short grace gets SIGKILL."""
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            left = self.processes()
            _signal_all(left, sig)
            deadline = time.monotonic() + grace
            while left and time.monotonic() < deadline:
                time.sleep(0.2)
                left = self.processes()
            if not left:
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.log.close()
        left = self.processes()
        if not left:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


@contextlib.contextmanager
def running_head(root: Path, *, ready_timeout: float = 120, **head_args: Any) -> Iterator[Head]:
    """A started `Head(root, **head_args)` whose Jobs API answers; on exit it is stopped, and
    the exit fails if any process of it is left."""
    started = time.monotonic()
    head = Head(root, **head_args)
    try:
        head.wait_ready(timeout=ready_timeout)
        print(f"head ready after {time.monotonic() - started:.1f} s")
        yield head
    finally:
        stopping = time.monotonic()
        left = head.stop()
        print(f"head stopped in {time.monotonic() - stopping:.1f} s")
        assert not left, f"processes of the test's Ray head outlived it: {left}"
