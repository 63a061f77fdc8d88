"""How a worker recovers from a failure: one recovery object per fault-tolerance mode, built
once where the worker starts (`recovery_for`), and the only place that knows the mode.

The loop (`raytrain.worker.loop`, `raytrain.worker.epoch`) and the checkpoints
(`raytrain.worker.checkpointer`) ask the recovery object what differs between modes:

- how an attempt opens (`open`) and is ready to step once restored (`after_restore`), and
  the first quorum of a worker that had nothing to say before it (`first_quorum`);
- each step's quorum (`start_step`) and whether to apply the step (`commit`);
- what is summed at an epoch's end (`sum_at_epoch_end`) and whether each worker reads a stop
  request itself (`each_reads_stop`);
- who writes a checkpoint (`writes_checkpoints`), whether every rank writes its part
  (`distributed_checkpoints`), and how it is published (`publish`, `publish_wait_s`);
- its collectives, its model's wrapper and its evaluation share: those of its runtime
  (`raytrain.worker.runtime.Runtime`, or per-step's `ReplicaRuntime`);
- which ranks hold the same shard of different replicas (`shards_per_replica`), and what
  evicting a straggler leaves (`workers_left`) and does (`evict`), for its watch of slow and
  silent faults (`raytrain.instruments.watch`).

`Recovery` is restart mode's (`--fault-tolerance restart`): a failure restarts the whole
worker group from the last checkpoint, so every rank takes and commits every step, and Ray
Train registers (and prunes) the checkpoints. Per-step fault tolerance is
`raytrain.faults.per_step.PerStep`.

`RestartMode` is the mode itself, and the base of every mode: its worker half is `Recovery`,
handed to each worker in the payload; its driver half is the torch backend, NCCL's error
handling, what the driver says of a dead worker, and the controller's policies.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from raytrain.faults.evict import evicting_policy
from raytrain.instruments.watch import StragglerEvicted, Watch
from raytrain.rules import agreement, stragglers
from raytrain.rundir.storage import Store
from raytrain.text import sci
from raytrain.worker.network import BoundTorchConfig
from raytrain.worker.runtime import Runtime, hold_out_this_node, run_key

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from raytrain.config import TrainConfig
    from raytrain.instruments.window import LossWindow
    from raytrain.rules.budget import Budget
    from raytrain.rules.position import Position
    from raytrain.rundir.publish import Publish
    from raytrain.rundir.writer import RunWriter

# How long rank 0 waits at the end of a run for Ray's upload step to publish its last checkpoint.
PUBLISH_WAIT_S = 60.0


@dataclass(frozen=True)
class Quorum:
    """The workers taking a step: how many, and this one's rank among them."""

    size: int
    rank: int


class Runner(Protocol):
    """What a recovery object asks of the step machinery (`raytrain.worker.step.StepRunner`)."""

    model: Any

    def training_state(self, position: "Position") -> Any: ...

    def discard_step(self, window_before: Any) -> None: ...


class Restored(Protocol):
    """What a recovery object asks of an attempt (`raytrain.worker.loop.Training`)."""

    cfg: "TrainConfig"
    files: "RunWriter"
    runner: Runner
    position: "Position"
    announced: bool

    def announce(self) -> None: ...


