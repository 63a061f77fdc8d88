"""What of the head a record names is provably its own, and ending it (`raytrain down`, and a
run clearing a stale record): its processes (`head_processes`, `stop_processes`) and its temp
dir (`temp_dir_is_heads`, `remove_temp_dir`). A record can outlive its head: after a reboot or
a crash its pid may name someone else's process, and a record not written by `up` may name any
directory. So a process counts only by the marker in its environment, by the session of a
leader that is still the recorded process (pid and start time), or by a temp dir proven the
head's by the file `up` wrote in it; nothing else is ended or deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from raytrain.rules.head import TEMP_DIR_PREFIX, TEMP_DIR_PROOF

# Every process of a head carries this variable (inherited from `ray start`): how `down` finds
# the ones that left its process group, with the record's own value.
MARKER_ENV = "RAYTRAIN_HEAD_MARKER"
STOP_GRACE_S = 5.0  # after SIGTERM; an idle head has nothing to drain, so then SIGKILL


def create_time(pid: int) -> float | None:
    import psutil

    with contextlib.suppress(psutil.Error, ValueError):
        return psutil.Process(pid).create_time()
    return None


def process_uid(pid: int) -> int | None:
    import psutil

    with contextlib.suppress(psutil.Error, ValueError):
        return psutil.Process(pid).uids().real
    return None


def same_process(pid: int | None, created: float | None) -> bool:
    """Whether `pid` still is the process recorded (not a new one that reuses the number)."""
    now = create_time(pid) if pid else None
    return now is not None and created is not None and abs(now - created) < 1.0


def temp_dir_is_heads(record: dict[str, Any]) -> bool:
    """Whether the record's temp dir is provably the one `up` made for this head: a real
    directory (not a link) of this user, shaped rthead-*, holding the proof file with the
    record's marker. Nothing else is ever deleted or used to match processes."""
    import stat

    temp_dir = Path(record["temp_dir"])
    try:
        info = temp_dir.lstat()
        proof = (temp_dir / TEMP_DIR_PROOF).read_text().strip()
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and temp_dir.name.startswith(TEMP_DIR_PREFIX)
        and proof == record["marker"]
    )


def remove_temp_dir(record: dict[str, Any]) -> str:
    """Delete the head's temp dir when it is provably the head's; what was done, for the user."""
    if temp_dir_is_heads(record):
        shutil.rmtree(record["temp_dir"], ignore_errors=True)
        return ""
    if not os.path.lexists(record["temp_dir"]):
        return ""
    return f" ({record['temp_dir']} left in place: it is not provably the head's temp dir)"


def head_processes(record: dict[str, Any]) -> list[int]:
    """Live processes that are provably the recorded head's, and their descendants:
    - carrying its marker in the environment (every process of a head inherits it from `ray start`);
    - in the session its `ray start` leads, when that leader is still the process recorded
      (same pid and start time: a reused pid leads someone else's session);
    - naming its temp dir on the command line, when that dir is provably the head's.
    Never this process, its ancestors or pid 1."""
    import psutil

    leader, marker, temp_dir = record["pid"], record["marker"], record["temp_dir"]
    leader_is_heads = same_process(leader, record.get("created", {}).get("pid"))
    temp_dir_heads = temp_dir_is_heads(record)
    since = record.get("started_at", 0) - 1
    spared = {1, os.getpid(), *(parent.pid for parent in psutil.Process().parents())}
    table: dict[int, int] = {}
    ours: set[int] = set()
    for process in psutil.process_iter(["pid", "ppid", "cmdline", "create_time", "status"]):
        info = process.info
        if info["pid"] in spared or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        table[info["pid"]] = info["ppid"]
        with contextlib.suppress(OSError, psutil.Error):
            if leader_is_heads and os.getsid(info["pid"]) == leader and (info["create_time"] or 0) >= since:
                ours.add(info["pid"])
                continue
        if temp_dir_heads and temp_dir in " ".join(info["cmdline"] or ()):
            ours.add(info["pid"])
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if process.environ().get(MARKER_ENV) == marker:
                ours.add(info["pid"])
    while more := {pid for pid, parent in table.items() if parent in ours} - ours - spared:  # descendants
        ours |= more
    return sorted(ours)


def stop_processes(record: dict[str, Any]) -> list[int]:
    """SIGTERM the head's process group and every process of it, then SIGKILL what is left
    after a short grace. Returns the pids that could not be ended."""
    left = head_processes(record)
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        if not left:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if record["pid"] in left and same_process(record["pid"], record.get("created", {}).get("pid")):
                os.killpg(record["pid"], sig)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = head_processes(record)
    return left
