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
"""

from __future__ import annotations

import os
from typing import Any

from ray.exceptions import RayActorError
from ray.train import ControllerError
from ray.train.v2._internal.execution.callback import ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback

from raytrain.rules.replicas import GROUP_STORE_ENV, REPLACES_ONE, START_ENV, STARTS_WITH_GROUP, GroupGenerations

# The controller's callback, for its failure policy: Ray hands the controller each of them as
# its own copy, so the policy finds the callback here (one controller per process).
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
        failing, every = status.failing_replica_group_indices, status.all_replica_group_indices
        if not failing or failing == every:
            return  # nothing to replace, or the controller restarts the whole group
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


def running() -> "ReplicaGroups | None":
    """The callback of the controller running in this process (None before its group starts)."""
    return _RUNNING


__all__ = ["ReplicaGroups", "lost_while_replacing", "mark_group", "mark_start", "running"]
