"""Ray Train's failure policy, but deterministic errors are not retried.

Ray Train retries every worker error up to `FailureConfig(max_failures)`. A `UserError`
(bad data, configuration, pipeline code, storage; `raytrain.errors`) would fail the same
way on every attempt, so the policy ends the run at the first one. Worker deaths, lost
nodes and collective timeouts keep Ray's policy and --max-failures.

Under per-step fault tolerance the controller also replaces lost replicas itself, and a
replica that dies while another is being replaced fails that replacement with a controller
error Ray never retries: this policy retries it, within --max-failures, and the trainer adds
the controller callback that makes the retry succeed (`raytrain.driver.replacement`).
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy

from raytrain.driver import interrupts, replacement
from raytrain.driver.replacement import ReplicaGroups, lost_while_replacing
from raytrain.errors import find_user_error


class FailFastPolicy(FailurePolicy):
    def __init__(self, inner: FailurePolicy, replica_groups: bool = False):
        super().__init__(inner.failure_config)
        self.inner = inner
        self.replica_groups = replica_groups
        self.replacements_retried = 0

    def make_decision(self, training_failed_error) -> FailureDecision:
        if find_user_error(training_failed_error) is not None:
            return FailureDecision.RAISE
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


class FailFastTrainer(TorchTrainer):
    """A TorchTrainer whose controller uses FailFastPolicy around Ray's own policy (and, with
    replica groups, `ReplicaGroups`), and whose signals raytrain handles
    (`raytrain.driver.interrupts`) instead of Ray's SIGINT handler."""

    def __init__(self, *args, replica_group_size: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replica_group_size = replica_group_size  # workers per replica group (per-step)

    def _initialize_and_run_controller(self, **kwargs):
        replica_groups = bool(getattr(self.backend_config.backend_cls, "has_replica_groups", False))
        kwargs["failure_policy"] = FailFastPolicy(kwargs["failure_policy"], replica_groups=replica_groups)
        if replica_groups:
            kwargs["callbacks"] = [*kwargs["callbacks"], ReplicaGroups(self.replica_group_size)]
        return super()._initialize_and_run_controller(**kwargs)

    def _register_sigint_handler(self, controller) -> None:
        interrupts.set_controller(controller)
