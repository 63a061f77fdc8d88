"""Per-rank heartbeats: what each rank was doing when a collective timed out.

Each rank records its step and phase in memory (cheap, every phase change); a daemon
thread writes them to RUN_DIR/heartbeats/rank<N>.json every few seconds. When a
collective times out on one rank, that rank reads every heartbeat and names the
ranks that stopped making progress, and where. Needs the run directory on storage all
nodes see (as checkpoints do).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

# Phases in which a rank waits on the others: a rank found here is a victim of a stall,
# not its cause.
COLLECTIVE_PHASES = {"backward", "all_reduce", "report"}
PHASE_ORDER = ["data", "forward", "backward", "optimizer", "all_reduce", "eval", "report"]


class Heartbeat:
    def __init__(self, directory: Path, rank: int, interval_s: float = 2.0, enabled: bool = True):
        self.path = directory / f"rank{rank}.json"
        self.rank = rank
        self.step = 0
        self.phase = "start"
        self.phase_since = time.time()
        self.attempt_start = self.phase_since
        self.interval_s = interval_s
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
            "pid": os.getpid(),
        }

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


def diagnose(records: dict[int, dict], world_size: int, now: float) -> str:
    """Name the stalled ranks: those furthest behind, outside a collective, or silent."""
    lines = []
    missing = [r for r in range(world_size) if r not in records]
    if missing:
        lines.append(f"no heartbeat from rank(s) {', '.join(map(str, missing))} (process dead or storage not shared)")
    silent = [r for r, rec in records.items() if now - rec["time"] > 30]
    position = {
        r: (rec["step"], PHASE_ORDER.index(rec["phase"]) if rec["phase"] in PHASE_ORDER else -1)
        for r, rec in records.items()
    }
    behind = min(position.values()) if position else None
    stalled = sorted(
        r
        for r, rec in records.items()
        if r in silent or (position[r] == behind and rec["phase"] not in COLLECTIVE_PHASES)
    )
    if not stalled and records:
        stalled = sorted(r for r in records if position[r] == behind)
    for rank in sorted(records):
        rec = records[rank]
        state = "STALLED" if rank in stalled else "waiting"
        lines.append(
            f"rank {rank} ({state}): step {rec['step']}, in {rec['phase']} for {now - rec['phase_since']:.0f} s"
            + (f", heartbeat silent {now - rec['time']:.0f} s" if rank in silent else "")
        )
    head = f"stalled rank(s): {', '.join(map(str, stalled))}" if stalled else "no rank could be singled out"
    return head + "\n  " + "\n  ".join(lines)


def looks_like_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timeout" in text or "timed out" in text
