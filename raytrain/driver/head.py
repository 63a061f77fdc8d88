"""`raytrain up` / `raytrain down`: a local Ray head that later runs join, and its record.

- `start_head`: `ray start --head --block` in a process group of its own, with the embedded
  Ray's settings (`raytrain.driver.session`: dashboard on 127.0.0.1, metrics collection off, the
  workers' niceness and environment), its own temp dir and free ports (other Rays on the host
  are never touched); recorded in `head_file()` (~/.raytrain/head.json, or RAYTRAIN_HEAD_FILE):
  its process ids, address, Ray and Python versions, user, session directory.
- `stop_head`: ends exactly that head — its process group, then whatever of it outlived that
  (the dashboard and runtime-env agents can outlive a killed raylet) — never `ray stop`, which
  ends every Ray on the machine (RAY_NOTES, "Jobs and clusters").
- `join_recorded_head`: for a command without --address, the verdict on the record
  (`raytrain.rules.head`): join it (RAY_ADDRESS for this process), clear a stale one, or refuse.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from raytrain.driver.head_owned import (
    MARKER_ENV,
    create_time,
    head_processes,
    process_uid,
    remove_temp_dir,
    same_process,
    stop_processes,
)
from raytrain.errors import RunFailed, UsageError
from raytrain.rules.head import (
    JOIN,
    REFUSE,
    STALE,
    TEMP_DIR_PREFIX,
    TEMP_DIR_PROOF,
    head_verdict,
    record_file_problem,
    record_problem,
)

HEAD_FILE_ENV = "RAYTRAIN_HEAD_FILE"
READY_TIMEOUT_S = 120.0
READY_LINE = "Ray runtime started."  # what `ray start` prints once the node is up


def head_file() -> Path:
    return Path(os.environ.get(HEAD_FILE_ENV) or Path.home() / ".raytrain" / "head.json").expanduser()


def read_record(path: Path) -> dict[str, Any] | None:
    """The record at `path`; None when there is none. A file that is not one, or that another
    user wrote or could have replaced, is the user's to check and remove: nothing is acted on."""
    try:
        text = path.read_text()
        info, folder = path.stat(), path.parent.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"cannot read the local Ray head record {path} ({exc}){_fix_for(path)}") from None
    untrusted = record_file_problem(
        file_uid=info.st_uid, file_mode=info.st_mode, dir_mode=folder.st_mode, uid=os.getuid()
    )
    if untrusted:
        raise UsageError(
            f"the local Ray head record {path} is not acted on: {untrusted}; if you wrote it with `raytrain up`, "
            f"`chmod 600 {path}` (and `chmod go-w {path.parent}`), otherwise remove it, then `raytrain up`"
        )
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"cannot read the local Ray head record {path} ({exc}){_fix_for(path)}") from None
    problem = record_problem(record)
    if problem:
        raise UsageError(f"{path} is not a raytrain head record ({problem}){_fix_for(path)}")
    return record


def _fix_for(path: Path) -> str:
    """The fix for a record that cannot be used: remove the file, or, when a part of its path
    is a regular file (RAYTRAIN_HEAD_FILE under a file), point the variable elsewhere."""
    for parent in path.parents:
        if parent.is_file():
            return (
                f"; {parent} is a file, not a folder: point {HEAD_FILE_ENV} at a path in a folder "
                f"(or unset it for ~/.raytrain/head.json)"
            )
    return "; remove it, then `raytrain up`"


def write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.chmod(0o600)
    os.replace(partial, path)


def ray_version() -> str:
    from importlib.metadata import version

    return version("ray")  # without importing Ray: a command refused here pays nothing for it


def head_alive(record: dict[str, Any]) -> bool:
    """Its raylet is the process recorded and its GCS answers."""
    raylet = record.get("pids", {}).get("raylet")
    from raytrain.driver.session import gcs_answers

    return same_process(raylet, record.get("created", {}).get("raylet")) and gcs_answers(record["address"])


