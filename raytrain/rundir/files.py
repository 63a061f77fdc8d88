"""The run directory's files, written so that a crash or a full disk never leaves a broken one.

- `write_atomic` / `write_json` / `write_yaml`: a temporary file in the same directory,
  flushed and renamed over the target, so a reader sees the old file or the new one;
- `append_jsonl`: one JSON line per call (a torn last line is skipped by `read_jsonl`);
- JSON is strict: NaN and infinities become null (`strict`);
- `RunLock`: one run per name at a time, taken over from a dead holder on this host, hosts told
  apart by `raytrain.rundir.host.host_id` (on an object store through a conditional create:
  `raytrain.rundir.storage`);
- every OSError becomes a `StorageError` naming the path and the errno, with what to do.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from raytrain.errors import StorageError
from raytrain.rundir.faults import storage_errors
from raytrain.rundir.host import host_id
from raytrain.rundir.storage import Store

LOCK_FILE = ".lock"
STOP_FILE = ".stop"  # the driver asks the workers to stop (SIGINT/SIGTERM) with this file


def strict(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None, for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    return json.dumps(strict(value), allow_nan=False, **kwargs)


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Replace `path` with `text` in one rename: readers see the old file or the new one."""
    path = Path(path)
    Store.of(path.parent).write_bytes(path.name, text.encode() if isinstance(text, str) else text)


def write_json(path: str | os.PathLike, value: Any) -> None:
    write_atomic(path, dumps(value, indent=2) + "\n")


def write_yaml(path: str | os.PathLike, values: dict[str, Any]) -> None:
    write_atomic(path, yaml.safe_dump(values, sort_keys=False))


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    with storage_errors(path, "append to"), open(path, "a") as handle:
        handle.write(dumps(record) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete JSON line (a torn or foreign line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    return parse_jsonl(path.read_text(errors="replace"))


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """Every complete JSON object of JSONL `text` (a torn or foreign line is skipped)."""
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


# -- one run per name -----------------------------------------------------------------------------


class RunLock:
    """`RUN_DIR/.lock`, created exclusively (`Store.create_exclusive`: O_EXCL on a file system,
    a conditional write on S3); held by this process until `release`.

    A lock whose holder is gone (a dead process on this host) is taken over. A lock held by
    a live process, or by a process on another host, is refused with who holds it. "This host"
    is `host_id`, never the hostname: hosts that share one (containers, cloned images, network
    namespaces) would each find the other's pid dead and take a live run's lock.
    """

    def __init__(self, run_dir: "str | os.PathLike | Store"):
        self.store = Store.of(run_dir)
        self.path = self.store / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        self.store.make_dir()
        for _ in range(3):
            record = json.dumps(self_record() | {"since": time.time()})
            if self.store.create_exclusive(LOCK_FILE, record.encode()):
                self.held = True
                return
            holder = self._wait_for_holder()
            if holder is None or self._alive(holder):
                raise RunLocked(self.store, holder or {})
            self.store.delete(LOCK_FILE)  # a stale lock: its process is gone
        raise RunLocked(self.store, self.holder() or {})

    def release(self) -> None:
        if self.held:
            self.held = False
            with contextlib.suppress(OSError):
                if (self.holder() or {}).get("pid") == os.getpid():
                    self.store.delete(LOCK_FILE)

    def _wait_for_holder(self, wait_s: float = 2.0) -> dict[str, Any] | None:
        """The holder's record; a lock just created may not be written yet, so wait a moment
        (a lock that stays empty is held by a process that died writing it: stale, {})."""
        deadline = time.monotonic() + wait_s
        while True:
            holder = self.holder()
            if holder is not None:
                return holder
            info = self.store.info(LOCK_FILE)
            if info.type.name == "NotFound":
                return self_record(pid=-1)  # released meanwhile: take it
            age_s = time.time() - info.mtime.timestamp() if info.mtime is not None else 0.0
            if age_s > wait_s or time.monotonic() > deadline:
                return self_record(pid=-1) if age_s > wait_s else None
            time.sleep(0.05)

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.store.read_text(LOCK_FILE))
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(holder: dict[str, Any]) -> bool:
        if holder.get("host_id") != host_id():
            # Another host's process (or a lock of an older raytrain, which recorded no host_id):
            # its pid means nothing here.
            return True
        pid = holder.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def self_record(pid: int | None = None) -> dict[str, Any]:
    """A lock record naming this process (or `pid`) on this host: the hostname for messages,
    `host_id` for deciding whether the pid can be checked here."""
    return {"pid": os.getpid() if pid is None else pid, "host": socket.gethostname(), "host_id": host_id()}


def holder_place(holder: dict[str, Any], hostname: str, here: str) -> str:
    """Where a lock's holder runs, in words, for a user on host `hostname` (`host_id` `here`)."""
    host = holder.get("host", "?")
    if holder.get("host_id") == here:
        return host
    if "pid" in holder and "host_id" not in holder:
        return f"{host} (a lock of an older raytrain, which recorded no host identity: it cannot be checked from here)"
    if host == hostname:
        # The same name, yet not this host: say so, or the user looks for the process here.
        return f"another host named {host} (same hostname, different machine, container or network namespace)"
    return host


class RunLocked(StorageError):
    def __init__(self, run_dir: "Store", holder: dict[str, Any]):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if holder.get("since") else "?"
        # A holder on another host cannot be checked from here (a dead one on this host is taken over).
        elsewhere = holder.get("host_id") != host_id()
        remove = f"; a holder that is gone for good leaves {run_dir}/{LOCK_FILE}: delete it" if elsewhere else ""
        place = holder_place(holder, socket.gethostname(), host_id())
        super().__init__(
            errno_codes.EBUSY,
            f"run {run_dir.name!r} in {run_dir.parent} is in use by process {holder.get('pid', '?')} since {since} "
            f"on {place}; wait for it to end, stop it, or choose another --name{remove}",
        )


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from `path`, or {} if it is missing, torn or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
