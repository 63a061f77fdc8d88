"""The faults that announce nothing, watched by every attempt: a rank every step waits for
(`raytrain.rules.stragglers`), a replica whose weights silently differ
(`raytrain.instruments.agreement`) and, per-step, a replica stuck in its step (`StallWatch`).

The recovery object holds one `Watch` (`raytrain.faults.restart.Recovery.faults`), built with
its mode's eviction (`raytrain.faults.restart.Eviction`): which ranks hold the same shard, how
many workers an eviction leaves and what an eviction does. The loop hands it each sync's
figures, every rank's own time and host (`after_sync`), and asks it to compare the replicas
when due and before every checkpoint (`compare`). Every rank keeps the same watch over the same
figures, so every rank reaches the same decisions.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from raytrain.instruments.agreement import ReplicaMismatch, ReplicaMismatchRecurred, mismatch_line, shared_fingerprints
from raytrain.instruments.notice import BOARD, checkpoint_fits, notice_line
from raytrain.instruments.notice import leaving as shared_notices
from raytrain.instruments.notice import slots as notice_slots
from raytrain.rules import agreement
from raytrain.rules import replicas as replica_rules
from raytrain.rules.stragglers import RankTimes, StragglerWatch
from raytrain.rundir.records import RANK_STEP_S, Kind

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.rundir.writer import RunWriter


class StragglerEvicted(RuntimeError):
    """--evict-stragglers took a straggler's host out of the run: the attempt ends, and the run
    goes on without that host (a failure, retried as any worker's)."""


class Preempted(RuntimeError):
    """Ranks had a preemption notice (`raytrain.instruments.notice`): the attempt ended at a step
    boundary after its checkpoint, and the run goes on without their node (not a failure: retried
    whatever --max-failures)."""


class Watch:
    """Stragglers found at each sync and the replicas compared, on every rank alike (the writing rank
    writes the events)."""

    def __init__(self, cfg: "TrainConfig", eviction: Any, invocation: str = "") -> None:
        """`eviction`: the mode's (`raytrain.faults.restart.Eviction`): its runtime, the ranks that
        hold one copy of the model, and what evicting a rank leaves and does."""
        self.cfg, self.eviction = cfg, eviction
        self.invocation = invocation  # this run of the driver: its attempts' mismatches are compared
        evict_after = cfg.straggler_evict_steps if cfg.evict_stragglers else None
        self.stragglers = StragglerWatch(cfg.straggler_factor, cfg.straggler_steps, evict_after)
        self.last: list[RankTimes] = []  # the last sync's figures
        self.quorum: Any = None  # the workers of the figures (`raytrain.faults.restart.Quorum`)
        self._my_host: int | None = None
        self.hosts: list[str] = []  # the last sync's, each rank's node address
        self.leaving: dict[int, Any] = {}  # the ranks with a preemption notice, until they leave
        self.leaving_line = ""

    def follow(self, quorum: Any) -> None:
        """The quorum the next steps take; a new one (per-step, a replica lost or back) holds other
        workers, maybe on other hosts: what was said of its ranks is forgotten."""
        if quorum != self.quorum:
            self.quorum = quorum
            self.stragglers.forget()

    @property
    def my_host(self) -> int:
        """This worker's node address as the sync carries it (`raytrain.rules.agreement.ipv4`)."""
        if self._my_host is None:
            from raytrain.worker.runtime import node_address

            self._my_host = agreement.ipv4(node_address())
        return self._my_host

    def after_sync(self, files: "RunWriter", times: list[RankTimes], hosts: list[str], step: int) -> None:
        """A sync's figures, the same on every rank: the writing rank says a straggler found, or
        gone; under --evict-stragglers every rank finds the one to evict (`Eviction.leave`)."""
        self.last, self.hosts = times, hosts
        if len(times) < 2:
            return
        for found in self.stragglers.observe(times, hosts):
            files.event(Kind.STRAGGLER, found.line(self.cfg.straggler_factor), step=step, **found.record())
        rank = self.stragglers.to_evict()
        if rank is None:
            return
        self.stragglers.evicted.add(rank)  # decided once, whatever comes of it
        steps, least = self.stragglers.slow_steps[rank], self.cfg.min_workers
        left = self.eviction.workers_left(rank, hosts)
        why = f"a straggler for {steps} steps running (--straggler-evict-steps {self.cfg.straggler_evict_steps})"
        evicted = left >= least
        line = (
            f"Evicting rank {rank} (host {hosts[rank]}), {why}: the run goes on without that host, never taking it back"
            if evicted
            else f"Not evicting rank {rank} (host {hosts[rank]}), {why}: without it {left} worker(s) would be left, "
            f"fewer than --workers' MIN {least}; it trains on"
        )
        files.event(Kind.EVICTED, line, step=step, rank=rank, host=hosts[rank], slow_steps=steps, evicted=evicted)
        if evicted:
            files.flush()
            self.eviction.leave([rank], StragglerEvicted(line))

    def on_notice(self, files: "RunWriter", leaving: dict[int, Any], step: int, save_s: float | None) -> bool:
        """A sync's preemption notices (`leaving`: {rank: `raytrain.instruments.notice.Leaving`}, the
        same on every rank), decided once on every rank alike: the writing rank says it (a
        `preempted` event per node); returns whether the step is checkpointed before those ranks
        leave (`leave`). One all-reduce, at the notice only, adds the ranks on a noticed node that
        had not seen it yet (a node goes whole) and every rank's slowest save (`save_s`, this
        rank's; None: none yet): the mode checkpoints first (`Eviction.checkpoints_first`) when the
        earliest deadline leaves time for a save like the slowest."""
        if not leaving or self.leaving:
            return False
        runtime = self.eviction.runtime
        world, rank = runtime.world_size, runtime.world_rank
        BOARD.poll_now()
        saves_s = [0.0] * world
        saves_s[rank] = save_s or 0.0
        shared = runtime.all_reduce_sum(notice_slots(BOARD.notice, rank, world, time.time()) + saves_s)
        self.leaving = leaving = shared_notices(shared[:world]) | leaving
        slowest_s = max(shared[world:]) or None
        ranks, left_s = sorted(leaving), min(notice.seconds_left for notice in leaving.values())
        saves = self.eviction.checkpoints_first and checkpoint_fits(left_s, slowest_s)
        hosts = sorted({self.hosts[r] for r in ranks})
        self.leaving_line = line = notice_line(
            ranks, hosts, left_s, step, saves, self.eviction.checkpoints_first, slowest_s
        )
        if files.enabled:
            nodes, now = _node_ids(), time.time()
            for host in hosts:
                on_host = [r for r in ranks if self.hosts[r] == host]
                first = min((leaving[r] for r in on_host), key=lambda notice: notice.seconds_left)
                files.event(
                    Kind.PREEMPTED, line, step=step, node=nodes.get(host), host=host, ranks=on_host,
                    reason=first.source,
                    deadline=None if math.isinf(first.seconds_left) else round(now + first.seconds_left, 1),
                    checkpoint_step=step if saves else None,
                )  # fmt: skip
            files.flush()
        return saves

    def leave(self) -> None:
        """After `on_notice` (and its checkpoint): the ranks with a notice leave, as the mode has them."""
        leaving, self.leaving = self.leaving, {}  # once: a per-step quorum's ranks change when they have left
        if leaving:
            self.eviction.leave(sorted(leaving), Preempted(self.leaving_line))

    def row_figures(self) -> dict[str, Any]:
        """What a metrics row holds of the last sync: each rank's own seconds per step."""
        if len(self.last) < 2 or not any(t.steps for t in self.last):
            return {}
        return {RANK_STEP_S: [round(t.step_s, 6) for t in self.last]}

    def replicas_due(self, step: int, checkpoint_now: bool) -> bool:
        """Whether the replicas are compared after the step to `step` (there are several)."""
        replicas = self.eviction.runtime.world_size // max(1, self.eviction.shards_per_replica)
        return replicas > 1 and agreement.check_due(step, self.cfg.replica_check_steps, checkpoint_now)

    def compare(
        self, files: "RunWriter", model: Any, optimizer: Any, step: int, last_checkpoint: Callable[[], Any]
    ) -> list[int]:
        """Every rank's fingerprint after the step to `step`. On a mismatch the writing rank
        writes the event (naming `last_checkpoint()`, the directory the run goes back to, or None)
        and every rank raises `ReplicaMismatch`; `ReplicaMismatchRecurred`, not retried, when an
        earlier attempt met the same one after going back there (the writing rank reads the events
        and one more all-reduce tells every rank: they stop together)."""
        runtime, shards = self.eviction.runtime, self.eviction.shards_per_replica
        every, hosts = shared_fingerprints(runtime, model, optimizer, self.my_host)
        odd = agreement.odd_ranks(every, shards)
        if not odd:
            return every
        latest = last_checkpoint()
        back = latest.name if latest is not None else None
        seen = False
        if files.enabled:
            # Whatever the reading raises, the others wait in the all-reduce below: an unreadable
            # run is retried, as any mismatch was.
            with contextlib.suppress(Exception):
                seen = agreement.recurs(files.rundir.events(), self.invocation, step, odd, back)
        recurred = runtime.all_reduce_sum([float(seen)])[0] > 0
        line = mismatch_line(odd, hosts, step, shards, runtime.world_size, back, recurred)
        named = [hosts[r] for r in odd]
        one = {"rank": odd[0], "host": named[0]} if len(odd) == 1 else {}
        files.event(
            Kind.REPLICA_MISMATCH, line, step=step, ranks=odd, hosts=named, checkpoint=back, **one,
            fingerprints=[f"{value:016x}" for value in every], invocation=self.invocation, recurred=recurred,
        )  # fmt: skip
        files.flush()
        raise (ReplicaMismatchRecurred if recurred else ReplicaMismatch)(line)


class StallWatch:
    """Ends a replica stuck in one step's work (a hung kernel, a lost NFS mount): past the
    step's limit (`raytrain.rules.replicas.stall_after_s`), `on_stall(step, seconds)` runs (it
    says so and exits the process, and Ray Train replaces the replica). The others' all-reduce
    gave up on it long before; once it is gone the lighthouse forms their quorum without it."""

    def __init__(self, on_stall: Callable[[int, float], None], clock: Callable[[], float] = time.monotonic):
        self.on_stall, self.clock = on_stall, clock
        self.step: int | None = None
        self.since, self.limit_s = 0.0, math.inf
        self.work_s: deque[float] = deque(maxlen=replica_rules.STEPS_REMEMBERED)  # committed steps' work
        self.shapes: set[Any] = set()  # the shapes of the committed steps' rows
        self.shape: Any = None  # the shape of the step entered

    def enter(self, step: int, limit_s: float) -> None:
        self.since, self.limit_s, self.step, self.shape = self.clock(), limit_s, step, None

    def shaped(self, shape: Any, new_shape_limit_s: float) -> None:
        """The step entered has rows of `shape`; if no committed step had it, its limit is at least
        `new_shape_limit_s` (`raytrain.rules.replicas.new_shape_stall_after_s`: it compiles again)."""
        self.shape = shape
        if shape not in self.shapes:
            self.limit_s = max(self.limit_s, new_shape_limit_s)

    def leave(self, committed: bool = False) -> float:
        """Seconds since `enter`; a committed step's are remembered (what a step takes: `stall_after_s`),
        and its shape."""
        self.step = None
        seconds = self.clock() - self.since
        if committed:
            self.work_s.append(seconds)
            self.shapes.add(self.shape)
        return seconds

    def check(self) -> bool:
        """Whether the replica is stalled (then `on_stall` has run)."""
        step = self.step
        if step is None:
            return False
        seconds = self.clock() - self.since
        if seconds <= self.limit_s:
            return False
        self.on_stall(step, seconds)
        return True

    def run_in_background(self, interval_s: float = 1.0) -> threading.Thread:
        def watch() -> None:
            while not self.check():
                time.sleep(interval_s)

        thread = threading.Thread(target=watch, name="raytrain-stall-watch", daemon=True)
        thread.start()
        return thread


def _node_ids() -> dict[str, str]:
    """Each live Ray node's id by its address, where it is the only one there (empty outside Ray)."""
    import ray

    if not ray.is_initialized():
        return {}
    found: dict[str, list[str]] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            found.setdefault(node["NodeManagerAddress"], []).append(node["NodeID"])
    return {address: ids[0] for address, ids in found.items() if len(ids) == 1}
