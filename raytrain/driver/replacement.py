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
"""

from __future__ import annotations

import os

from ray.exceptions import RayActorError
from ray.train import ControllerError
from ray.train.v2._internal.execution.callback import ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback

from raytrain.rules.replicas import REPLACES_ONE, START_ENV, STARTS_WITH_GROUP

# How long the controller's extra poll waits for a worker's answer (a live worker answers at
# once; a dead one fails at once).
POLL_TIMEOUT_S = 2.0


def mark_start(kind: str) -> None:
    """On a worker, before its training function runs: how it starts."""
    os.environ[START_ENV] = kind


def lost_while_replacing(error: Exception) -> bool:
    """A controller error from a dead actor: under per-step fault tolerance, a replica that died
    while the controller was replacing another (see the module's docstring)."""
    return isinstance(error, ControllerError) and isinstance(error.controller_failure, RayActorError)


class ReplicaGroups(ControllerCallback, WorkerGroupCallback, ReplicaGroupCallback):
    """Runs in Ray Train's controller of a per-step run (see the module's docstring)."""

    def __init__(self) -> None:
        self.worker_group = None

    def after_worker_group_start(self, worker_group) -> None:
        self.worker_group = worker_group
        worker_group.execute(mark_start, STARTS_WITH_GROUP)

    def before_worker_group_shutdown(self, worker_group) -> None:
        self.worker_group = None

    def after_replica_group_start(self, replica_group) -> None:
        replica_group.execute(mark_start, REPLACES_ONE)

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
        for index in sorted(failing):
            if index < len(groups) and groups[index].is_active():
                groups[index].shutdown()


__all__ = ["ReplicaGroups", "lost_while_replacing", "mark_start"]