class Recovery:
    """Restart mode's recovery (see the module's docstring); the base of every mode's."""

    healed = False  # the last quorum loaded the live state from a peer
    group_size = 1  # workers that hold one copy of the model between them (per-step's replica groups)
    each_reads_stop = False  # every rank learns of a stop request by the sync
    rolls_back_every_node = True  # a failure of any node rolls the whole run back (auto's failure rate)

    def __init__(
        self, cfg: "TrainConfig", run_dir: Store, runtime: Runtime | None = None, *, invocation: str = ""
    ) -> None:
        """`runtime`: this worker's (None: Ray Train's worker, or local mode's process); `invocation`:
        this run of the driver (its evictions are its own)."""
        self.runtime = runtime if runtime is not None else Runtime(cfg.gpu)
        self._every = Quorum(self.runtime.world_size, self.runtime.world_rank)
        self.faults = Watch(cfg, invocation)  # slow and silent faults: stragglers, replicas that differ
        self._strategy = cfg.strategy
        self.evict_key = run_key(cfg.storage, cfg.name, invocation)  # where a straggler's node is written down

    @property
    def shards_per_replica(self) -> int:
        """The ranks that hold one copy of the model between them (`raytrain.rules.agreement.shards_per_replica`)."""
        return agreement.shards_per_replica(self._strategy, self.runtime.world_size)

    def workers_left(self, rank: int, hosts: list[str]) -> int:
        """The workers an eviction of `rank` leaves: those on other hosts (the group restarts without its host)."""
        return stragglers.workers_left(rank, hosts)

    def evict(self, rank: int, line: str) -> None:
        """--evict-stragglers, every rank at once: the straggler's worker writes its node down for the
        controller (`raytrain.faults.evict` keeps the run off it), then the attempt ends on every
        rank; Ray Train restarts the group at the size the other nodes hold."""
        try:
            if self.runtime.world_rank == rank:
                hold_out_this_node(self.evict_key)
        finally:
            self.runtime.all_reduce_sum([0.0])  # written down before any rank leaves (or its failure raises)
        raise StragglerEvicted(line)

    @property
    def replica_count(self) -> int:
        """The copies of the model training in parallel: every worker's."""
        return self.runtime.world_size

    # -- the attempt ----------------------------------------------------------------------

    def open(self, files: "RunWriter", budget: "Budget") -> bool:
        """Before the attempt builds; returns whether it trains. Every worker starts together: a
        checkpoint left half-written by the failed attempt is cleared."""
        files.clear_staging()
        return True

    def after_restore(self, training: Restored) -> None:
        """Restored: ready to step. The attempt's line, at once (every worker starts with the others)."""
        training.announce()
        training.position.trains_with(self.runtime.world_size)

    def first_quorum(self, training: Restored, quorum: Quorum) -> bool:
        """The first quorum of a worker that has not said its attempt's line; returns whether
        the run was finished elsewhere (never: every worker says it once restored)."""
        training.announce()
        return False

    def close(self) -> None:
        """The attempt ended (for good, or to be restarted)."""

    # -- a step -----------------------------------------------------------------------------

    def start_step(self, step: int, window: "LossWindow") -> Quorum:
        """The workers of the step at `step`: all of them."""
        return self._every

    def step_rows(self, rows: int) -> None:
        """Under --compile, the step entered takes `rows` over its workers (what per-step's stall
        watch allows a step depends on it: a new shape compiles again)."""

    def commit(self, runner: Runner) -> bool:
        """Whether to apply the step: always (a failure restarts the group from a checkpoint)."""
        return True

    def quorum_line(self, previous: int, now: int, position: "Position", plan: str, lr: float) -> str:
        """`Quorum 3 → 2 replicas at step 40 (epoch 1, 1,280 samples into it): <plan>; lr now …`:
        the line of a quorum whose size changed from `previous` to `now` (per-step)."""
        k = self.group_size
        if k > 1:  # replica groups of several workers: counted in workers, and in groups
            what = f"workers ({previous // k} → {now // k} replica groups of {k})"
            lost, back = "a worker was lost, and its group with it; the other groups go on", "a group rejoined"
        else:
            what, lost, back = "replicas", "a replica was lost; the survivors go on", "a replica rejoined"
        why = lost if now < previous else f"{back}, healed from a live peer"
        return (
            f"Quorum {previous} → {now} {what} at step {position.step} (epoch {position.epoch + 1}, "
            f"{position.epoch_offset:,} samples into it; {why}): {plan}; lr now {sci(lr)}"
        )

    def sum_at_epoch_end(self, values: list[float]) -> list[float] | None:
        """`values` summed over the workers at an epoch's end (None: not shared)."""
        return self.runtime.all_reduce_sum(values)

    # -- checkpoints ------------------------------------------------------------------------

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this worker writes (its part of) the checkpoints: every one."""
        return True

    @property
    def distributed_checkpoints(self) -> bool:
        """Whether every rank writes and reads its part of a checkpoint together (DCP over the
        process group), rather than one process writing and reading all of it."""
        return self.runtime.distributed

    def publish(
        self, publish: "Publish", metrics: dict[str, Any], name: str, staging: "Path", asynchronous: bool,
        prune: Callable[[], None],
    ) -> None:  # fmt: skip
        """Report `metrics` with the checkpoint `name` staged in `staging` to Ray Train, which runs
        the coordinator's `publish` as its upload step and registers and prunes complete
        checkpoints (a barrier over every rank)."""
        if publish.coordinator:
            self.runtime.report(metrics, name, staging, publish, asynchronous)
        else:
            publish.start()
            self.runtime.report(metrics, asynchronous=asynchronous)

    def publish_wait_s(self, publish: "Publish", store: Store, timeout_s: float | None) -> float | None:
        """How long the run's end waits for `publish`: Ray's upload step publishes the coordinator's,
        a rename briefly waited for so that the run's end sees it (`Store.publish_wait_s`)."""
        if publish.coordinator and self.runtime.distributed:
            return store.publish_wait_s(timeout_s, PUBLISH_WAIT_S)
        return timeout_s


