"""Hosts evicted for being stragglers (`--evict-stragglers`), kept out of the run to its end.

A worker decides (`raytrain.worker.watch`): every rank holds the same figures after the log
sync, so every rank finds the same straggler at the same step. The straggler's workers write
their Ray node id under the run's key in Ray's internal key-value store
(`raytrain.worker.runtime.hold_out_this_node`),
then the attempt ends (restart mode: every rank raises and Ray Train restarts the group;
per-step: the straggler's replica group leaves and the others train on).

The controller reads the key (`raytrain.worker.runtime.evicted_nodes`) where it decides:

- `Evicting`, a mixin of Ray Train's elastic scaling policy, counts no worker on an evicted
  node: the group restarts at the size the other nodes hold;
- `HoldEvicted`, a controller callback, places one actor on each evicted node, asking for all
  of its CPUs and GPUs, before the failure is acted on: it gets them as the straggler's
  workers exit, so no new placement group can use the node. The actors belong to the
  controller and end with the run;
- per-step, `raytrain.driver.replacement.GroupController` leaves a replica group whose slots
  are on an evicted node waiting, as one whose node is gone.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback

from raytrain.worker.runtime import evicted_nodes


class Evicting:
    """A mixin of Ray Train's `ElasticScalingPolicy`: the workers an evicted node could hold are
    not counted (`evicting_key` names the run)."""

    evicting_key: bytes = b""

    def _count_possible_workers(self, reserved_resources: dict[str, Any]) -> int:
        out = evicted_nodes(self.evicting_key)
        kept = {node: resources for node, resources in reserved_resources.items() if node not in out}
        return super()._count_possible_workers(kept)


def evicting_policy(scaling_config: Any, key: bytes, base: type | None = None) -> Any:
    """Ray Train's elastic scaling policy (or `base`, one of its subclasses) counting no evicted node."""
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    policy_class = type("EvictingScalingPolicy", (Evicting, base or ElasticScalingPolicy), {"evicting_key": key})
    return policy_class(scaling_config=scaling_config)


class HoldEvicted(ControllerCallback):
    """Before the controller acts on a failure, an actor on each newly evicted node asking for all
    of its CPUs and GPUs (see the module's docstring)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.holds: dict[str, Any] = {}  # node id: its actor

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        self.hold()

    def hold(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for node in ray.nodes():
            node_id = node["NodeID"]
            if node_id in self.holds or not node["Alive"] or node_id not in evicted_nodes(self.key):
                continue
            resources = node.get("Resources") or {}
            self.holds[node_id] = _Hold.options(
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()


class _HoldActor:
    """Holds a node's resources for as long as it lives: nothing of the run is placed there."""

    def ready(self) -> bool:
        return True


_Hold = ray.remote(_HoldActor)


__all__ = ["Evicting", "HoldEvicted", "evicting_policy"]
