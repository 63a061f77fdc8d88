"""Per-step fault tolerance (`--fault-tolerance per-step`): every worker is a torchft replica
group, and the replicas that are alive take each step together.

Ray Train's `TorchftConfig` runs torchft's lighthouse and, when a worker dies, replaces only
that replica group. At every step torchft's `Manager` forms a quorum of the live replicas;
a replica that joins heals from a live peer (weights, optimizer, scaler and the training
position) before the step, so it steps on the same rows and rate as the others. Gradients
are averaged over the step's participants, and a step is applied only if every participant
commits it; one that is not committed (a peer died inside it) is taken again from the same
position over the next quorum.

`PerStep` is this mode's recovery object (`raytrain.faults.restart`): the quorum, the commit,
healing, a replacement's first quorum, and checkpoints the quorum's rank 0 writes straight to
the run directory (Ray's report is a barrier over every worker, which a lost replica would hold
up); the loop sees this replica through `ReplicaRuntime`.

Replicas that start together (a fresh start, a resume, a restart of every replica) start their
Managers before they restore and meet at a barrier once restored, so the first quorum holds
all of them; a replacement starts its Manager once it is built, so its restore holds up no
live quorum (`raytrain.faults.replacement` tells each worker which it is).

With `--replica-group-size K` (and `--strategy fsdp`) a replica is a group of K workers that
shard one copy of the model (`raytrain.parallel.hsdp`): the group's K workers form their own
process group on the store the controller hosts for them, rank r of each group steps with
rank r of the others through the Manager, a worker's share of a step's rows is its group's
share split by rank (`raytrain.rules.replicas.step_share`), and the quorum's first group
writes checkpoints together (DCP over the group). A group loses all its workers or none: the
controller takes a lost worker's group out, and a worker that sees a member of its group gone
leaves (`raytrain.faults.groups`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch

from raytrain.faults.evict import hold_out_this_node
from raytrain.faults.groups import replica_of, replica_process_group
from raytrain.faults.replacement import (
    HEARTBEAT_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    GroupController,
    ReplacementRetries,
    ReplicaGroups,
    group_scaling_policy,
    torchft_config,
)
from raytrain.faults.restart import Eviction, Quorum, Recovery, RestartMode
from raytrain.instruments.watch import StallWatch
from raytrain.rules import replicas as rules
from raytrain.rules.budget import Budget
from raytrain.rules.replicas import partial_start_line
from raytrain.rundir import RunDir
from raytrain.rundir.records import Event, Kind
from raytrain.rundir.storage import Store
from raytrain.text import first_line, sci
from raytrain.worker.runtime import Runtime, group_barrier

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from raytrain.config import TrainConfig
    from raytrain.instruments.window import LossWindow
    from raytrain.rules.position import Position
    from raytrain.rundir.publish import Publish
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker.state import TrainingState
    from raytrain.worker.step import StepRunner


class ReplicaRuntime(Runtime):
    """The runtime a per-step replica's loop sees: its rank and world size are its place in the
    current quorum (`PerStep.start_step` sets them), its collectives go through torchft's
    Manager across replicas and through its group within one (`raytrain.faults.groups`), and
    there is none outside a step, where no quorum would guard it against a lost peer: each
    replica validates on all of the (small) validation set by itself and gathers only its own
    (group's) values, and its model is wrapped by torchft when the replica joins, not by Ray's."""

    counts_flops = False

    def __init__(self, timeout_s: float, run_dir: Store, group_size: int) -> None:
        super().__init__()
        self.replica_rank, self.replicas = self.world_rank, self.world_size  # Ray Train's rank and size
        self.timeout_s, self.run_dir = timeout_s, run_dir
        self.distributed = True
        self.replica = replica_of(self.replica_rank, group_size, timeout_s, self._collective_device(), run_dir)
        self.manager = None  # torchft's, once started (`start_manager`)
        self.process_group: Any = None  # the Manager's, across replicas
        self.peer_wait_s = timeout_s  # how long its collectives wait for a missing peer (`wait_for_peers`)
        collectives = "nccl" if self.device.type == "cuda" else "gloo"
        self.backend = f"torchft ({collectives}) over {self.replicas} replicas"
        if group_size > 1:
            groups = self.replicas // group_size
            self.backend = f"torchft ({collectives}) over {groups} replica groups of {group_size} (fsdp within each)"

    def start_manager(self, state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """Start this replica's torchft Manager: from here on it heartbeats to the lighthouse,
        which waits for every heartbeating replica before it forms a quorum. `state`/`load`:
        what a joining replica copies from a live one, and how it takes it."""
        import ray
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        timeout = timedelta(seconds=self.timeout_s)
        node_address = ray.util.get_node_ip_address()
        # Every address a replica hands the others names its node's address, never the hostname,
        # which often resolves to loopback (`raytrain.rules.network`): the Manager's (for the
        # lighthouse) and the process group's rendezvous store (its reconfigure handle).
        pg_class = ProcessGroupNCCL if self.device.type == "cuda" else ProcessGroupGloo
        pg = self.process_group = replica_process_group(pg_class, node_address)(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=load,
            state_dict=state,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the step's rows are chosen
            replica_id=self.replica.replica_id,
            hostname=node_address,
            **self.replica.manager_place(),
            timeout=timeout,
            quorum_timeout=timedelta(seconds=rules.quorum_wait_s(self.timeout_s, JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S)),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=self.device),
        )

    def wait_for_peers(self, seconds: float) -> None:
        """How long this replica's collectives through the Manager (a step's all-reduce, its
        commit) wait for a missing peer from here on: `raytrain.rules.replicas.peer_wait_s`.
        Its process group's collectives wait that long (`raytrain.faults.groups.replica_process_group`),
        and torchft's Manager reads its `_timeout` for each collective's future
        (`Manager.wrap_future`) and has no setter."""
        self.peer_wait_s = seconds
        if self.manager is not None:
            self.manager._timeout = timedelta(seconds=seconds)
            self.process_group.set_peer_wait(timedelta(seconds=seconds))

    def shutdown(self) -> None:
        self.replica.stop()
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    def evaluation_share(self) -> tuple[int, int]:
        """All of the validation set, by this replica itself."""
        return 0, 1

    def prepare_model(self, model: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> torch.nn.Module:
        """On the device; torchft wraps it when the replica joins (`PerStep.after_restore`)."""
        return model.to(self.device)

    def group_sum(self, values: list[float]) -> list[float]:
        """Sum over this worker's replica (a group of one: these values)."""
        return self.replica.sum(values)

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every worker of this replica's `value`, by rank in it (a group of one: this one's)."""
        return self.replica.gather(value)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over the participants of the last step: within the group, then across the
        groups (a failed reduction across groups counts this group only)."""
        from torch.distributed import ReduceOp

        values = self.group_sum(values)
        tensor = torch.tensor(
            values, dtype=torch.float64 if self.device.type == "cpu" else torch.float32, device=self.device
        )
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        if self.group_sum([float(self.manager.errored() is not None)])[0]:  # a member lost after the commit
            return list(values)  # this group's own figures, the same on each of its workers
        return [float(v) for v in tensor.tolist()]


