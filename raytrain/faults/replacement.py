"""Per-step fault tolerance on Ray Train 2.60's controller: replacing several replicas at once,
and telling each worker how it starts.

Under `TorchftConfig` the controller replaces only the failing replica groups
(`TrainController._replace_bad_workers`), one after the other
(`WorkerGroup.replace_replica_group`). Each replacement first has every other *active* replica
group clear its result queue (`ray.get(clear_tasks)` in `WorkerGroup._replace_replica_group_impl`).
When a second group is dead too (two replicas lost in the same second, a lost node), that call
raises `ActorDiedError` on the first replacement; the controller wraps it in a `ControllerError`,
its default failure policy never retries one, and the run fails although --max-failures allows
more (`_run_control_loop_iteration` → `[FailurePolicy] RAISE … Source: controller`).

`ReplicaGroups`, a controller callback, closes that gap from outside:

- just before the controller executes a resize decision (where it replaces), it polls the
  worker group afresh and shuts down every failing replica group first, so that each
  replacement meets only live groups (a shut-down group is not asked to clear anything);
- a replica that dies while another is being replaced (found by no poll yet) still fails that
  replacement: `raytrain.driver.failfast` retries that controller error within --max-failures,
  and the retry's fresh poll finds both;
- it tells every worker how it starts (`raytrain.rules.replicas.START_ENV`): with its group (a
  fresh start, a resume, a restart of every replica: they wait for each other, so that the
  first quorum is complete) or as the replacement of lost replicas (it waits for no one).

With replica groups of several workers (--replica-group-size K, HSDP) Ray Train still sees
one replica group per worker; raytrain groups them. Each group of K meets on a TCPStore this
callback hosts in the controller, one per group and generation (`GroupGenerations`), whose
address every worker of the group is given before its training function runs
(`raytrain.rules.replicas.GROUP_STORE_ENV`). When a worker of a group is replaced, the group
starts a new generation on a new store; the group's other workers see the loss and leave
(`raytrain.parallel.hsdp.GroupWatch`: the old store closing tells them too), and their
replacements join the new generation.

A replacement that cannot be placed waits while the others train (`GroupController`). An
elastic per-step run (`--workers MIN:MAX`) starts with whole groups (`group_scaling_policy`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.exceptions import RayActorError
from ray.train import ControllerError
from ray.train.v2.torch import torchft_config as ray_torchft

from raytrain.faults.evict import evicted_nodes, evicting_policy
from raytrain.faults.ray_internals import (
    ControllerCallback,
    ElasticScalingPolicy,
    FailureDecision,
    NoopDecision,
    ReplicaGroupCallback,
    ResizeDecision,
    TrainController,
    WorkerGroupCallback,
    WorkerGroupPollStatus,
    WorkerStatus,
    _TorchftBackend,
)
from raytrain.rules import network
from raytrain.rules.replicas import (
    GROUP_STORE_ENV,
    REPLACES_ONE,
    START_ENV,
    STARTS_WITH_GROUP,
    GroupGenerations,
    whole_groups,
)
from raytrain.worker.network import BindsInterfaces

logger = logging.getLogger(__name__)

# The controller's callback, for its failure and scaling policies: Ray hands the controller each
# of them as its own copy, so the policies find the callback here (one controller per process;
# None before its group starts).
_RUNNING: "ReplicaGroups | None" = None

# How long the controller's extra poll waits for a worker's answer (a live worker answers at
# once; a dead one fails at once).
POLL_TIMEOUT_S = 2.0


def mark_start(kind: str) -> None:
    """On a worker, before its training function runs: how it starts."""
    os.environ[START_ENV] = kind


def mark_group(address: str) -> None:
    """On a worker, before its training function runs: where its replica group meets."""
    os.environ[GROUP_STORE_ENV] = address


def partial_loss(status: WorkerGroupPollStatus) -> bool:
    """Whether some replica groups failed and others live: the failed ones are replaced in place."""
    failing = status.failing_replica_group_indices
    return bool(failing) and failing != status.all_replica_group_indices


def lost_while_replacing(error: Exception) -> bool:
    """A controller error from a dead actor: under per-step fault tolerance, a replica that died
    while the controller was replacing another (see the module's docstring)."""
    return isinstance(error, ControllerError) and isinstance(error.controller_failure, RayActorError)


class ReplicaGroups(ControllerCallback, WorkerGroupCallback, ReplicaGroupCallback):
    """Runs in Ray Train's controller of a per-step run (see the module's docstring)."""

    def __init__(self, group_size: int = 1) -> None:
        self.worker_group = None
        self.group_size = group_size
        self.generations = GroupGenerations(group_size) if group_size > 1 else None
        self.stores: dict[int, Any] = {}  # group: its current generation's store (the last reference)
        self.addresses: dict[int, str] = {}
        self.taken: set[int] = set()  # workers shut down with their group's loss, not yet found failed

    def after_worker_group_start(self, worker_group) -> None:
        global _RUNNING
        _RUNNING = self  # the failure policy's (`counted_already`), in this same controller process
        self.worker_group = worker_group
        self.taken = set()  # every worker starts anew
        worker_group.execute(mark_start, STARTS_WITH_GROUP)
        if self.generations is None:
            return
        workers = worker_group.get_workers()
        for group, generation in self.generations.start_all(len(workers)).items():
            self._new_store(group, generation)
        for index, worker in enumerate(workers):
            group = worker.distributed_context.world_rank // self.group_size
            worker_group.execute_single(index, mark_group, self.addresses[group])

    def before_worker_group_shutdown(self, worker_group) -> None:
        self.worker_group = None

    def after_replica_group_start(self, replica_group) -> None:
        replica_group.execute(mark_start, REPLACES_ONE)
        if self.generations is None:
            return
        rank = replica_group.get_workers()[0].distributed_context.world_rank
        group, generation, new = self.generations.start_one(rank)
        if new:
            self._new_store(group, generation)
        replica_group.execute(mark_group, self.addresses[group])

    def _new_store(self, group: int, generation: int) -> None:
        """A new store for `group`'s `generation`, on this node; the previous one closes (its
        workers, which are leaving, learn it at their next beat)."""
        import ray
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
        self.stores[group] = store
        self.addresses[group] = f"{host}:{store.port}:{generation}"

    def before_controller_execute_resize_decision(self, decision) -> None:
        """Shut down every failing replica group before the controller replaces any of them."""
        worker_group = self.worker_group
        if worker_group is None:
            return
        status = worker_group.poll_status(timeout=POLL_TIMEOUT_S)  # what the controller reads next
        if not partial_loss(status):
            return  # nothing to replace, or the controller restarts the whole group
        failing = status.failing_replica_group_indices
        groups = worker_group.get_replica_groups() or []
        # With replica groups of several workers, a failing worker's group goes with it (the
        # controller replaces the others once it finds them down, and the failure policy does
        # not count them again: `taken`).
        out = set(failing) if self.generations is None else self.generations.taken_out(failing)
        self.taken |= out - set(failing)
        for index in sorted(out):
            if index < len(groups) and groups[index].is_active():
                groups[index].shutdown()

    def counted_already(self, failed_ranks: "set[int]") -> bool:
        """Whether these failed workers were taken out with their group's loss, which counted
        as one failure (each is forgotten once asked about)."""
        known, self.taken = failed_ranks & self.taken, self.taken - failed_ranks
        return bool(failed_ranks) and known == failed_ranks


class GroupController(TrainController):
    """Ray Train's controller for a per-step run, where a lost replica group waits for room.

    Ray 2.60 replaces a failing replica group at once, in its placement group's slots
    (`WorkerGroup.replace_replica_group`), and waits without a limit for the new workers to
    start (`ray.get` of their metadata in `WorkerGroup._create_workers`). When the group's
    node is gone for good and no other node has room, its slots cannot be placed: the
    controller stops in that wait. The survivors keep training without it (their quorum
    does not need the controller), but nothing polls them any more, so a run they finish never
    ends. And a replacement of another group, or the end of the run, is never seen.

    Here a failing group whose slots have no node (`placement_group_table`: a bundle of the
    lost node has none until the placement group is rescheduled on another) is shut down
    and left waiting: the controller goes on polling the others, leaves the waiting group out
    of what it reads (its workers count as finished, without an error: the loss was counted
    when it happened), and starts the group again as soon as its slots are placed again (a
    node came back, or the autoscaler added one). A failure never shrinks the worker group:
    its size is the most workers the run started with, and the quorum holds those that are
    alive (`--workers MIN:MAX` sets how many it starts with)."""

    evict_key: bytes | None = None  # --evict-stragglers: a group on an evicted node has no room (raytrain.faults.evict)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting: set[int] = set()  # replica groups (Ray's: one per worker) without room

    def _start_worker_group(self, num_workers: int, resources_per_worker: dict) -> None:
        self.waiting = set()  # a new worker group: every group starts
        super()._start_worker_group(num_workers, resources_per_worker)

    def _execute_resize_decision(self, decision: ResizeDecision):
        worker_group = self.get_worker_group()
        status = worker_group.get_latest_poll_status() if worker_group is not None else None
        if status is not None and partial_loss(status):  # replace in place, never shrink
            decision = ResizeDecision(len(worker_group.get_workers()), decision.resources_per_worker)
        return super()._execute_resize_decision(decision)

    def _replace_bad_workers(self, poll_status: WorkerGroupPollStatus) -> None:
        worker_group = self.get_worker_group()
        for index in sorted(poll_status.failing_replica_group_indices):
            if index in self.waiting or not self._has_room(index):
                group = worker_group.get_replica_groups()[index]
                if group.is_active():
                    group.shutdown()
                if index not in self.waiting:
                    logger.warning(
                        "raytrain: replica group %d cannot be placed (its node is gone and no other has room); "
                        "the others train on, and it starts again when there is room",
                        index,
                    )
                self.waiting.add(index)
            else:
                worker_group.replace_replica_group(index)

    async def _poll_workers(self) -> WorkerGroupPollStatus:
        for index in sorted(self.waiting):
            if self._has_room(index):
                self.waiting.discard(index)
                try:
                    self.get_worker_group().replace_replica_group(index)
                except Exception as error:  # its node went again while it started: it waits again
                    logger.warning("raytrain: replica group %d failed to start again (%s); it waits", index, error)
                    self.waiting.add(index)
        status = await super()._poll_workers()
        if not self.waiting:
            return status
        waiting_ranks = {
            rank for rank, group in (status.worker_rank_to_replica_group_rank or {}).items() if group in self.waiting
        }
        statuses = {
            rank: WorkerStatus(running=False) if rank in waiting_ranks else worker
            for rank, worker in status.worker_statuses.items()
        }
        return WorkerGroupPollStatus(statuses, status.worker_rank_to_replica_group_rank)

    def _has_room(self, index: int) -> bool:
        """Whether every slot of replica group `index` is placed on a node, and none of them on an
        evicted one (`raytrain.faults.evict`: kept out to the run's end)."""
        from ray.util.placement_group import placement_group_table

        worker_group = self.get_worker_group()
        placement_group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        nodes = placement_group_table(placement_group).get("bundles_to_node_id") or {}
        slots = [
            worker.placement_group_bundle_index for worker in worker_group.get_replica_groups()[index].get_workers()
        ]
        out = evicted_nodes(self.evict_key) if self.evict_key is not None else set()
        return all(nodes.get(slot) and nodes.get(slot) not in out for slot in slots)


def group_scaling_policy(scaling_config, group_size: int, evict_key: bytes | None = None):
    """Ray Train's elastic scaling policy for a per-step run of replica groups of `group_size`
    workers: it counts the workers the cluster can hold in whole groups (at least MIN, which is
    itself whole groups), and never shrinks a running group. Ray 2.60 replaces a failing
    replica group in place only at an unchanged worker count; a resize restarts every group
    from the last checkpoint (`TrainController._execute_resize_decision`): here only a growth
    past the size the run started with."""

    class GroupScalingPolicy(ElasticScalingPolicy):
        def _count_possible_workers(self, reserved_resources) -> int:
            return whole_groups(super()._count_possible_workers(reserved_resources), group_size)

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
            if isinstance(decision, ResizeDecision) and decision.num_workers < worker_group_state.num_workers:
                # Never shrink a running group: a lost group waits for room (`GroupController`),
                # and the resources Ray counts lag behind a node that came back (seen: a
                # shrink to 2 decided just after the lost group had started again).
                return NoopDecision()
            return decision

        def make_decision_for_non_running_worker_group(self):
            decision = super().make_decision_for_non_running_worker_group()
            groups = _RUNNING
            live = groups.worker_group if groups is not None else None
            status = live.get_latest_poll_status() if live is not None else None
            if isinstance(decision, NoopDecision) and status is not None and partial_loss(status):
                # Room for fewer than MIN, but survivors train on: Ray would wait here for room
                # polling no one, so a run they finish would never end. The lost groups wait for
                # room in place instead (`GroupController`; a replacement ignores the resources).
                return ResizeDecision(len(live.get_workers()), dict(self.scaling_config.resources_per_worker or {}))
            return decision

    if evict_key is not None:  # no worker counted on an evicted node
        return evicting_policy(scaling_config, evict_key, base=GroupScalingPolicy)
    return GroupScalingPolicy(scaling_config=scaling_config)


# The lighthouse waits up to join_timeout_ms for every live (heartbeating) replica before it
# forms a quorum: torchft's 100 ms default is shorter than a step, so the replicas would never
# all meet; 30 s covers a replica still writing a checkpoint at an epoch's end. A replica is
# gone after heartbeat_timeout_ms without a heartbeat: what the survivors wait when one dies
# (measured here: about 1 s lost per failure at 1000 ms).
JOIN_TIMEOUT_S = 30.0
HEARTBEAT_TIMEOUT_S = 1.0


class _Backend(BindsInterfaces, _TorchftBackend):
    """Ray Train's torchft backend, bound to each node's interface (`raytrain.worker.network`),
    with a lighthouse that asks for no CPU. Ray 2.60 pins the
    lighthouse to the controller's node as an actor with the default request of 1 CPU for
    scheduling: on a cluster whose head has none (`ray start --head --num-cpus=0`, where the
    driver and the controller run), it can never be placed and the run never starts. It
    answers a few small requests per step: it needs no CPU of its own."""

    def _maybe_create_lighthouse_actor(self, backend_config) -> str:
        import ray

        if self.lighthouse_actor is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            self.lighthouse_actor = ray_torchft.LighthouseServerActor.options(
                num_cpus=0, scheduling_strategy=here
            ).remote(lighthouse_kwargs={"bind": "[::]:0", **backend_config.lighthouse_kwargs})
        # The lighthouse says its address by the hostname, which often resolves to loopback
        # (`raytrain.rules.network`): replicas on other hosts would dial themselves. It runs on
        # this node, so this node's Ray address reaches it.
        address = super()._maybe_create_lighthouse_actor(backend_config)  # its address, from the actor
        return network.with_host(address, ray.util.get_node_ip_address())


class _TorchftConfig(ray_torchft.TorchftConfig):
    @property
    def backend_cls(self):
        return _Backend


def torchft_config(use_gpu: bool, timeout_s: float, min_groups: int = 1):
    """The TorchTrainer's torch_config in per-step mode. `min_groups`: the fewest replica
    groups a quorum takes a step with (an elastic run's MIN, in groups; a fixed run's
    survivors go on whatever is lost)."""
    return _TorchftConfig(
        lighthouse_kwargs={
            "min_replicas": min_groups,
            "join_timeout_ms": int(JOIN_TIMEOUT_S * 1000),
            "heartbeat_timeout_ms": int(HEARTBEAT_TIMEOUT_S * 1000),
        },
        backend="nccl" if use_gpu else "gloo",
        timeout_s=timeout_s,  # seconds as given: Ray makes a timedelta of them (0.5 stays 0.5)
    )


class ReplacementRetries:
    """Per-step's decision on a failure, before Ray's policy: a worker taken out with its group's
    loss is retried (the loss counted once); a replica lost while another was being replaced
    fails that replacement with a controller error Ray never retries: retried here, within
    --max-failures (the retry's fresh poll finds both)."""

    def __init__(self) -> None:
        self.retried = 0

    def decide(self, error: BaseException, max_failures: int) -> FailureDecision | None:
        groups = _RUNNING  # the callback taking groups out
        if groups is not None and groups.counted_already(set(getattr(error, "worker_failures", None) or {})):
            return FailureDecision.RETRY
        if lost_while_replacing(error):
            self.retried += 1
            return (
                FailureDecision.RETRY if max_failures == -1 or self.retried <= max_failures else FailureDecision.RAISE
            )
        return None
