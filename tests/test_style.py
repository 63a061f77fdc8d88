"""The code stays as it is laid out: formatted, linted, private Ray names listed, and the
public surface small (pure tier)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ray_surface import copies, defines, private_ray_names, ray_object, source_digest

import raytrain

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "raytrain"

# Every private Ray name raytrain uses, by the module that uses it (what counts as a use:
# tests/ray_surface.py), each with why: each pins raytrain to Ray's minor version (pyproject:
# ray >=2.60,<2.61). An upgrade that moves or removes one fails here first; revisit these modules
# then. Nothing else may reach into Ray's internals. Train V2's public surface in 2.60
# (ray.train.v2.api) is its configs, the trainer's public methods and UserCallback (after_report,
# after_exception, added through RunConfig(callbacks=...)); the failure and scaling policies, the
# controller and its other callbacks are all _internal, and `fit` builds its own policies.
PRIVATE_RAY_NAMES = {
    # Ray Data's logical plan read and rebuilt over some of its units (the module's docstring):
    # Ray Data 2.60 has no public API that lists a plan's read units or reads only some of them.
    "raytrain.data.shards": {
        # the file listing Ray's own file read runs: row groups and their row counts
        "ray.data._internal.datasource_v2.common.listing_utils.list_files_for_each_block",
        # that listing's footer readers, no more than the cluster has CPUs (_right_size_footer_readers)
        "ray.data._internal.datasource_v2.formats.parquet.footer_file_indexer.FooterFileIndexer._max_inflight_batches",
        "ray.data._internal.datasource_v2.formats.parquet.footer_file_indexer.FooterFileIndexer._num_actors",
        "ray.data._internal.datasource_v2.interfaces.file_manifest.PATH_COLUMN_NAME",  # a manifest row's path
        "ray.data._internal.execution.interfaces.BlockEntry",  # a unit's block, for the new source
        "ray.data._internal.execution.interfaces.RefBundle",  # the new source's input
        "ray.data._internal.logical.interfaces.LogicalPlan",  # the plan of the dataset over some units
        "ray.data._internal.logical.interfaces.SourceOperator",  # a source that holds its blocks
        # each step above the source, copied onto the new source
        "ray.data._internal.logical.interfaces.logical_operator.LogicalOperator._with_new_input_dependencies",
        "ray.data._internal.logical.operators.InputData",  # blocks as a source, theirs and ours
        "ray.data._internal.logical.operators.Limit",  # at most `limit` rows through the pipeline's steps
        "ray.data._internal.logical.operators.ListFiles",  # the sources `split` cuts: a file listing,
        "ray.data._internal.logical.operators.Read",  # a datasource's read tasks,
        "ray.data._internal.logical.operators.ReadFiles",  # the file read above a listing
        "ray.data._internal.logical.operators.map_operator.AbstractMap",  # per-row steps, kept above the source
        "ray.data._internal.logical.operators.one_to_one_operator.AbstractOneToOne",
        "ray.data._internal.logical.operators.one_to_one_operator.Limit",  # a limit in the plan: not cut
        "ray.data._internal.stats.DatasetStats",  # the new dataset's (empty) stats
        "ray.data.dataset.Dataset._logical_plan",  # the plan a dataset holds: no public getter
    },
    # Ray Train's controller started with raytrain's controller class and signal handling.
    "raytrain.driver.failfast": {
        # In the copy of Ray's controller start (COPIED_RAY_CODE), as Ray writes them.
        "ray._common.constants.RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR",
        "ray.train.v2._internal.constants.DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE",
        "ray.train.v2._internal.constants.get_env_vars_to_propagate",
        # Overridden, no public equivalent: where `fit` hands the controller its failure and
        # scaling policies and callbacks (RunConfig(callbacks=...) only adds to Ray's, and
        # DatasetsCallback must be replaced), and Ray's controller class, which this copy replaces
        # (Ray takes none), and whose SIGINT handler raytrain's signal handling replaces.
        "ray.train.v2.api.data_parallel_trainer.DataParallelTrainer._initialize_and_run_controller",
    },
    "raytrain.driver.session": {
        # The system config the joined head was started with (its health checks: what a run and
        # `raytrain doctor` say of them); Ray 2.60 has no public read of a cluster's system config.
        "ray._private.state.state",
    },
    # The one module that imports Ray's private names for raytrain's driver and fault tolerance
    # (failfast, resources, evict, replacement take them from it).
    "raytrain.faults.ray_internals": {
        # Ray's datasets callback without its dataset manager, for a trainer without datasets.
        "ray.train.v2._internal.callbacks.DatasetsCallback",
        # The controller's hooks: a worker or replica group started or polled, a failure or a
        # resize about to be acted on, a new worker group's label selector
        # (on_controller_start_worker_group): UserCallback has only after_report and after_exception.
        "ray.train.v2._internal.execution.callback.ControllerCallback",
        "ray.train.v2._internal.execution.callback.ReplicaGroupCallback",
        "ray.train.v2._internal.execution.callback.WorkerGroupCallback",
        "ray.train.v2._internal.execution.controller.TrainController",  # started by raytrain, GroupController's base
        # The failure policy's answer (FailFastPolicy, ReplacementRetries): the controller takes only
        # an _internal policy, and `fit` builds Ray's from FailureConfig (create_failure_policy), no hook.
        "ray.train.v2._internal.execution.failure_handling.FailureDecision",
        # The elastic policy counting no worker on an evicted node, or in whole groups: `fit`
        # builds Ray's (create_scaling_policy), no hook; and the decisions it answers.
        "ray.train.v2._internal.execution.scaling_policy.ElasticScalingPolicy",
        "ray.train.v2._internal.execution.scaling_policy.NoopDecision",
        "ray.train.v2._internal.execution.scaling_policy.ResizeDecision",
        "ray.train.v2._internal.execution.worker_group.poll.WorkerGroupPollStatus",  # a poll's status, rebuilt
        "ray.train.v2._internal.execution.worker_group.poll.WorkerStatus",  # a waiting worker's: finished
        # Ray Train's torchft backend, a private class (TorchftConfig.backend_cls), subclassed for a
        # lighthouse that asks for no CPU: no option or hook sets the lighthouse actor's resources.
        "ray.train.v2.torch.torchft_config._TorchftBackend",
        # An elastic run's view of the cluster refreshed (driver.resources): the coordinator reads
        # the nodes only every 20 s.
        "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator.get_or_create_autoscaling_coordinator",
        # The nodes a run evicted, written by a worker and read by the controller (faults.evict):
        # Ray's key-value store in the GCS, which both reach; Ray 2.60 has no public one.
        "ray.experimental.internal_kv._internal_kv_list",
        "ray.experimental.internal_kv._internal_kv_put",
        # ... and a suspected node's entry removed once it answers (faults.evict.Suspects).
        "ray.experimental.internal_kv._internal_kv_del",
        # A worker whose poll hung past its limit (faults.evict.Suspects suspects its node): the
        # error Ray Train's worker group gives it, in a poll status; no public type.
        "ray.train.v2._internal.exceptions.WorkerHealthCheckTimeoutError",
    },
    # Ray Train's controller of a per-step run and its elastic policy in whole groups: overrides
    # where no hook, public or _internal, reaches what each changes.
    "raytrain.faults.replacement": {
        # a replacement kept in place at the running size (a scaling policy decides without the
        # poll's status, and before_controller_execute_resize_decision cannot change a decision);
        "ray.train.v2._internal.execution.controller.controller.TrainController._execute_resize_decision",
        # a lost group's restart once there is room, and its workers read as finished meanwhile
        # (no hook sees or changes a poll's status);
        "ray.train.v2._internal.execution.controller.controller.TrainController._poll_workers",
        # a group without room left waiting instead of Ray's unbounded wait in replace_replica_group;
        "ray.train.v2._internal.execution.controller.controller.TrainController._replace_bad_workers",
        # the waiting groups forgotten when a whole new worker group starts (they start with it);
        "ray.train.v2._internal.execution.controller.controller.TrainController._start_worker_group",
        # the workers the cluster can hold, counted in whole groups;
        "ray.train.v2._internal.execution.scaling_policy.elastic.ElasticScalingPolicy._count_possible_workers",
        # the lighthouse actor created with no CPU asked (see ray_internals' _TorchftBackend).
        "ray.train.v2.torch.torchft_config._TorchftBackend._maybe_create_lighthouse_actor",
    },
    "raytrain.instruments.notice": {
        # The nodes being drained, with their deadlines (a preemption notice): what Ray Train's own
        # preemption watcher reads too; Ray 2.60 has no public read of the GCS's draining nodes.
        "ray._private.state.state",
    },
    "raytrain.worker.network": {
        # Ray Train's torch backend, a private class (TorchConfig.backend_cls), subclassed to run a
        # step on every worker before its on_start creates the process group: gloo and NCCL choose
        # their interface inside init_process_group, from the worker's environment, and no option
        # or hook of Ray 2.60 runs in a worker before it (a runtime_env's worker_process_setup_hook
        # is read from ray.init's job config only, not from RunConfig.worker_runtime_env).
        "ray.train.torch.config._TorchBackend",
    },
}
# The Ray release the names above were read from: another one fails
# test_the_private_names_were_read_from_the_installed_ray until they are read again.
PRIVATE_NAMES_READ_FROM = "2.60.0"

# Ray code copied into raytrain, by the copy (marked `# A copy of <the Ray name>` in it): the Ray
# function it mirrors, and a digest of the source it was made from. A Ray whose source differs,
# a patch release too, fails test_every_copy_of_ray_code_was_made_from_the_installed_source:
# bring the copy up to date, then the digest (tests/ray_surface.py: `source_digest`).
COPIED_RAY_CODE = {
    # Ray's controller start with raytrain's controller class, which Ray's takes no argument for
    "raytrain.driver.failfast.FailFastTrainer._run_controller": (
        "ray.train.v2.api.data_parallel_trainer.DataParallelTrainer._initialize_and_run_controller",
        "ea57ec4498323973",
    ),
}


def _modules() -> list[tuple[str, str]]:
    """(module, its source) for every module of the package."""
    return [
        (".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"), path.read_text())
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _private_ray_names() -> dict[str, set[str]]:
    """module -> the private Ray names it uses (tests/ray_surface.py)."""
    found = {module: private_ray_names(source) for module, source in _modules()}
    return {module: names for module, names in found.items() if names}


def _copies_of_ray_code() -> dict[str, str]:
    """`module.Class.function` -> the Ray name it copies, by the marks in the package."""
    return {f"{module}.{copy}": name for module, source in _modules() for copy, name in copies(source).items()}


def test_private_ray_names_are_the_listed_ones_in_the_listed_modules():
    assert _private_ray_names() == PRIVATE_RAY_NAMES


def test_the_node_id_label_raytrain_writes_is_rays():
    """`ray.io/node-id`, Ray's documented default label of a node, written as a value (a label
    selector's key) where Ray's own code reads a private constant."""
    import ray._raylet

    from raytrain.faults.ray_internals import NODE_ID_LABEL

    assert NODE_ID_LABEL == ray._raylet.RAY_NODE_ID_KEY


def test_the_private_names_were_read_from_the_installed_ray():
    import ray

    assert ray.__version__ == PRIVATE_NAMES_READ_FROM, (
        f"Ray {ray.__version__} is installed; PRIVATE_RAY_NAMES were read from {PRIVATE_NAMES_READ_FROM}: check "
        "each listed use against the new release, then set PRIVATE_NAMES_READ_FROM"
    )


@pytest.mark.parametrize("name", sorted(n for names in PRIVATE_RAY_NAMES.values() for n in names))
def test_every_private_ray_name_exists_in_the_installed_ray(name):
    holder, member = name.rsplit(".", 1)
    value = ray_object(holder)
    if isinstance(value, type):  # a member of a class: its own, a base's, or an attribute its methods set
        assert any(defines(cls, member) for cls in value.__mro__), f"{name}: {holder} has no {member}"
    else:  # a module's name (ray._private.worker._global_node exists before Ray sets it)
        assert hasattr(value, member), f"{name}: {holder} has no {member}"


def test_every_copy_of_ray_code_is_listed():
    assert _copies_of_ray_code() == {copy: ray_name for copy, (ray_name, _) in COPIED_RAY_CODE.items()}


@pytest.mark.parametrize("copy", sorted(COPIED_RAY_CODE))
def test_every_copy_of_ray_code_was_made_from_the_installed_source(copy):
    ray_name, digest = COPIED_RAY_CODE[copy]
    assert source_digest(ray_name) == digest, (
        f"{ray_name} is not the source {copy} was copied from: compare them, bring the copy up to date, "
        f"then set its digest to {source_digest(ray_name)!r}"
    )


def test_the_scan_finds_a_private_base_class_and_the_private_members_a_class_overrides():
    source = """
