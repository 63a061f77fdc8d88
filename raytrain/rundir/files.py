"""The run directory's files, written so that a crash or a full disk never leaves a broken one.

- `write_atomic` / `write_json` / `write_yaml`: a temporary file in the same directory,
  flushed and renamed over the target, so a reader sees the old file or the new one;
- `append_jsonl`: one JSON line per call (a torn last line is skipped by `read_jsonl`);
- JSON is strict: NaN and infinities become null (`strict`);
- `RunLock`: one run per name at a time, taken over from a dead holder;
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
from typing import Any, Iterator

import yaml

from raytrain.errors import StorageError

LOCK_FILE = ".lock"
STOP_FILE = ".stop"  # the driver asks the workers to stop (SIGINT/SIGTERM) with this file

_FIXES = {
    errno_codes.ENOSPC: "the file system is full: free space there or use another one (--storage)",
    errno_codes.EDQUOT: "the disk quota is exceeded: free space or use another file system (--storage)",
    errno_codes.EROFS: "that file system is read-only: use a writable directory (--storage)",
    errno_codes.EACCES: "no permission to write there: fix its permissions or use another directory",
    errno_codes.EPERM: "no permission to write there: fix its permissions or use another directory",
    errno_codes.ENAMETOOLONG: "the path is too long: choose a shorter name (--name, --storage)",
    errno_codes.ENOTDIR: "part of the path is a file, not a directory",
    errno_codes.EISDIR: "a directory is in the way of a file",
    errno_codes.ENOENT: "a directory on that path is missing and cannot be created there (a mount that went away?)",
}


def storage_error(exc: OSError, path: str | os.PathLike, doing: str) -> StorageError:
    """One message for an OSError: what, where, the errno and the fix."""
    code = exc.errno or 0
    name = errno_codes.errorcode.get(code, str(code))
    fix = _FIXES.get(code, "check the path and its file system")
    return StorageError(code, f"cannot {doing} {path}: {exc.strerror or exc} ({name}); {fix}")


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike, doing: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error(exc, getattr(exc, "filename", None) or path, doing) from None


def check_storage(storage: str | os.PathLike, run_dir: str | os.PathLike) -> None:
    """Before Ray starts: the run directory can be created and written (StorageError if not)."""
    storage, run_dir = Path(storage), Path(run_dir)
    if storage.exists() and not storage.is_dir():
        raise StorageError(
            errno_codes.ENOTDIR, f"--storage {storage} is a file, not a directory; point --storage at a directory"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise StorageError(
            errno_codes.ENOTDIR, f"run directory {run_dir} is a file, not a directory; choose another --name"
        )
    with storage_errors(run_dir, "create the run directory"):
        run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".write-test-{os.getpid()}"
    with storage_errors(run_dir, "write in the run directory"):
        probe.write_bytes(b"raytrain")
        probe.unlink()


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with storage_errors(path, "write"):
        try:
            with open(tmp, "wb") as handle:
                handle.write(text.encode() if isinstance(text, str) else text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


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
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


# -- one run per name -----------------------------------------------------------------------------


class RunLock:
    """`RUN_DIR/.lock`, created exclusively; held by this process until `release`.

    A lock whose holder is gone (a dead process on this host) is taken over. A lock held by
    a live process, or by a process on another host, is refused with who holds it.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        with storage_errors(self.path.parent, "create the run directory"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._wait_for_holder()
                if holder is None or self._alive(holder):
                    raise RunLocked(self.path.parent, holder or {}) from None
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()  # a stale lock: its process is gone
                continue
            except OSError as exc:
                raise storage_error(exc, self.path, "lock") from None
            with os.fdopen(fd, "w") as handle:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}, handle)
            self.held = True
            return
        raise RunLocked(self.path.parent, self.holder() or {})

    def release(self) -> None:
        if self.held:
            self.held = False
            with contextlib.suppress(OSError):
                if (self.holder() or {}).get("pid") == os.getpid():
                    self.path.unlink()

    def _wait_for_holder(self, wait_s: float = 2.0) -> dict[str, Any] | None:
        """The holder's record; a lock just created may not be written yet, so wait a moment
        (a lock that stays empty is held by a process that died writing it: stale, {})."""
        deadline = time.monotonic() + wait_s
        while True:
            holder = self.holder()
            if holder is not None:
                return holder
            try:
                age_s = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return {"pid": -1, "host": socket.gethostname()}  # released meanwhile: take it
            if age_s > wait_s or time.monotonic() > deadline:
                return {"pid": -1, "host": socket.gethostname()} if age_s > wait_s else None
            time.sleep(0.05)

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(holder: dict[str, Any]) -> bool:
        if holder.get("host") != socket.gethostname():
            return True  # another machine's process: cannot be checked from here
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


class RunLocked(StorageError):
    def __init__(self, run_dir: Path, holder: dict[str, Any]):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if holder.get("since") else "?"
        super().__init__(
            errno_codes.EBUSY,
            f"run {run_dir.name!r} in {run_dir.parent} is in use by process {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')} (since {since}); wait for it to end, stop it, or choose another --name",
        )


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from `path`, or {} if it is missing, torn or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
