"""How a worker recovers from a failure: one recovery object per fault-tolerance mode, built
once where the worker starts (`raytrain.worker.loop.train_loop_per_worker`, from the class its
payload carries), and the only place that knows the mode.

The loop (`raytrain.worker.epoch`) and the checkpoints (`raytrain.worker.checkpointer`) ask the
recovery object what differs between modes: how an attempt opens, restores and forms its first
quorum; each step's quorum and commit; what is summed at an epoch's end; who writes, publishes
and rolls back to checkpoints; its runtime (`raytrain.worker.runtime.Runtime`, or per-step's
`ReplicaRuntime`: collectives, model wrapper, evaluation share); and its watch of slow and silent
faults (`raytrain.instruments.watch.Watch`), built with its `Eviction`.

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
from typing import TYPE_CHECKING, Any, Callable

from raytrain.faults.evict import SILENT_WORKER_S, evicting_policy, hold_out_this_node, run_key
from raytrain.instruments.watch import Preempted, Watch
from raytrain.rules import agreement, stragglers
from raytrain.rules.interval import AutoInterval
from raytrain.rundir.storage import Store
from raytrain.worker.network import BoundTorchConfig
from raytrain.worker.runtime import Runtime

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import torch

    from raytrain.config import TrainConfig
    from raytrain.instruments.window import LossWindow
    from raytrain.rules.budget import Budget
    from raytrain.rundir.publish import Publish
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker.state import TrainingState
    from raytrain.worker.step import StepRunner

# How long rank 0 waits at the end of a run for Ray's upload step to publish its last checkpoint.
PUBLISH_WAIT_S = 60.0


@dataclass(frozen=True)
class Quorum:
    """The workers taking a step: how many, and this one's rank among them."""

    size: int
    rank: int


class Eviction:
    """What the watch (`raytrain.instruments.watch.Watch`) asks of the mode: which ranks hold one
    copy of the model between them, and what a rank leaving does: a straggler evicted
    (--evict-stragglers), or ranks with a preemption notice. Restart mode's: the whole group
    restarts without their hosts, after a checkpoint at the notice's step."""

    group_size = 1  # workers that hold one copy of the model between them (per-step's replica groups)
    checkpoints_first = True  # a notice's step is checkpointed before its ranks leave: a rollback follows

    def __init__(self, cfg: "TrainConfig", runtime: Runtime, invocation: str) -> None:
        """`invocation`: this run of the driver (its evictions are its own)."""
        self.runtime = runtime
        self.key = run_key(cfg.storage, cfg.name, invocation)  # where a leaving rank's node is written down
        # `raytrain.rules.agreement.shards_per_replica`; a restarting group keeps its size
        self.shards_per_replica = agreement.shards_per_replica(cfg.strategy, runtime.world_size)

    def workers_left(self, rank: int, hosts: list[str]) -> int:
        """The workers an eviction of `rank` leaves: those of the groups with no worker on its host."""
        return stragglers.workers_left(rank, hosts, self.group_size)

    def leave(self, ranks: list[int], error: Exception) -> None:
        """Every rank at once: the leaving ranks' workers write their nodes down for the controller
        (`raytrain.faults.evict` keeps the run off them), then the attempt ends on every rank with
        `error`; Ray Train restarts the group at the size the other nodes hold."""
        try:
            if self.runtime.world_rank in ranks:
                hold_out_this_node(self.key)
        finally:
            self.runtime.all_reduce_sum([0.0])  # written down before any rank leaves (or its failure raises)
        raise error


class Recovery:
    """Restart mode's recovery (see the module's docstring); the base of every mode's."""

    healed = False  # the last quorum loaded the live state from a peer
    each_reads_stop = False  # every rank learns of a stop request by the sync
    announces_at_restore = True  # every worker starts with the others: the attempt is said once restored
    rolls_back_every_node = True  # a failure of any node rolls the whole run back (auto's failure rate)

    def __init__(
        self, cfg: "TrainConfig", run_dir: Store, runtime: Runtime | None = None, *, invocation: str = "",
        eviction: Eviction | None = None,
    ) -> None:  # fmt: skip
        """`runtime`: this worker's (None: Ray Train's worker, or local mode's process); `invocation`:
        this run of the driver; `eviction`: the mode's (None: restart's)."""
        self.runtime = runtime if runtime is not None else Runtime(cfg.gpu)
        self.replica_count = self.runtime.world_size  # the copies of the model training in parallel (workers)
        self._every = Quorum(self.runtime.world_size, self.runtime.world_rank)
        self.eviction = eviction or Eviction(cfg, self.runtime, invocation)
        self.faults = Watch(cfg, self.eviction, invocation)  # slow and silent faults: stragglers, replicas that differ

    # -- the attempt ----------------------------------------------------------------------

    def open(self, files: "RunWriter", budget: "Budget") -> bool:
        """Before the attempt builds; returns whether it trains. Every worker starts together: a
        checkpoint left half-written by the failed attempt is cleared."""
        files.clear_staging()
        return True

    def after_restore(self, state: "TrainingState") -> "torch.nn.Module":
        """Restored into `state`: ready to step; returns the model to step with (as built)."""
        return state.model

    def first_quorum(self, quorum: Quorum, files: "RunWriter", budget: "Budget") -> str | None:
        """The first quorum of a worker that has not said its attempt's line: the line said after
        the attempt's ("": none), or None when the others finished the run (never here)."""
        return ""

    def close(self) -> None:
        """The attempt ended (for good, or to be restarted)."""

    # -- a step -----------------------------------------------------------------------------

    def start_step(self, step: int, window: "LossWindow") -> Quorum:
        """The workers of the step at `step`: all of them."""
        return self._every

    def step_rows(self, rows: int) -> None:
        """Under --compile, the step entered takes `rows` over its workers (what per-step's stall
        watch allows a step depends on it: a new shape compiles again)."""

    def commit(self, runner: "StepRunner") -> bool:
        """Whether to apply the step: always (a failure restarts the group from a checkpoint)."""
        return True

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

    def auto_interval(self, state: dict[str, Any] | None, **options: Any) -> AutoInterval:
        """--checkpoint-every auto's interval from `state` (a checkpoint's, or rank 0's) with the
        run's `options`, for the failures that roll this worker back: any node's, or its own."""
        return AutoInterval.from_state(state, per_step=not self.rolls_back_every_node, **options)

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
    # How long a worker's poll may go unanswered before it is taken as gone and its node suspected
    # (`raytrain.faults.evict.Suspects`; None: Ray Train's 600 s).
    silent_worker_s: float | None = SILENT_WORKER_S
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
        if scaling_config.elasticity_enabled:  # an elastic run: no worker counted on a node held out
            kwargs["scaling_policy"] = evicting_policy(scaling_config, evict_key)
        return None

    def failure_decision(self, error: BaseException, failure_config: Any) -> Any:
        """The controller's decision on a failure that is not the user's (None: Ray's policy decides):
        ranks that left on a preemption notice, after its checkpoint, are restarted whatever
        --max-failures (a preemption is not a failure)."""
        from raytrain.errors import find_error
        from raytrain.faults.ray_internals import FailureDecision

        return FailureDecision.RETRY if find_error(error, (Preempted,)) is not None else None


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


__all__ = ["PUBLISH_WAIT_S", "Eviction", "Quorum", "Recovery", "RestartMode", "stall_reporter"]