from ray.train.v2.torch import torchft_config as ft

class Backend(ft._TorchftBackend):
    def _maybe_create_lighthouse_actor(self, config):
        return super()._maybe_create_lighthouse_actor(config)

def policy():
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    class InGroups(ElasticScalingPolicy):  # a class inside a function, on a Ray class reached by its public name
        def _count_possible_workers(self, reserved):
            return 2
"""
    assert private_ray_names(source) == {
        "ray.train.v2.torch.torchft_config._TorchftBackend",
        "ray.train.v2.torch.torchft_config._TorchftBackend._maybe_create_lighthouse_actor",
        "ray.train.v2._internal.execution.scaling_policy.ElasticScalingPolicy",
        "ray.train.v2._internal.execution.scaling_policy.elastic.ElasticScalingPolicy._count_possible_workers",
    }


def test_the_scan_finds_private_attributes_of_objects_ray_gives():
    source = """
from ray.train.v2._internal.execution.controller import TrainController
from ray.util.placement_group import placement_group

class Controller(TrainController):
    def slots(self):
        group = self._worker_group  # set by Ray's controller
        if hasattr(group, "_worker_group_state"):
            return group._worker_group_state.placement_group_handle.placement_group

def reserve():
    pg = placement_group([{"CPU": 1}])
    pg._fill_bundle_cache_if_needed()
    return pg
