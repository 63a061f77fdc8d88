"""The run directory's files, written so that a crash or a full disk never leaves a broken one.

- `write_atomic` / `write_json` / `write_yaml`: a temporary file in the same directory,
  flushed and renamed over the target, so a reader sees the old file or the new one;
- JSONL: a torn or foreign line is skipped by `read_jsonl`;
- JSON is strict: NaN and infinities become null (`strict`);
- `RunLock`: one run per name at a time; the driver's lock names it (`owner`) and is never
  rewritten: the driver refreshes a beat file of its own beside it (`beat_name`), so a driver
  that lost the lock touches nothing the next holder reads;
- `DriverWatch`: a worker's look at that lock and its owner's beat (`DriverGone`);
- every OSError becomes a `StorageError` naming the path and the errno, with what to do.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import json
import math
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import yaml

from raytrain.errors import EXIT_FAILED, StorageError, UserError
from raytrain.rules import resume
from raytrain.rundir.faults import retry_window_s, storage_error
from raytrain.rundir.host import host_id
from raytrain.rundir.storage import Store

LOCK_FILE = ".lock"
LOCK_BEAT_S = 10.0  # how often a driver refreshes its beat, for workers that cannot check its pid
LOCK_MAX_BYTES = 1024  # a lock's record is about 200 bytes: more is not one, and is not read
PID_MAX = 2**31 - 1  # a pid is a C int: os.kill refuses a larger one
LATEST_TIME_S = 253_402_300_799  # 9999-12-31: the last moment time.localtime can show
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


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete JSON line (a torn or foreign line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    return parse_jsonl(path.read_text(errors="replace"))


def parse_jsonl(text: str | Iterable[bytes]) -> list[dict[str, Any]]:
    """Every complete JSON object of JSONL `text`, or of its lines (a torn or foreign line is skipped)."""
    rows = []
    for line in text.splitlines() if isinstance(text, str) else text:
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


# -- one run per name -----------------------------------------------------------------------------


class RunLock:
    """`RUN_DIR/.lock`, created exclusively (`Store.create_exclusive`: O_EXCL on a file system,
    a conditional write on S3); held by this process until `release`.

    A lock whose holder is gone (a dead process on this host) is taken over (`taken_over`: its
    record). A lock held by a live process, or by a process on another host, is refused with who
    holds it; one whose record cannot be read whole is refused as such (`LockUnreadable`). "This
    host" is `host_id`, never the hostname: hosts that share one (containers, cloned images,
    network namespaces) would each find the other's pid dead and take a live run's lock.
    `owner`: the driver's id, which its workers compare with the lock's (`DriverWatch`);
    `beat_s`: write the owner's beat file (`beat_name`) this often while held, for workers on
    other hosts; `echo` hears once that beats have failed for 3 periods (workers may stop).
    """

    def __init__(
        self, run_dir: "str | os.PathLike | Store", owner: str = "", beat_s: float | None = None, echo: Any = None
    ):
        self.store = Store.of(run_dir)
        self.path = self.store / LOCK_FILE
        self.held = False
        self.owner, self.beat_s, self.echo = owner, beat_s, echo
        self.taken_over: dict[str, Any] | None = None
        self._stop_beating = threading.Event()
        self._beating: threading.Thread | None = None

    def acquire(self) -> None:
        self.store.make_dir()
        for _ in range(3):
            record = self_record() | {"since": time.time(), "owner": self.owner}
            if self.store.create_exclusive(LOCK_FILE, json.dumps(record).encode()):
                self.held = True
                if self.beat_s:
                    self._beating = threading.Thread(target=self._beat, daemon=True)
                    self._beating.start()
                return
            holder = self._wait_for_holder()
            if holder == {}:  # released meanwhile: create it again (deleting could remove a new holder's)
                continue
            if holder is None or self._alive(holder):
                raise RunLocked(self.store, holder or {})
            if holder.get("pid", -1) > 0 or "empty_s" in holder:
                self.taken_over = holder
            self.store.delete(LOCK_FILE)  # a stale lock: its process is gone
            if holder.get("owner"):
                self.store.delete(beat_name(holder["owner"]))
        raise RunLocked(self.store, self.holder() or {})

    def release(self) -> None:
        if self.held:
            self.held = False
            self._stop_beating.set()
            if self._beating is not None:
                self._beating.join()
            with contextlib.suppress(OSError, LockUnreadable):
                if self.owner:
                    self.store.delete(beat_name(self.owner))
                holder = self.holder() or {}
                # Read, compare, delete: a lock deleted by hand and taken by another driver between
                # this read and the delete (one request) is still lost; the lock is never rewritten,
                # so nothing else of this driver's can touch another's.
                if holder.get("pid") == os.getpid() and holder.get("owner", "") == self.owner:
                    self.store.delete(LOCK_FILE)

    def _beat(self) -> None:
        """Write this driver's beat file (never the lock: a lock taken from it stays the taker's);
        a missed beat is not an error, but beats failing for 3 periods are said once."""
        last_ok, said = time.monotonic(), False
        while not self._stop_beating.wait(self.beat_s):
            try:
                self.store.write_text(beat_name(self.owner), json.dumps(time.time()))
                last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the next beat may pass
                failing_s = time.monotonic() - last_ok
                if not said and failing_s > 3 * self.beat_s and self.echo is not None:
                    said = True
                    self.echo(
                        f"raytrain: this driver could not refresh its beat {self.store / beat_name(self.owner)} for "
                        f"{failing_s:.0f} s ({str(exc)[:200]}); workers on other hosts stop once it has not moved "
                        f"for {resume.driver_silent_limit_s(retry_window_s(self.store)):.0f} s"
                    )

    def _wait_for_holder(self, wait_s: float = 2.0) -> dict[str, Any] | None:
        """The holder's record ({}: the lock is gone); one just created may not be written yet, so
        wait a moment (a lock that stays empty is held by a process that died writing it: stale,
        `empty_s` its age). One written but not understood is refused (`LockUnreadable`), never taken over; one
        that cannot be read is a StorageError (`lock_text`), never taken for stale."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                text = lock_text(self.store)
            except FileNotFoundError:
                return {}  # released meanwhile
            if text.strip():
                try:
                    return parse_lock(text)
                except ValueError as problem:
                    raise LockUnreadable(self.store, str(problem)) from None
            info = self.store.info(LOCK_FILE)
            if info.type.name == "NotFound":
                return {}
            age_s = time.time() - info.mtime.timestamp() if info.mtime is not None else 0.0
            if age_s > wait_s or time.monotonic() > deadline:
                return self_record(pid=-1) | {"host": "?", "empty_s": age_s} if age_s > wait_s else None
            time.sleep(0.05)

    def holder(self) -> dict[str, Any] | None:
        """The lock's record (None: no lock, or one not written yet); LockUnreadable when it
        holds something that is not a lock's record."""
        try:
            text = lock_text(self.store)
        except FileNotFoundError:
            return None
        if not text.strip():
            return None
        try:
            return parse_lock(text)
        except ValueError as problem:
            raise LockUnreadable(self.store, str(problem)) from None

    @staticmethod
    def _alive(holder: dict[str, Any]) -> bool:
        if holder.get("host_id") != host_id():
            # Another host's process (or a lock of an older raytrain, which recorded no host_id):
            # its pid means nothing here.
            return True
        return pid_alive(holder.get("pid", -1))


