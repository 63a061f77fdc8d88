"""Hosts evicted for being stragglers (`--evict-stragglers`), kept out of the run to its end.

A worker decides (`raytrain.instruments.watch`): every rank holds the same figures after the log
sync, so every rank finds the same straggler at the same step. The straggler's worker writes
its Ray node id under the run's key (one per invocation of the driver) in Ray's internal
key-value store (`hold_out_this_node`), then the attempt ends (restart mode: every rank raises
and Ray Train restarts the group; per-step: the straggler's replica group leaves at the next
step's start and the others train on).

The controller reads the key (`evicted_nodes`) where it decides:

- `Evicting`, a mixin of Ray Train's elastic scaling policy, counts no worker on an evicted
  node: the group restarts at the size the other nodes hold;
- `KeepEvictedOut`, a controller callback, gives every new worker group a label selector
  that excludes the evicted nodes (`ray.io/node-id` not in them): no worker is placed there;
- per-step, `raytrain.faults.replacement.GroupController` leaves a replica group whose slots
  are on an evicted node waiting, as one whose node is gone.
"""

from __future__ import annotations

from typing import Any

import ray

from raytrain.faults.ray_internals import (
    NODE_ID_LABEL,
    ControllerCallback,
    ElasticScalingPolicy,
    _internal_kv_list,
    _internal_kv_put,
)

EVICTED_NAMESPACE = "raytrain"  # Ray's internal key-value store: the nodes evicted from each run


def run_key(storage: str, name: str | None, invocation: str) -> bytes:
    """The key of the nodes one invocation of a run evicted, in Ray's internal key-value store:
    a `--resume` starts with none."""
    return f"evicted:{storage.rstrip('/')}/{name}/{invocation}".encode()


def evicted_nodes(key: bytes) -> set[str]:
    """The Ray node ids evicted from the run of `key` so far (one entry each under the key)."""
    if not ray.is_initialized():
        return set()
    prefix = key + b"/"
    return {entry[len(prefix) :].decode() for entry in _internal_kv_list(prefix, namespace=EVICTED_NAMESPACE)}


def hold_out_this_node(key: bytes) -> str:
    """On a worker: add its Ray node to the run's evicted nodes; returns its id."""
    node_id = ray.get_runtime_context().get_node_id()
    _internal_kv_put(key + b"/" + node_id.encode(), b"1", overwrite=True, namespace=EVICTED_NAMESPACE)
    return node_id


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
    policy_class = type("EvictingScalingPolicy", (Evicting, base or ElasticScalingPolicy), {"evicting_key": key})
    return policy_class(scaling_config=scaling_config)


class KeepEvictedOut(ControllerCallback):
    """Every new worker group placed off the evicted nodes (see the module's docstring)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def on_controller_start_worker_group(self, *, scaling_config: Any, num_workers: int) -> dict[str, str] | None:
        try:
            out = sorted(evicted_nodes(self.key))
        except Exception:  # noqa: BLE001 - the store unreachable: placed as Ray would, evicted again if slow
            return None
        return {NODE_ID_LABEL: f"!in({', '.join(out)})"} if out else None