"""
    assert private_ray_names(source) == {
        "ray.train.v2._internal.execution.controller.TrainController",
        "ray.train.v2._internal.execution.controller.controller.TrainController._worker_group",
        "ray.train.v2._internal.execution.worker_group.worker_group.WorkerGroup._worker_group_state",
        "ray.util.placement_group.PlacementGroup._fill_bundle_cache_if_needed",
    }


def test_the_scan_leaves_out_private_names_that_are_not_rays():
    source = """
import os

import torch
from ray.train import ScalingConfig

class Mine:
    def __init__(self):
        self._steps = 0

    def step(self, other: "Mine"):
        self._steps += other._steps
        return self._steps

def shrink(module: torch.nn.Module):
    module._apply(lambda t: t)  # torch's (Ray has an `_apply` too)
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        os._exit(1)
    return ScalingConfig(num_workers=1)
"""
    assert private_ray_names(source) == set()


def test_a_copy_of_ray_code_is_found_by_its_mark():
    source = """
class Trainer:
    def start(self):
        # A copy of ray.train.v2.api.data_parallel_trainer.DataParallelTrainer._initialize_and_run_controller
        return 1

    def stop(self):
        return 0
"""
    name = "ray.train.v2.api.data_parallel_trainer.DataParallelTrainer._initialize_and_run_controller"
    assert copies(source) == {"Trainer.start": name}


def test_the_public_surface_is_the_documented_names():
    public = ["ConfigError", "FitResult", "Pipeline", "RunFailed", "Sampled", "TrainConfig", "context", "fit", "tune"]
    assert sorted(raytrain.__all__) == public
    from raytrain import rundir

    assert {"RunDir", "MetricsRow", "Event", "Summary", "Progress", "Kind"} <= set(rundir.__all__)


def test_every_module_of_the_package_stays_under_450_lines():
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: lines for path, lines in sizes.items() if lines > 450} == {}


def _ruff() -> list[str]:
    if shutil.which("ruff"):
        return ["ruff"]
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [sys.executable, "-m", "ruff"]


def test_the_code_is_formatted_as_ruff_format_writes_it():
    result = subprocess.run([*_ruff(), "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_nothing():
    result = subprocess.run([*_ruff(), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
