"""A real MLflow tracking server on loopback for the tests: `mlflow server` with a sqlite store
and local artifacts, served through the server (`mlflow-artifacts:`), as a team runs it.

The server runs from a venv of its own: the full `mlflow` package pins pyarrow below what Ray
Data uses here, so the suite's venv has only the client (`mlflow-skinny`, the `mlflow` extra).
The venv is made once, with the full mlflow at the client's version (or the newest before it
that installs) from the package registry, and kept in VENV_DIR (RAYTRAIN_MLFLOW_VENV overrides
it) for later runs; a venv that cannot be made is an error of the test that asked, never a
skip. The server is stopped by its process group's id.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from s3_server import free_port

VENV_DIR = Path(os.environ.get("RAYTRAIN_MLFLOW_VENV") or Path.home() / ".cache" / "raytrain-mlflow-venv")
PIP_TIMEOUT_S = 900


def client_version() -> str:
    return importlib.metadata.version("mlflow-skinny")


def server_binary() -> Path:
    """VENV_DIR's `mlflow`, the full package at the client's version; the venv made (or its
    mlflow changed) first when it has another, under a lock that parallel sessions share."""
    version = client_version()
    VENV_DIR.parent.mkdir(parents=True, exist_ok=True)
    made = VENV_DIR / f"mlflow-{version}.made"  # written last: a venv half made is made again
    with open(VENV_DIR.parent / f"{VENV_DIR.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            _run([sys.executable, "-m", "venv", "--clear", str(VENV_DIR)], "make the venv")
            # The client's version, or the newest before it that the registry can install whole (a
            # release's own dependencies, mlflow-tracing among them, can reach the registry later).
            wanted = f"mlflow>=3.0,<={version}"
            _run([str(VENV_DIR / "bin" / "python"), "-m", "pip", "install", "--quiet", wanted], f"install {wanted}")
            made.touch()
    return VENV_DIR / "bin" / "mlflow"


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(
            f"could not {what} for the MLflow server at {VENV_DIR} (exit {done.returncode}): "
            f"{(done.stderr or done.stdout)[-2000:]}"
        )


class MlflowServer:
    """`mlflow server` at a free port of 127.0.0.1, its store and artifacts under `root`."""

    def __init__(self, root: Path, timeout_s: float = 120.0):
        binary = server_binary()
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "server.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                str(binary),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
                "--artifacts-destination",
                str(root / "artifacts"),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                self.log.close()
                raise RuntimeError(
                    f"mlflow server exited with status {self.process.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as answer:
                    if answer.read().strip() == b"OK":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mlflow server not ready in {timeout_s:.0f} s: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """The server's process group (uvicorn and its worker), by the leader's id."""
        try:  # the group may outlive its leader: its workers
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(15)
        # Whatever the leader did, the group's workers may ignore SIGTERM: the group goes with SIGKILL.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if not self.log.closed:
            self.log.close()
