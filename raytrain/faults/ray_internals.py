"""Ray's private surface that raytrain's driver and fault tolerance reach, imported here once.

Ray Train 2.60's public API is its configs, the trainer and `UserCallback` (after_report,
after_exception). The controller that `fit` builds, its failure and scaling policies, its other
callbacks and the decisions they exchange are all `_internal`; so is Ray Data's view of the
cluster that the elastic policy reads, and Ray's key-value store, which every worker and the
controller reach. raytrain's modules take them from here (tests/test_style.py says why each is
needed); what a class of theirs overrides of Ray's stays in that module
(`raytrain.driver.failfast`, `raytrain.faults.replacement`), listed there too.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.execution.callback import ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
from ray.train.v2.torch.torchft_config import _TorchftBackend

# The label Ray gives every node, its id ("Default node labels" in Ray's docs on labels).
NODE_ID_LABEL = "ray.io/node-id"


def autoscaling_coordinator() -> Any:
    """Ray Data's AutoscalingCoordinator actor, whose reservations Ray Train's elastic policy counts."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    return get_or_create_autoscaling_coordinator()


def kv_keys(prefix: bytes, namespace: str) -> list[bytes]:
    """The keys under `prefix` in Ray's key-value store (none while Ray is down)."""
    from ray.experimental.internal_kv import _internal_kv_list

    return _internal_kv_list(prefix, namespace=namespace) if ray.is_initialized() else []


def kv_put(key: bytes, value: bytes, namespace: str) -> None:
    """`key` set to `value` in Ray's key-value store."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=namespace)


__all__ = [
    "NODE_ID_LABEL",
    "ControllerCallback",
    "DatasetsCallback",
    "ElasticScalingPolicy",
    "FailureDecision",
    "NoopDecision",
    "ReplicaGroupCallback",
    "ResizeDecision",
    "TrainController",
    "WorkerGroupCallback",
    "WorkerGroupPollStatus",
    "WorkerStatus",
    "_TorchftBackend",
    "autoscaling_coordinator",
    "kv_keys",
    "kv_put",
]