def verdict(record: dict[str, Any], path: Path):
    leader_uid = (
        process_uid(record["pid"]) if same_process(record["pid"], record.get("created", {}).get("pid")) else None
    )
    return head_verdict(
        record,
        alive=head_alive(record),
        uid=os.getuid(),
        process_uid=leader_uid,
        ray_version=ray_version(),
        python_version=platform.python_version(),
        where=str(path),
    )


@contextlib.contextmanager
def joined_head(address: str | None, echo: Callable[[str], None]) -> Iterator[dict[str, Any] | None]:
    """Around a command given `address` (None: not given): join the recorded head if there is
    one to join (`join_recorded_head`), and when the command fails and that head is gone, fail
    with that cause (exit 1): the head's death, not the lost actor it caused."""
    from raytrain.driver.interrupts import Interrupted

    record = join_recorded_head(address, echo)
    try:
        yield record
    except (Interrupted, KeyboardInterrupt):
        raise
    except Exception as exc:
        if record is None or head_alive(record):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise RunFailed(
            f"the local Ray head at {record['address']} (`raytrain up`, pid {record['pid']}) stopped during the run "
            f"({first}); start one again with `raytrain up` (or run without it after `raytrain down`); a run "
            "resumes from its last checkpoint with --resume"
        ) from None


def join_recorded_head(address: str | None, echo: Callable[[str], None]) -> dict[str, Any] | None:
    """For a command given `address` (None: not given): the recorded head when the command is
    to join it (its address set as RAY_ADDRESS for this process, with the head's auth mode),
    after saying so; None when there is no head to join (a stale record is cleared, said).
    Raises UsageError (exit 2) for a head that must not be joined."""
    if address or os.environ.get("RAY_ADDRESS"):
        return None
    path = head_file()
    record = read_record(path)
    if record is None:
        return None
    found = verdict(record, path)
    if found.kind == REFUSE:
        raise UsageError(found.reason)
    if found.kind == STALE:
        _clear_stale(record, path, found.reason, echo)
        return None
    os.environ["RAY_ADDRESS"] = record["address"]
    # `ray start` turned token auth on; the driver must send the token (RAY_NOTES).
    if record.get("auth_mode"):
        os.environ.setdefault("RAY_AUTH_MODE", record["auth_mode"])
    if record.get("auth_token_path"):
        os.environ.setdefault("RAY_AUTH_TOKEN_PATH", record["auth_token_path"])
    echo(found.reason)
    return record


def _clear_stale(record: dict[str, Any], path: Path, reason: str, echo: Callable[[str], None]) -> None:
    """End what is left of a stale head, if anything (provably that head's), and clear its record."""
    stop_processes(record)
    left = remove_temp_dir(record)
    path.unlink(missing_ok=True)
    echo(f"raytrain: {reason}{left}")


