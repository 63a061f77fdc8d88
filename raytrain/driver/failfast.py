"""Ray Train's failure policy, but deterministic errors are not retried.

Ray Train retries every worker error up to `FailureConfig(max_failures)`. A `UserError`
(bad data, configuration, pipeline code, storage; `raytrain.errors`) would fail the same
way on every attempt, and a `DeterministicFault` has (a replica mismatch met again at the same
step), so the policy ends the run at the first one, whatever --max-failures (-1 included).
Worker deaths, lost nodes and collective timeouts keep Ray's policy and --max-failures.

What else the controller does is the fault-tolerance mode's (`raytrain.faults`): its policies,
its callbacks, its class, and its decision on a failure before Ray's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ray.train.torch import TorchTrainer

from raytrain.driver import interrupts
from raytrain.errors import NOT_RETRIED, find_error
from raytrain.faults.evict import KeepEvictedOut, Suspects, forget_run
from raytrain.faults.ray_internals import NODE_ID_LABEL, DatasetsCallback, FailureDecision, TrainController


class FailFastPolicy:
    """A failure policy of Ray Train's controller, which asks it only `make_decision`."""

    def __init__(self, inner: Any, mode: Any, on_worker_failure: Callable[[BaseException], None] | None = None):
        self.inner = inner  # Ray's policy, built from FailureConfig
        self.failure_config = inner.failure_config
        self.mode = mode  # the fault-tolerance mode (`raytrain.faults`): its decision comes before Ray's
        # Told of every failure that is not the user's (a worker died, a node was lost): where
        # raytrain says what the dead worker could not (`stall_reporter`).
        self.on_worker_failure = on_worker_failure

    def make_decision(self, training_failed_error) -> FailureDecision:
        if find_error(training_failed_error, NOT_RETRIED) is not None:
            return FailureDecision.RAISE
        if self.on_worker_failure is not None:
            self.on_worker_failure(training_failed_error)
        decision = self.mode.failure_decision(training_failed_error, self.failure_config)
        return decision if decision is not None else self.inner.make_decision(training_failed_error)


class _WithoutDatasetManager(DatasetsCallback):
    def before_init_train_context(self, workers) -> dict:
        return {}  # no dataset shard provider: no DatasetManager actor


class FailFastTrainer(TorchTrainer):
    """A TorchTrainer whose controller uses FailFastPolicy around Ray's own policy and the
    fault-tolerance mode's policies, callbacks and class (`raytrain.faults`), and whose signals
    raytrain handles (`raytrain.driver.interrupts`) instead of Ray's SIGINT handler."""

    def __init__(self, *args, mode: Any, run_dir: Any = None, evict_key: bytes | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode  # the run's fault-tolerance mode
        self.on_worker_failure = mode.on_worker_failure(run_dir)
        self.evict_key = evict_key  # the run's nodes held out: evicted stragglers, preempted (raytrain.faults.evict)

    def _initialize_and_run_controller(self, **kwargs):
        if not self.datasets:
            # Ray's callbacks, but with no dataset manager (raytrain's workers read their own
            # shards: `raytrain.data.sources`): Ray Train starts one more actor process per run for
            # it, about 4 CPU seconds of imports for nothing. What else the callback does, handing
            # the driver's Ray Data context to the workers, it still does.
            kwargs["callbacks"] = [
                _WithoutDatasetManager(self.train_run_context, {}) if type(callback) is DatasetsCallback else callback
                for callback in kwargs["callbacks"]
            ]
        if self.scaling_config.elasticity_enabled:
            from raytrain.driver.resources import FreshResources

            kwargs["callbacks"] = [*kwargs["callbacks"], FreshResources()]
        kwargs["failure_policy"] = FailFastPolicy(kwargs["failure_policy"], self.mode, self.on_worker_failure)
        if self.evict_key is not None:  # the run's nodes held out stay out; silent ones are suspected
            kwargs["callbacks"] = [*kwargs["callbacks"], KeepEvictedOut(self.evict_key)]
            if self.mode.silent_worker_s is not None:
                kwargs["callbacks"].append(Suspects(self.evict_key))
        controller = self.mode.controller(self.scaling_config, kwargs, self.evict_key)
        result = self._run_controller(controller or TrainController, kwargs)
        # The nodes this run held out are its own. Only after a run that ended, not one whose
        # head died: Ray's client would wait for the head rather than fail the call.
        if self.evict_key is not None:
            forget_run(self.evict_key)
        return result

    def _run_controller(self, controller_cls, kwargs):
        """`DataParallelTrainer._initialize_and_run_controller` of Ray 2.60, with raytrain's
        controller class (Ray's takes none) and raytrain's signal handling in place of Ray's."""
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
        controller = ray.remote(num_cpus=0, label_selector={NODE_ID_LABEL: here}, runtime_env={"env_vars": env_vars})(
            controller_cls
        ).remote(**kwargs)
        if threading.current_thread() is threading.main_thread():  # Tune runs trials in threads
            interrupts.set_controller(controller)  # to abort it
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())