class GroupEviction(Eviction):
    """Per-step's eviction (`raytrain.faults.restart.Eviction`): the leaving rank's replica group
    leaves (a straggler's, or one with a preemption notice), and the others train on without it."""

    checkpoints_first = False  # the others train on: nothing rolls back

    def __init__(self, cfg: "TrainConfig", runtime: ReplicaRuntime, invocation: str) -> None:
        super().__init__(cfg, runtime, invocation)
        # a group's workers hold one copy between them (HSDP), a replica of one all of it
        self.group_size = self.shards_per_replica = cfg.replica_group_size
        self.evicting: set[int] = set()  # the quorum ranks whose groups leave

    def leave(self, ranks: list[int], error: Exception) -> None:
        """The leaving ranks' replica groups leave at the next step's start, where no collective is
        under way (`leave_if_evicted`)."""
        self.evicting = set(ranks)

    def leave_if_evicted(self) -> None:
        """The leaving ranks write their nodes down (the controller leaves their groups waiting for
        room: `raytrain.faults.replacement.GroupController`), and their groups leave."""
        ranks, runtime, self.evicting = self.evicting, self.runtime, set()  # ranks change with the next quorum
        mine = runtime.world_rank // self.group_size
        if not any(rank // self.group_size == mine for rank in ranks):
            return
        if runtime.world_rank in ranks:
            with contextlib.suppress(Exception):  # leaving matters more than the note
                hold_out_this_node(self.key)
        os._exit(1)


class PerStep(Recovery):
    """Per-step fault tolerance's recovery (see the module's docstring)."""

    each_reads_stop = True  # a replica reads the stop request itself rather than trusting the sync to carry it
    announces_at_restore = False  # at its first quorum, unless healed into it
    rolls_back_every_node = False  # a lost replica costs the others no rollback

    def __init__(self, cfg: "TrainConfig", run_dir: Store, *, invocation: str = "") -> None:
        runtime = ReplicaRuntime(cfg.collective_timeout_s, Store.of(run_dir), cfg.replica_group_size)
        eviction = GroupEviction(cfg, runtime, invocation)
        super().__init__(cfg, run_dir, runtime, invocation=invocation, eviction=eviction)
        self.group_size = cfg.replica_group_size
        self.quorum = Quorum(runtime.replicas, runtime.replica_rank)  # until the first step's quorum
        self.healed = False
        self.starts_with_group = rules.starts_with_group(os.environ)
        self.not_waited: str | None = None  # why the replicas that started together did not all meet
        self.held: TrainingState | None = None  # what a joining replica copies from this one
        self.watch = StallWatch(lambda step, seconds: _leave_stalled(runtime, self.watch, step, seconds))
        self._window: Any = None  # the loss window before the step (restored when it is not committed)
        self.uncommitted_in_a_row = 0  # steps given up in a row: each doubles the peer wait

    # -- the attempt ----------------------------------------------------------------------

    def open(self, files: "RunWriter", budget: "Budget") -> bool:
        """Not for a replacement that came up after the others finished the run (`_finished`).
        The Manager starts as the module's docstring says; the staging directory is left alone:
        the live quorum may be writing there."""
        if _finished(self.runtime, files, budget):
            return False
        if self.starts_with_group:
            self._start_manager()
        return True

    def _start_manager(self) -> None:
        """This replica's torchft Manager: a joining replica copies `held` from a live one, and
        takes a live one's into its own."""

        def heal(state: dict[str, Any]) -> None:
            if state and self.held is not None:
                self.held.load_live(state)
                self.healed = True

        self.runtime.start_manager(lambda: self.held.live() if self.held is not None else {}, heal)

    def after_restore(self, state: "TrainingState") -> torch.nn.Module:
        """Ready to step: the model joins torchft's step (`raytrain.faults.groups`; returned), and
        replicas that start together meet here once restored, so that the first quorum holds
        every one of them (or says why it could not wait: a replica lost while the group
        started, or one slower than --collective-timeout-s)."""
        self.held = state
        if self.runtime.manager is None:
            self._start_manager()
        self.watch.run_in_background()
        joined = self.runtime.replica.join(state.model, self.runtime.manager)
        if self.starts_with_group and self.replica_count > 1:
            try:
                group_barrier()
            except Exception as exc:  # a replica lost (Ray resets the barrier) or late: start without it
                self.not_waited = f"{type(exc).__name__}: {first_line(str(exc))}"
        return joined

    def first_quorum(self, quorum: Quorum, files: "RunWriter", budget: Budget) -> str | None:
        """A replica's first quorum: why not every replica that started together is in it (said
        after the attempt's line; a replacement healed into it says nothing of its own, the
        quorum's line does). Alone in it after the others wrote the run's end: a replacement
        too late to join (None)."""
        alone = quorum.size == self.group_size < self.replica_count  # the same on a group's workers
        if alone and _finished(self.runtime, files, budget):
            return None
        if self.starts_with_group and quorum.size < self.replica_count and not self.healed:
            return partial_start_line(quorum.size, self.replica_count, self.not_waited, JOIN_TIMEOUT_S)
        return ""

    def close(self) -> None:
        self.runtime.shutdown()

    # -- a step -----------------------------------------------------------------------------

    def start_step(self, step: int, window: "LossWindow") -> Quorum:
        """The quorum of the step at `step` (a joining replica heals first). From here to the
        commit the stall watch runs: the wait for the quorum is not this replica's work."""
        self.healed = False
        self.eviction.leave_if_evicted()
        runtime, manager = self.runtime, self.runtime.manager
        runtime.wait_for_peers(runtime.timeout_s)  # a quorum, and a heal, wait the whole timeout
        manager.start_quorum()
        place = manager.participating_rank()  # this group's among the step's groups
        rank, size = rules.step_share(place or 0, manager.num_participants(), runtime.replica.rank, self.group_size)
        self.quorum = Quorum(size, rank)
        # The loop splits rows, weights gradients and writes files by its place in the quorum.
        runtime.world_size, runtime.world_rank = size, rank
        self._window = window.snapshot()
        work_s = list(self.watch.work_s)
        peer_wait_s = rules.peer_wait_s(runtime.timeout_s, work_s, self.uncommitted_in_a_row)
        runtime.wait_for_peers(peer_wait_s)
        self.watch.enter(step, rules.stall_after_s(peer_wait_s, work_s))
        return self.quorum

    def step_rows(self, rows: int) -> None:
        """The step entered takes `rows` over its quorum: this replica's share of a shape no
        committed step had is compiled again, and gets a first step's grace."""
        limit_s = rules.new_shape_stall_after_s(self.runtime.peer_wait_s, self.runtime.timeout_s)
        self.watch.shaped((rows, self.quorum.size, self.quorum.rank), limit_s)

    def commit(self, runner: "StepRunner") -> bool:
        """Whether every participant finished the step (then, and only then, apply it); a step
        not committed counts for nothing (`StepRunner.discard_step`)."""
        committed = False
        try:
            committed = bool(self.runtime.manager.should_commit())
        finally:
            self.watch.leave(committed)
            self.uncommitted_in_a_row = 0 if committed else self.uncommitted_in_a_row + 1
        if not committed:
            runner.discard_step(self._window)
        return committed

    def quorum_line(self, previous: int, now: int, position: "Position", plan: str, lr: float) -> str:
        """`Quorum 3 → 2 replicas at step 40 (epoch 1, 1,280 samples into it): <plan>; lr now …`:
        the line of a quorum whose size changed from `previous` to `now`."""
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
        """Nothing: no collective outside a step."""
        return None

    # -- checkpoints ------------------------------------------------------------------------

    @property
    def writes_checkpoints(self) -> bool:
        """The quorum's first group writes them (a group of one: the quorum's rank 0)."""
        return self.quorum.rank < self.group_size

    @property
    def distributed_checkpoints(self) -> bool:
        """A group of several workers writes and reads its checkpoints together (DCP over the
        group); a replica of one writes and reads all of one by itself."""
        return self.runtime.replica.writes_together

    def publish(
        self, publish: "Publish", metrics: dict[str, Any], name: str, staging: "Path", asynchronous: bool,
        prune: Callable[[], None],
    ) -> None:  # fmt: skip
        """The writer publishes and prunes by itself (see the module's docstring)."""
        publish.start(then=prune)

    def publish_wait_s(self, publish: "Publish", store: Store, timeout_s: float | None) -> float | None:
        return timeout_s


def _finished(runtime: ReplicaRuntime, files: "RunWriter", budget: Budget) -> bool:
    """Whether the others wrote the run's end (a group's workers go by its rank 0's reading, so
    that they all go or all stay)."""
    return runtime.all_gather_object(files.rundir.finished(budget))[0]


def _leave_stalled(runtime: ReplicaRuntime, watch: StallWatch, step: int, seconds: float) -> None:
    """Say which replica stalled, then exit: Ray Train replaces it, the others go on."""
    usual = f"its steps take {statistics.median(watch.work_s):.2g} s" if watch.work_s else "its first step"
    message = (
        f"Replica {runtime.replica_rank} stuck in step {step} for {seconds:.0f} s (the others gave up on it after "
        f"{runtime.peer_wait_s:.3g} s; {usual}): it leaves the quorum and is replaced; "
        "the others go on"
    )
    with contextlib.suppress(Exception):
        RunDir(runtime.run_dir).append_event(
            Event(Kind.STALL, message, extra={"replica": runtime.replica_rank, "step": step, "seconds": seconds})
        )
    os._exit(1)


class PerStepMode(RestartMode):
    """--fault-tolerance per-step: the worker half is `PerStep`; the driver half runs torchft's
    lighthouse and replaces lost replica groups in place (`raytrain.faults.replacement`)."""

    recovery = PerStep
    # 2 (CleanUpOnly): the watchdog aborts the communicator but leaves the process alive, so a
    # survivor whose peer died is not ended with it; torchft's Manager sees the error and the
    # survivors form their next quorum.
    nccl_error_handling = "2"
    min_failures = 1  # a replacement is a recovered failure
    reports_each_epoch = False  # the writer publishes by itself: Ray's report is a barrier a lost replica holds up
    silent_worker_s = None  # the survivors' quorum leaves a silent replica behind: the peers' wait finds it

    def __init__(self, cfg: "TrainConfig") -> None:
        super().__init__(cfg)
        self.retries = ReplacementRetries()

    def torch_config(self, use_gpu: bool) -> Any:
        cfg = self.cfg  # a quorum's fewest groups: an elastic run's MIN; a fixed run's survivors go on
        return torchft_config(
            use_gpu, cfg.collective_timeout_s, cfg.min_workers // cfg.replica_group_size if cfg.elastic else 1
        )

    def on_worker_failure(self, run_dir: Any) -> None:
        return None  # a stuck replica says so itself (`StallWatch`)

    def controller(self, scaling_config: Any, kwargs: dict[str, Any], evict_key: bytes | None) -> type:
        k = self.cfg.replica_group_size
        kwargs["callbacks"] = [*kwargs["callbacks"], ReplicaGroups(k)]
        if scaling_config.elasticity_enabled:  # an elastic run starts with whole groups
            kwargs["scaling_policy"] = group_scaling_policy(scaling_config, k, evict_key)
        return type("GroupController", (GroupController,), {"evict_key": evict_key})

    def failure_decision(self, error: BaseException, failure_config: Any) -> Any:
        return self.retries.decide(error, failure_config.max_failures)


__all__ = ["GroupEviction", "PerStep", "PerStepMode", "ReplicaRuntime", "StallWatch"]
