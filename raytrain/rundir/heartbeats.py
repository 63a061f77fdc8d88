"""Per-rank heartbeats, files of the run directory: what each rank was doing when a collective
timed out.

Each rank records its step and phase in memory (cheap, every phase change); a daemon
thread writes them to RUN_DIR/heartbeats/rank<N>.json every few seconds. When a
collective times out on one rank, that rank reads every heartbeat (`read_heartbeats`) and
names the ranks that stopped making progress, and where (`raytrain.rules.stall.diagnose`).
Needs the run directory on storage all nodes see (as checkpoints do). A record names its host by
hostname, `host_id` (`raytrain.rundir.host`: hosts may share a hostname) and, when the caller
knows it, its Ray node (`node`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from raytrain.rundir.host import host_id


class Heartbeat:
    def __init__(
        self, directory: Path, rank: int, interval_s: float = 2.0, enabled: bool = True, node: str | None = None
    ):
        """`node`: this worker's Ray node (its id or address), recorded to tell apart hosts that
        share a hostname."""
        self.path = directory / f"rank{rank}.json"
        self.rank = rank
        self.step = 0
        self.phase = "start"
        self.phase_since = time.time()
        self.attempt_start = self.phase_since
        self.interval_s = interval_s
        self.node = node
        self._stop = threading.Event()
        self._thread = None
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name=f"raytrain-heartbeat-{rank}", daemon=True)
            self._thread.start()

    def mark(self, step: int, phase: str) -> None:
        if phase != self.phase or step != self.step:
            self.step, self.phase, self.phase_since = step, phase, time.time()

    def _record(self) -> dict:
        return {
            "rank": self.rank,
            "step": self.step,
            "phase": self.phase,
            "phase_since": self.phase_since,
            "attempt_start": self.attempt_start,
            "time": time.time(),
            "host": socket.gethostname(),
            "host_id": host_id(),
            "pid": os.getpid(),
        } | ({"node": self.node} if self.node is not None else {})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self._record()))
            os.replace(tmp, self.path)
        except OSError:  # storage hiccups must never kill training
            pass

    def stop(self) -> None:
        self._stop.set()


def read_heartbeats(directory: Path, world_size: int, since: float) -> dict[int, dict]:
    """Heartbeats of ranks 0..world_size-1 written during the current attempt."""
    found = {}
    for rank in range(world_size):
        try:
            record = json.loads((directory / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue
        if record.get("attempt_start", 0) >= since - 60:
            found[rank] = record
    return found


def read_last_attempt(directory: Path) -> dict[int, dict]:
    """Every rank's heartbeat of the latest attempt, for a reader that does not know the world
    size (the driver, after a worker died): the ranks whose attempt started within a minute of
    the newest one."""
    found = {}
    for path in directory.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
            found[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not found:
        return {}
    newest = max(record.get("attempt_start", 0) for record in found.values())
    return {rank: record for rank, record in found.items() if record.get("attempt_start", 0) >= newest - 60}
