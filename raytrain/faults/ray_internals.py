"""Ray's private surface that raytrain's driver and fault tolerance reach, imported here once.

Ray Train 2.60's public API is its configs, the trainer and `UserCallback` (after_report,
after_exception). Its controller, the failure and scaling policies, the other callbacks and the
decisions they exchange are `_internal`; so are Ray Data's view of the cluster that the elastic
policy reads and Ray's key-value store. raytrain's modules take them from here
(tests/test_style.py says why each is needed); a class that overrides Ray's own keeps its
overrides (`raytrain.driver.failfast`, `raytrain.faults.replacement`).
"""

# ruff: noqa: F401 - the imports are for the modules that take them from here
from __future__ import annotations

from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import get_or_create_autoscaling_coordinator
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list, _internal_kv_put
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError
from ray.train.v2._internal.execution.callback import ControllerCallback, ReplicaGroupCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, NoopDecision, ResizeDecision
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
from ray.train.v2.torch.torchft_config import _TorchftBackend

# The label Ray gives every node, its id ("Default node labels" in Ray's docs on labels).
NODE_ID_LABEL = "ray.io/node-id"