def default_num_cpus() -> int:
    """Logical CPUs of a head: what the largest embedded run gets (every worker count an
    embedded Ray accepts, and room for its data tasks)."""
    from raytrain.driver.session import MAX_WORKERS_PER_CPU

    return MAX_WORKERS_PER_CPU * (os.cpu_count() or 1) + 2


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_head(num_cpus: int | None, echo: Callable[[str], None]) -> dict[str, Any]:
    """Start and record a head (see the module's docstring); an already running one of ours is
    said and kept. Raises UsageError for a record that must not be replaced, RunFailed when
    the head does not start."""
    from raytrain.driver.session import EMBEDDED_SYSTEM_CONFIG, EMBEDDED_WORKER_NICENESS, WORKER_ENV, metrics_port_env
    from raytrain.rules.head import EMBEDDED_TRIAL_DRIVER_SLOTS, TRIAL_DRIVER_RESOURCE

    path = head_file()
    record = read_record(path)
    if record is not None:
        found = verdict(record, path)
        if found.kind == JOIN:
            echo(f"raytrain: a local Ray head is already running at {record['address']} (pid {record['pid']})")
            return record
        if found.kind == REFUSE:
            raise UsageError(found.reason)
        _clear_stale(record, path, found.reason, echo)
    num_cpus = num_cpus or default_num_cpus()
    gcs, dashboard, agent, client = _free_ports(4)
    marker = uuid.uuid4().hex
    env = {
        **os.environ,
        **WORKER_ENV,
        MARKER_ENV: marker,
        "RAY_USAGE_STATS_ENABLED": "0",
        # Train's placement-group cleaner asks this dashboard (as an embedded Ray's runs do).
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard}",
        # The GCS listens on its port before the dashboard and monitor start: their /metrics
        # servers cannot bind it, so none listens on 0.0.0.0 (docs/cluster.md).
        **metrics_port_env(gcs),
    }
    env.setdefault("RAY_worker_niceness", EMBEDDED_WORKER_NICENESS)
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = auth_mode = os.environ.get("RAY_AUTH_MODE") or "token"
    if auth_mode == "token":
        ensure_token(env)
    log_path = path.with_suffix(".log")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Made only once nothing can refuse the start (a refused `up` leaves no directory behind);
    # short: Unix socket paths ≤ 107 bytes. The proof file is what lets `down` delete it.
    temp_dir = tempfile.mkdtemp(prefix=TEMP_DIR_PREFIX, dir="/tmp")
    (Path(temp_dir) / TEMP_DIR_PROOF).write_text(marker + "\n")
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        f"--temp-dir={temp_dir}",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}",
        f"--ray-client-server-port={client}",
        f"--num-cpus={num_cpus}",
        f"--resources={json.dumps({TRIAL_DRIVER_RESOURCE: EMBEDDED_TRIAL_DRIVER_SLOTS})}",
        "--disable-usage-stats",
        # As the embedded Ray: no metrics agent exporting /metrics to anyone (docs/cluster.md lists what stays).
        f"--system-config={json.dumps(EMBEDDED_SYSTEM_CONFIG)}",
    ]
    started = time.time()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    record = {
        "pid": process.pid,
        "marker": marker,
        "temp_dir": temp_dir,
        "started_at": started,
        "uid": os.getuid(),
        "user": pwd.getpwuid(os.getuid()).pw_name,
        "ray_version": ray_version(),
        "python_version": platform.python_version(),
        "address": "",
        "created": {"pid": create_time(process.pid)},  # so that a failed start ends exactly its own group
    }
    try:
        _wait_ready(process, log_path, started)
        record.update(_describe_started(process.pid, temp_dir, gcs, dashboard, num_cpus, log_path))
    except BaseException:
        stop_processes(record)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    write_record(path, record)
    echo(
        f"raytrain: started a local Ray head at {record['address']} in {time.time() - started:.1f} s "
        f"(Ray {record['ray_version']}, {num_cpus} logical CPUs, dashboard {record['dashboard_url']}, "
        f"pid {process.pid}); recorded in {path}"
    )
    echo(
        "raytrain train, check, tune, bench and doctor without --address now join it (their first line says so); "
        "`raytrain down` stops it"
    )
    echo(f"other Ray programs: RAY_ADDRESS={record['address']} RAY_AUTH_MODE={record['auth_mode']}")
    return record


def ensure_token(env: dict[str, str]) -> None:
    """Token auth on, always: `ray start` turns it on by itself only when a token already exists.
    Without one (in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), Ray's own
    `ray get-auth-token --generate` writes one, as the embedded Ray's first `ray.init` would."""
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    if env.get("RAY_AUTH_TOKEN") or path.exists():
        return
    if env.get("RAY_AUTH_TOKEN_PATH"):  # Ray's --generate refuses a named file that is not there
        raise UsageError(
            f"RAY_AUTH_TOKEN_PATH names {path}, which does not exist; write the cluster's token there "
            "(e.g. a copy of ~/.ray/auth_token) or unset RAY_AUTH_TOKEN_PATH, then `raytrain up` again"
        )
    ray = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, capture_output=True, timeout=60, check=True)


