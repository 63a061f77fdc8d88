"""A preemption notice: this worker's node will be taken away, or this worker was asked to end.

Two ways a reclaim announces itself before it happens:

- Ray's drain of the node (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
  --deadline-remaining-seconds N`, what autoscaler v2 asks for a spot reclaim and what a
  KubeRay `preStop` hook can ask, docs/cluster.md). It kills nothing: the caller does, at the
  deadline. On each node one worker (the first to take its lock) polls the GCS's draining nodes for its
  node once a second (one small call; Ray Train's own watcher, which raytrain turns off, polls
  every 5 s), and at a notice every worker asks once for its own (`NoticeBoard.poll_now`): a
  node goes whole;
- SIGTERM to the worker process (Kubernetes' pod termination, before its SIGKILL). The handler
  is installed in each worker's main thread, where raytrain's torch backend binds the interfaces
  (`raytrain.worker.network`); it notes the notice instead of ending the process, and a second
  SIGTERM ends it as Ray's own handler would.

The notice is read where the ranks already sync (`raytrain.instruments.window.sync`, each rank's
`slots`): no collective is added to a step; one more, at the notice, shares what the other ranks
then know (`raytrain.instruments.watch.Watch.on_notice`). What the run does with it is its fault-tolerance mode's
(`raytrain.faults.restart.Eviction.leave`).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

POLL_S = 1.0
DRAIN, SIGTERM = "drain", "SIGTERM"  # what gave a notice
# A notice without a deadline, as a collective carries it: float32 (per-step on a GPU) holds it
# and it plus one exactly.
NO_DEADLINE_S = 1e6
# What a SIGTERM leaves before the SIGKILL, unless RAYTRAIN_SIGTERM_GRACE_S says: Kubernetes'
# default terminationGracePeriodSeconds.
SIGTERM_GRACE_ENV = "RAYTRAIN_SIGTERM_GRACE_S"
DEFAULT_SIGTERM_GRACE_S = 30.0


@dataclass(frozen=True)
class Notice:
    """What announced the end: `source` ("drain" or "SIGTERM") and when the node or process is gone
    (`deadline`, a time.time(); inf: not said)."""

    source: str
    deadline: float

    def seconds_left(self, now: float) -> float:
        return max(0.0, self.deadline - now)


class Leaving(NamedTuple):
    """A rank's notice as the ranks share it: what gave it and the seconds it had left then (inf: no
    deadline), the same on every rank."""

    source: str
    seconds_left: float


def slots(notice: Notice | None, rank: int, world: int, now: float) -> list[float]:
    """A rank's share of a sum over `world` ranks: its notice's seconds left + 1, capped, negative
    for SIGTERM, in its own slot (a slot left 0 is a rank with none)."""
    shared = [0.0] * world
    if notice is not None:
        left = min(notice.seconds_left(now), NO_DEADLINE_S) + 1.0
        shared[rank] = -left if notice.source == SIGTERM else left
    return shared


def leaving(summed: list[float]) -> dict[int, Leaving]:
    """The ranks with a notice, from `slots` summed over the ranks."""
    return {
        rank: Leaving(
            SIGTERM if value < 0 else DRAIN, math.inf if abs(value) - 1.0 >= NO_DEADLINE_S else abs(value) - 1.0
        )
        for rank, value in enumerate(summed)
        if value != 0
    }


class NoticeBoard:
    """This process's notice (None: none), posted by the drain poll or the SIGTERM handler, read at
    each sync."""

    def __init__(self) -> None:
        self.notice: Notice | None = None
        self._polling: threading.Thread | None = None
        self._ray_handler: Any = None
        self._sigterms = 0
        self._asked: Callable[[], None] | None = None  # one look at this node's drain (`poll_now`)

    def post(self, notice: Notice) -> None:
        """The earliest deadline wins."""
        if self.notice is None or notice.deadline < self.notice.deadline:
            self.notice = notice

    def watch_drain(
        self, node_id: str, draining: Callable[[], dict[str, int]], poll: bool = True, poll_s: float = POLL_S
    ) -> None:
        """Look at `draining()` ({node id: deadline in ms, 0: none}, Ray's GCS) for `node_id` when asked
        (`poll_now`) and, with `poll`, every `poll_s` in a thread of its own (started once)."""

        def ask() -> None:
            try:
                deadline_ms = draining().get(node_id)
            except Exception:  # noqa: BLE001 - the GCS unreachable a moment: asked again
                return
            if deadline_ms is not None:
                self.post(Notice(DRAIN, deadline_ms / 1000 if deadline_ms else math.inf))

        def polling() -> None:
            while True:
                ask()
                time.sleep(poll_s)

        self._asked = ask
        if poll and self._polling is None:
            self._polling = threading.Thread(target=polling, name="raytrain-drain-notice", daemon=True)
            self._polling.start()

    def poll_now(self) -> None:
        """One look at this node's drain now (nothing outside a Ray Train worker)."""
        if self._asked is not None:
            self._asked()

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterms += 1
        if self._sigterms > 1:  # asked twice: end now, as Ray would
            if callable(self._ray_handler):
                self._ray_handler(signum, frame)
                return
            raise SystemExit(128 + signum)
        self.post(Notice(SIGTERM, time.time() + sigterm_grace_s(os.environ)))

    def catch_sigterm(self) -> None:
        """In the process's main thread: SIGTERM posts a notice (see the module's docstring)."""
        previous = signal.getsignal(signal.SIGTERM)
        if previous != self.on_sigterm:
            self._ray_handler = previous
            signal.signal(signal.SIGTERM, self.on_sigterm)


def sigterm_grace_s(environ: Any) -> float:
    """The seconds a SIGTERM leaves (RAYTRAIN_SIGTERM_GRACE_S, else Kubernetes' default 30)."""
    try:
        return max(0.0, float(environ.get(SIGTERM_GRACE_ENV, DEFAULT_SIGTERM_GRACE_S)))
    except ValueError:
        return DEFAULT_SIGTERM_GRACE_S


def checkpoint_fits(seconds_left: float, save_s: float | None) -> bool:
    """Whether a checkpoint saved now is written before the deadline: twice the slowest save so far
    and a second to spare (`save_s`; None: none saved yet, and a first save is tried)."""
    return save_s is None or seconds_left >= 2 * save_s + 1.0


def notice_line(
    ranks: list[int], hosts: list[str], seconds_left: float, step: int, saves: bool, checkpoints_first: bool,
    save_s: float | None,
) -> str:  # fmt: skip
    """The event line of a preemption notice seen at the sync after `step`."""
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (host {', '.join(hosts)})"
    when = "no deadline given" if math.isinf(seconds_left) else f"{seconds_left:.0f} s before the deadline"
    if not checkpoints_first:
        then = "their replica group leaves at the next step's start, and the others train on without a rollback"
    elif saves:
        then = f"checkpointed at step {step}, the run restarts without that node: no step is lost or taken twice"
    else:
        then = (
            f"too little time to checkpoint (the slowest save took {save_s:.1f} s): the run restarts without that "
            "node from its last checkpoint"
        )
    return f"Preemption notice for {who}, {when}: {then}"


BOARD = NoticeBoard()  # the process's; a Ray Train worker runs one rank


def catch_notices() -> None:
    """On a Ray Train worker, in its main thread (the backend's `execute`): SIGTERM and this node's
    drain post notices to `BOARD` (the drain polled by the node's first worker)."""
    import ray
    from ray._private.state import state

    BOARD.catch_sigterm()
    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    session_dir = os.path.join(context.get_temp_dir(), context.get_session_name())  # the node's, gone with it
    BOARD.watch_drain(node_id, state.get_draining_nodes, poll=first_on_node(node_id, session_dir))


_NODE_LOCK: Any = None  # held while this process lives: it polls its node's drain


def first_on_node(node_id: str, directory: str | None = None) -> bool:
    """Whether this process is the first of its Ray node's to ask (a lock file named by the node id,
    held until the process ends): it polls the node's drain. Ray Train's local rank will not do:
    it counts workers by address, which several nodes may share."""
    global _NODE_LOCK
    import fcntl
    import tempfile

    if _NODE_LOCK is not None:
        return True
    os.makedirs(directory or tempfile.gettempdir(), exist_ok=True)
    handle = open(os.path.join(directory or tempfile.gettempdir(), f"raytrain-drain-{node_id}.lock"), "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return False
    _NODE_LOCK = handle
    return True


__all__ = [
    "BOARD",
    "DRAIN",
    "SIGTERM",
    "Leaving",
    "Notice",
    "NoticeBoard",
    "catch_notices",
    "leaving",
    "slots",
    "checkpoint_fits",
    "first_on_node",
    "notice_line",
    "sigterm_grace_s",
]
