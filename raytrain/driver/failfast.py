"""Ray Train's failure policy, but deterministic errors are not retried.

Ray Train retries every worker error up to `FailureConfig(max_failures)`. A `UserError`
(bad data, configuration, pipeline code, storage; `raytrain.errors`) would fail the same
way on every attempt, and a `DeterministicFault` has (a replica mismatch met again at the same
step), so the policy ends the run at the first one, whatever --max-failures (-1 included).
Worker deaths, lost nodes and collective timeouts keep Ray's policy and --max-failures.

Under per-step fault tolerance the controller also replaces lost replicas itself, and a
replica that dies while another is being replaced fails that replacement with a controller
error Ray never retries: this policy retries it, within --max-failures, and the trainer adds
the controller callback that makes the retry succeed (`raytrain.driver.replacement`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy

from raytrain.driver import interrupts, replacement
from raytrain.driver.evict import KeepEvictedOut, evicting_policy
from raytrain.driver.replacement import GroupController, ReplicaGroups, group_scaling_policy, lost_while_replacing
from raytrain.errors import NOT_RETRIED, find_error


class FailFastPolicy(FailurePolicy):
    def __init__(
        self,
        inner: FailurePolicy,
        replica_groups: bool = False,
        on_worker_failure: Callable[[BaseException], None] | None = None,
    ):
        super().__init__(inner.failure_config)
        self.inner = inner
        self.replica_groups = replica_groups
        self.replacements_retried = 0
        # Told of every failure that is not the user's (a worker died, a node was lost): where
        # raytrain says what the dead worker could not (`stall_reporter`).
        self.on_worker_failure = on_worker_failure

    def make_decision(self, training_failed_error) -> FailureDecision:
        if find_error(training_failed_error, NOT_RETRIED) is not None:
            return FailureDecision.RAISE
        if self.on_worker_failure is not None:
            self.on_worker_failure(training_failed_error)
        groups = replacement.running() if self.replica_groups else None  # the callback taking groups out
        failed = set(getattr(training_failed_error, "worker_failures", None) or {})
        if groups is not None and groups.counted_already(failed):
            return FailureDecision.RETRY  # taken out with its group's loss, which counted once
        if self.replica_groups and lost_while_replacing(training_failed_error):
            self.replacements_retried += 1
            limit = self.failure_config.max_failures
            within = limit == -1 or self.replacements_retried <= limit
            return FailureDecision.RETRY if within else FailureDecision.RAISE
        return self.inner.make_decision(training_failed_error)


class _WithoutDatasetManager(DatasetsCallback):
    def before_init_train_context(self, workers) -> dict:
        return {}  # no dataset shard provider: no DatasetManager actor


class FailFastTrainer(TorchTrainer):
    """A TorchTrainer whose controller uses FailFastPolicy around Ray's own policy (and, with
    replica groups, `ReplicaGroups`), and whose signals raytrain handles
    (`raytrain.driver.interrupts`) instead of Ray's SIGINT handler."""

    def __init__(
        self,
        *args,
        replica_group_size: int = 1,
        on_worker_failure: Callable[[BaseException], None] | None = None,
        evict_key: bytes | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.replica_group_size = replica_group_size  # workers per replica group (per-step)
        self.on_worker_failure = on_worker_failure
        self.evict_key = evict_key  # --evict-stragglers: the run's evicted nodes (raytrain.driver.evict)

    def _create_default_callbacks(self):
        """Ray's, but with no dataset manager when the trainer has no datasets (raytrain's
        workers read their own shards: `raytrain.data.sources`): Ray Train starts one more actor
        process per run for it, about 4 CPU seconds of imports for nothing. What else the
        callback does, handing the driver's Ray Data context to the workers, it still does."""
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [
            _WithoutDatasetManager(self.train_run_context, {}) if type(callback) is DatasetsCallback else callback
            for callback in callbacks
        ]

    def _initialize_and_run_controller(self, **kwargs):
        replica_groups = bool(getattr(self.backend_config.backend_cls, "has_replica_groups", False))
        if self.scaling_config.elasticity_enabled:
            from raytrain.driver.resources import FreshResources

            kwargs["callbacks"] = [*kwargs["callbacks"], FreshResources()]
        kwargs["failure_policy"] = FailFastPolicy(
            kwargs["failure_policy"], replica_groups=replica_groups, on_worker_failure=self.on_worker_failure
        )
        if self.evict_key is not None:  # an elastic run: keep evicted stragglers' nodes out
            kwargs["callbacks"] = [*kwargs["callbacks"], KeepEvictedOut(self.evict_key)]
            if not replica_groups:
                kwargs["scaling_policy"] = evicting_policy(self.scaling_config, self.evict_key)
        if not replica_groups:
            return super()._initialize_and_run_controller(**kwargs)
        kwargs["callbacks"] = [*kwargs["callbacks"], ReplicaGroups(self.replica_group_size)]
        if self.scaling_config.elasticity_enabled:  # an elastic run starts with whole groups
            kwargs["scaling_policy"] = group_scaling_policy(
                self.scaling_config, self.replica_group_size, self.evict_key
            )
        controller = GroupController
        if self.evict_key is not None:
            controller = type("GroupController", (GroupController,), {"evict_key": self.evict_key})
        return self._run_controller(controller, kwargs)

    def _run_controller(self, controller_cls, kwargs):
        """`DataParallelTrainer._initialize_and_run_controller` of Ray 2.60, with raytrain's
        controller class (Ray's takes none)."""
        # A copy of ray.train.v2.api.data_parallel_trainer.DataParallelTrainer._initialize_and_run_controller
        # (tests/test_style.py holds the digest of the source it was made from).
        import ray
        from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
        from ray.train.v2._internal.constants import (
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            get_env_vars_to_propagate,
        )

        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
        )
        here = ray.get_runtime_context().get_node_id()  # the controller runs beside the driver
        controller = ray.remote(
            num_cpus=0, label_selector={ray._raylet.RAY_NODE_ID_KEY: here}, runtime_env={"env_vars": env_vars}
        )(controller_cls).remote(**kwargs)
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())

    def _register_sigint_handler(self, controller) -> None:
        interrupts.set_controller(controller)


def stall_reporter(run_dir: Any, collective_timeout_s: float) -> Callable[[BaseException], None]:
    """What the controller runs when a worker failed: if the heartbeats show a collective waited
    out its timeout, an event naming the stalled rank(s) (printed on the console like every
    event). On NCCL the watchdog ends a timed-out worker before it can say so itself."""
    from raytrain.rules.stall import stall_seen_by_heartbeats
    from raytrain.rundir import RunDir
    from raytrain.rundir.heartbeats import read_last_attempt
    from raytrain.rundir.records import HEARTBEATS, Event, Kind
    from raytrain.rundir.storage import Store

    def report(error: BaseException) -> None:
        if "stalled rank" in str(error):  # the worker said it itself (gloo raises in the worker)
            return
        store = Store.of(run_dir)
        with contextlib.suppress(OSError, ValueError):  # a diagnosis must never fail the policy
            records = read_last_attempt(store.local_dir / HEARTBEATS)
            message = stall_seen_by_heartbeats(records, time.time(), collective_timeout_s)
            if message:
                RunDir(store).append_event(Event(Kind.STALL, message))

    return report