def _wait_ready(process: subprocess.Popen, log_path: Path, started: float) -> None:
    while time.time() - started < READY_TIMEOUT_S:
        text = log_path.read_text(errors="replace")
        if READY_LINE in text:
            return
        if process.poll() is not None:
            raise RunFailed(
                f"`ray start` exited with status {process.returncode}: {_tail(text)} (log: {log_path})"
                f"{_load_hint(text)}"
            )
        time.sleep(0.2)
    raise RunFailed(
        f"the Ray head did not start within {READY_TIMEOUT_S:.0f} s (log: {log_path}){_load_hint('timed out')}"
    )


def _load_hint(log_text: str) -> str:
    """Ray's own start-up timeouts ("node timed out during startup") come from a machine too
    busy to start its processes in time, not from a wrong setting: say so, and that a retry helps."""
    if "timed out" not in log_text.lower():
        return ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    busy = f" (load average {load:.1f} on {os.cpu_count()} CPUs)" if load is not None else ""
    return (
        f"; Ray's processes did not start in time, which a busy machine causes{busy}: "
        "run `raytrain up` again, ideally when the machine is less loaded"
    )


def _tail(text: str) -> str:
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-3:])[-400:] or "no output"


def _describe_started(pid: int, temp_dir: str, gcs: int, dashboard: int, num_cpus: int, log: Path) -> dict[str, Any]:
    """What a started head is: its processes (by the names Ray gives them), its address (the
    node address Ray bound, read from its log) and session directory."""
    import psutil

    pids = {"pid": pid}
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            line = " ".join(child.cmdline())
            for name, part in (
                ("gcs_server", "gcs_server"),
                ("raylet", "raylet/raylet"),
                ("dashboard", "dashboard.py"),
            ):
                if part in line and name not in pids:
                    pids[name] = child.pid
    node_ip = _node_ip(log.read_text(errors="replace")) or "127.0.0.1"
    session = Path(temp_dir) / "session_latest"
    return {
        "address": f"{node_ip}:{gcs}",
        "dashboard_url": f"http://127.0.0.1:{dashboard}",
        "num_cpus": num_cpus,
        "pids": {name: value for name, value in pids.items() if name != "pid"},
        "created": {name: create_time(value) for name, value in pids.items()},
        "session_dir": str(session.resolve()) if session.exists() else None,
        "log": str(log),
        # A joining driver must send the token (or not) as the head expects.
        "auth_mode": os.environ.get("RAY_AUTH_MODE") or "token",
        "auth_token_path": os.environ.get("RAY_AUTH_TOKEN_PATH"),
    }


def _node_ip(log_text: str) -> str | None:
    """The address `ray start --address=...` in the head's log names (Ray binds the node's
    address, not loopback: services.resolve_ip_for_localhost)."""
    import re

    found = re.search(r"ray start --address='([^':]+):\d+'", re.sub(r"\x1b\[[0-9;]*m", "", log_text))
    return found.group(1) if found else None


def stop_head(echo: Callable[[str], None]) -> int:
    """`raytrain down`: 0 when the recorded head is stopped (or none is recorded), 1 when some
    of its processes could not be ended."""
    path = head_file()
    record = read_record(path)
    if record is None:
        echo(f"raytrain: no local Ray head is recorded in {path}; nothing to stop")
        return 0
    if record["uid"] != os.getuid():
        raise UsageError(
            f"the local Ray head recorded in {path} belongs to user {record['user']!r}; only they can stop it"
        )
    started = time.monotonic()
    found = head_processes(record)
    left = stop_processes(record)
    if left:
        raise RunFailed(
            f"{len(left)} process(es) of the local Ray head could not be ended: {', '.join(map(str, left))}; "
            f"the record {path} is kept so that `raytrain down` can try again"
        )
    left_dir = remove_temp_dir(record)
    path.unlink(missing_ok=True)
    if not found:
        echo(
            f"raytrain: the local Ray head recorded in {path} ({record['address']}) was already gone; "
            f"record cleared{left_dir}"
        )
        return 0
    echo(
        f"raytrain: stopped the local Ray head at {record['address']} (pid {record['pid']}, {len(found)} processes) "
        f"in {time.monotonic() - started:.1f} s; runs start their own Ray again"
    )
    return 0