def lock_text(store: Store) -> str:
    """The lock file's text, LOCK_MAX_BYTES at most (FileNotFoundError: there is none). One
    larger, or a directory, is `LockUnreadable`; any other error a StorageError naming the path."""
    try:
        data = store.read_range(LOCK_FILE, 0, LOCK_MAX_BYTES + 1)
    except (FileNotFoundError, StorageError):
        raise
    except IsADirectoryError:
        raise LockUnreadable(store, "it is a directory, not a lock's file") from None
    except OSError as exc:
        raise storage_error(exc, store / LOCK_FILE, "read the run's lock") from None
    if len(data) > LOCK_MAX_BYTES:
        raise LockUnreadable(store, f"it holds more than {LOCK_MAX_BYTES} bytes, and a lock's record is smaller")
    return data.decode(errors="replace")


def beat_name(owner: str) -> str:
    """The beat file of the driver `owner`, beside the lock: it holds the time of its last beat."""
    return f"{LOCK_FILE}.beat-{owner}"


def read_beat(store: Store, owner: str) -> float | None:
    """The last beat of driver `owner` (None: none yet, or not a time); an OSError when unreadable."""
    try:
        beat = json.loads(store.read_text(beat_name(owner)))
    except (FileNotFoundError, ValueError):
        return None
    return float(beat) if isinstance(beat, (int, float)) and not isinstance(beat, bool) else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host lives (a zombie, ended but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    return True


def parse_lock(text: str) -> dict[str, Any]:
    """A lock file's record, every field checked before it is used: `pid` a process id, `since` a
    time a clock can show, `host`, `host_id` and `owner` strings, `owner` one that can name a file
    (`beat_name`). ValueError saying
    what is wrong otherwise (not JSON, not an object, a field missing or out of range)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"it is not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("it is not JSON (nested too deep to read)") from None
    if not isinstance(value, dict):
        kinds = {list: "a list", str: "a string", bool: "true or false", type(None): "null"}
        raise ValueError(f"it holds {kinds.get(type(value), 'a number')}, not an object with the holder's pid")
    pid = value.get("pid")
    if pid is None:
        raise ValueError("it names no process (no pid)")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX:
        raise ValueError(f"its pid {json.dumps(pid)[:40]} is not a process id (a whole number from 1 to {PID_MAX})")
    when = value.get("since")
    if when is not None and (
        isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when <= LATEST_TIME_S
    ):
        raise ValueError(f"its since {json.dumps(when)[:40]} is not a time (seconds since 1970, up to year 9999)")
    for key in ("host", "host_id", "owner"):
        if key in value and not isinstance(value[key], str):
            raise ValueError(f"its {key} {json.dumps(value[key])[:40]} is not a string")
    if not re.fullmatch(r"[0-9A-Za-z_-]{0,64}", value.get("owner", "")):
        raise ValueError(f"its owner {json.dumps(value['owner'])[:40]} is not a driver's id (letters and digits)")
    return value


class DriverGone(UserError):
    """This attempt's driver no longer holds the run (ended, or another driver took it over): the
    attempt ends without writing more, never retried (a resume owns the run directory now)."""

    exit_status = EXIT_FAILED


class DriverWatch:
    """A worker's look at the driver that started it (`owner`: the id its lock carries): why it
    no longer holds the run (`raytrain.rules.resume.driver_gone`), or None; `on_gone` is called
    with the reason once it is found. Its driver's beat is timed on this worker's own clock
    (hosts' clocks may differ), from when each read started: a read held up by a storage outage
    does not age the beat, and the silence allowed outlasts the store's retries
    (`raytrain.rules.resume.driver_silent_limit_s`)."""

    def __init__(self, store: Store, owner: str, on_gone: Any = None):
        self.store, self.owner, self.on_gone = store, owner, on_gone
        self.beat: Any = None
        self.beat_seen = time.monotonic()  # when a read that saw the beat change started
        self.silent_limit_s = resume.driver_silent_limit_s(retry_window_s(store))

    def why_gone(self) -> str | None:
        if not self.owner:
            return None
        started = time.monotonic()
        try:
            try:
                holder = parse_lock(lock_text(self.store))
            except (LockUnreadable, ValueError):  # read half-written, or replaced by hand: the beat decides
                holder = {"owner": self.owner}
            beat = read_beat(self.store, self.owner) if holder.get("owner") == self.owner else None
        except FileNotFoundError:
            holder, beat = None, None
        except OSError:
            return None  # not read this time: no evidence either way
        if holder is not None and beat != self.beat:
            self.beat, self.beat_seen = beat, started
        here = holder is not None and holder.get("host_id") == host_id()
        alive = pid_alive(holder["pid"]) if holder is not None and here else None
        silent_s, limit_s = started - self.beat_seen, self.silent_limit_s
        why = resume.driver_gone(
            holder, self.owner, same_host=here, pid_alive=alive, silent_s=silent_s, limit_s=limit_s
        )
        if why is not None and self.on_gone is not None:
            self.on_gone(why)
        return why

    def check(self) -> None:
        """DriverGone, before a write that a run held by another driver must not see."""
        why = self.why_gone()
        if why is not None:
            raise DriverGone(f"{why}; this attempt stops without writing more to {self.store}")


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
        since = when(holder["since"]) if holder.get("since") else "?"
        # A holder on another host cannot be checked from here (a dead one on this host is taken over).
        elsewhere = holder.get("host_id") != host_id()
        remove = f"; a holder that is gone for good leaves {run_dir}/{LOCK_FILE}: delete it" if elsewhere else ""
        place = holder_place(holder, socket.gethostname(), host_id())
        beat = ""  # how a user tells from here whether a holder on another host lives
        with contextlib.suppress(OSError, ValueError):
            last = read_beat(run_dir, holder["owner"]) if holder.get("owner") else None
            ago = f"its last beat {max(0.0, time.time() - last):.0f} s ago" if last is not None else "no beat yet"
            beat = f" ({ago}; it beats every {LOCK_BEAT_S:.0f} s)" if holder.get("owner") else ""
        super().__init__(
            errno_codes.EBUSY,
            f"run {run_dir.name!r} in {run_dir.parent} is in use by process {holder.get('pid', '?')} since {since} "
            f"on {place}{beat}; wait for it to end, stop it, or choose another --name{remove}",
        )


class LockUnreadable(StorageError):
    """A lock file that is not a lock's record: named with what is wrong and the fix, never
    taken over (the run it guards may be live)."""

    def __init__(self, run_dir: "Store", problem: str):
        path = f"{run_dir}/{LOCK_FILE}"
        super().__init__(
            errno_codes.EBUSY,
            f"run {run_dir.name!r} in {run_dir.parent} has a lock file that cannot be read: {path}: {problem}. "
            f"raytrain neither trusts nor takes over such a lock. Make sure no run of this name is running (no "
            f"`raytrain train ... --name {run_dir.name}` on any host that uses this storage: `pgrep -af -- "
            f"'--name[= ]{run_dir.name}'` on each), then delete {path} and run again",
        )


def when(seconds: float) -> str:
    """A time.time() as local time, in a message."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def takeover_line(run_dir: "Store", holder: dict[str, Any]) -> str:
    """What a driver says when it took the run over from an ended one, whose workers may still run
    (`empty_s`: a lock left empty, by a driver that died writing it)."""
    since = f" since {when(holder['since'])}" if holder.get("since") else ""
    if "empty_s" in holder:
        held = f"had an empty lock, {holder['empty_s']:.0f} s old, left by a driver that died writing it"
    else:
        held = f"was held by process {holder.get('pid', '?')} on {holder.get('host', '?')}{since}, which has ended"
    return (
        f"raytrain: run {run_dir.name!r} {held}; its workers, if any still run, are fenced: this run's lock names "
        "another driver, so they stop at their next sync and publish no checkpoint"
    )