class RestartMode:
    """--fault-tolerance restart, and the base of every mode: its worker half (`recovery`) and
    its driver half, asked once by the driver (`raytrain.driver.launch`, `raytrain.driver.failfast`)."""

    recovery: type[Recovery] = Recovery  # the worker half, handed to every worker in the payload
    # TORCH_NCCL_ASYNC_ERROR_HANDLING (Ray Train sets 1 when unset): 3 (SkipCleanUp), as torchtitan
    # sets it: on a timeout the watchdog ends the process without ncclCommAbort, which can itself
    # hang; Ray Train restarts the group, and the driver names the stalled rank from the heartbeats.
    nccl_error_handling = "3"
    reports_each_epoch = True  # every worker reports each epoch's metrics to Ray (what a Tune trial reads)
    min_failures = 0  # the --max-failures it needs

    def __init__(self, cfg: "TrainConfig") -> None:
        self.cfg = cfg

    def torch_config(self, use_gpu: bool) -> Any:
        """The TorchTrainer's torch_config: gloo or NCCL, bound to each node's interface."""
        return BoundTorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=self.cfg.collective_timeout_s)

    def on_worker_failure(self, run_dir: Any) -> Callable[[BaseException], None] | None:
        """What the controller runs when a worker failed (None: nothing): on NCCL the watchdog ends a
        timed-out worker before it can say which rank stalled, so the driver says it from the heartbeats."""
        return stall_reporter(run_dir, self.cfg.collective_timeout_s)

    def controller(self, scaling_config: Any, kwargs: dict[str, Any], evict_key: bytes | None) -> type | None:
        """Sets the controller's policies and callbacks in `kwargs`; returns its class (None: Ray's)."""
        if evict_key is not None:  # an elastic run: no worker counted on an evicted straggler's node
            kwargs["scaling_policy"] = evicting_policy(scaling_config, evict_key)
        return None

    def failure_decision(self, error: BaseException, failure_config: Any) -> Any:
        """The controller's decision on a failure that is not the user's (None: Ray's policy decides)."""
        return None


def stall_reporter(run_dir: Any, collective_timeout_s: float) -> Callable[[BaseException], None]:
    """What the controller runs when a worker failed: if the heartbeats show a collective waited
    out its timeout, an event naming the stalled rank(s) (printed on the console like every
    event). On NCCL the watchdog ends a timed-out worker before it can say so itself."""
    from raytrain.rules.stall import stall_seen_by_heartbeats
    from raytrain.rundir import RunDir
    from raytrain.rundir.heartbeats import read_last_attempt
    from raytrain.rundir.records import HEARTBEATS, Event, Kind

    def report(error: BaseException) -> None:
        if "stalled rank" in str(error):  # the worker said it itself (gloo raises in the worker)
            return
        store = Store.of(run_dir)
        with contextlib.suppress(OSError, ValueError):  # a diagnosis must never fail the policy
            records = read_last_attempt(store.local_dir / HEARTBEATS)
            message = stall_seen_by_heartbeats(records, time.time(), collective_timeout_s)
            if message:
                RunDir(store).append_event(Event(Kind.STALL, message))

    return report


__all__ = ["PUBLISH_WAIT_S", "Quorum", "Recovery", "RestartMode", "Restored", "Runner", "stall_reporter"]
