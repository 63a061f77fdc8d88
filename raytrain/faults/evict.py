"""Nodes a run holds out: evicted for being stragglers (`--evict-stragglers`) or left on a
preemption notice (`raytrain.instruments.notice`), kept out to the run's end; and nodes whose
workers went silent, suspected until they answer again (`Suspects`).

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

import contextlib
import logging
import threading
import time
from typing import Any

import ray

from raytrain.faults.ray_internals import (
    NODE_ID_LABEL,
    ControllerCallback,
    ElasticScalingPolicy,
    WorkerGroupCallback,
    WorkerHealthCheckTimeoutError,
    _internal_kv_del,
    _internal_kv_list,
    _internal_kv_put,
)

EVICTED_NAMESPACE = "raytrain"  # Ray's internal key-value store: the nodes evicted from each run
SUSPECTED = b"~suspected"  # after a run's key: its nodes suspected, until they answer
# A worker whose poll by the controller (every 0.25 s: raytrain.driver.launch) has not answered
# for this long is taken as gone, its node suspected: a host cut off, frozen or lost is then
# left without waiting for the head to declare its node dead (Ray's default health checks:
# 62-65 s). Ray Train's own default is 600 s. Restart mode's (`RestartMode.silent_worker_s`).
SILENT_WORKER_S = 10.0
PROBE_EVERY_S = 2.0  # a suspected node's answer asked for this often, each given as long

logger = logging.getLogger(__name__)


def run_key(storage: str, name: str | None, invocation: str) -> bytes:
    """The key of the nodes one invocation of a run evicted, in Ray's internal key-value store:
    a `--resume` starts with none."""
    return f"evicted:{storage.rstrip('/')}/{name}/{invocation}".encode()


def evicted_nodes(key: bytes) -> set[str]:
    """The Ray node ids the run of `key` holds out now (one entry each under the key): those evicted
    or left, and those suspected."""
    if not ray.is_initialized():
        return set()
    return _listed(key + b"/") | _listed(key + SUSPECTED + b"/")


def _listed(prefix: bytes) -> set[str]:
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


class Suspects(WorkerGroupCallback):
    """Nodes whose workers went silent, held out of the next worker group until they answer again.

    The controller polls every worker; one whose poll has hung past `SILENT_WORKER_S` fails the
    attempt (Ray Train's WorkerHealthCheckTimeoutError), and its node is written down as suspected
    under the run's key: the restart is placed without it (`KeepEvictedOut`, `Evicting`) at once,
    rather than once the head has declared it dead. A thread in the controller asks each suspected
    node for a trivial task every `PROBE_EVERY_S`; one that answers is no longer suspected (a false
    suspicion cost a smaller restart, and an elastic run grows back), one the head declared dead is
    gone (a node that comes back is a new one)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.node_of: dict[int, str] = {}  # world rank -> its Ray node id, of the running group
        self._probing: Any = None

    def after_worker_group_start(self, worker_group: Any) -> None:
        self.node_of = {w.distributed_context.world_rank: w.metadata.node_id for w in worker_group.get_workers()}

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        silent = {
            self.node_of[rank]
            for rank, status in worker_group_status.worker_statuses.items()
            if isinstance(status.error, WorkerHealthCheckTimeoutError) and rank in self.node_of
        }
        for node in silent:
            with contextlib.suppress(Exception):  # the store unreachable: Ray's own failure handling goes on
                _internal_kv_put(
                    self.key + SUSPECTED + b"/" + node.encode(), b"1", overwrite=True, namespace=EVICTED_NAMESPACE
                )
        if silent and self._probing is None:  # one thread for the run, from the first suspicion on
            self._probing = threading.Thread(target=self._probe, name="raytrain-suspects", daemon=True)
            self._probing.start()

    def _probe(self) -> None:
        while True:
            try:
                self.probe_once()
            except Exception:  # noqa: BLE001 - the GCS unreachable a moment: asked again
                logger.warning("raytrain could not probe its suspected nodes; it will try again", exc_info=True)
            time.sleep(PROBE_EVERY_S)

    def probe_once(self) -> None:
        """Every suspected node that answers, or that the head declared dead, is no longer held out."""
        prefix = self.key + SUSPECTED + b"/"
        suspected = _listed(prefix)
        if not suspected:
            return
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        for node in suspected:
            if node not in alive or _answers(node, PROBE_EVERY_S):
                _internal_kv_del(prefix + node.encode(), namespace=EVICTED_NAMESPACE)


def forget_run(key: bytes) -> None:
    """The nodes the run of `key` held out, forgotten from Ray's key-value store (its controller
    returned; a run that failed leaves its few entries, under a key no later run reads)."""
    with contextlib.suppress(Exception):  # the cluster gone with the run: nothing left to forget
        for prefix in (key + b"/", key + SUSPECTED + b"/"):
            _internal_kv_del(prefix, del_by_prefix=True, namespace=EVICTED_NAMESPACE)


@ray.remote(num_cpus=0)
def _answer() -> bool:
    return True


def _answers(node: str, timeout_s: float) -> bool:
    """Whether `node` runs a trivial task within `timeout_s`."""
    ref = _answer.options(label_selector={NODE_ID_LABEL: node}).remote()
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
    return bool(ready)
