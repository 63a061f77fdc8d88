"""Ray Train's failure policy, but deterministic errors are not retried.

Ray Train retries every worker error up to `FailureConfig(max_failures)`. A `UserError`
(bad data, configuration, pipeline code, storage; `raytrain.errors`) would fail the same
way on every attempt, so the policy ends the run at the first one. Worker deaths, lost
nodes and collective timeouts keep Ray's policy and --max-failures.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy

from raytrain.driver import interrupts
from raytrain.errors import find_user_error


class FailFastPolicy(FailurePolicy):
    def __init__(self, inner: FailurePolicy):
        super().__init__(inner.failure_config)
        self.inner = inner

    def make_decision(self, training_failed_error) -> FailureDecision:
        if find_user_error(training_failed_error) is not None:
            return FailureDecision.RAISE
        return self.inner.make_decision(training_failed_error)


class FailFastTrainer(TorchTrainer):
    """A TorchTrainer whose controller uses FailFastPolicy around Ray's own policy, and whose
    signals raytrain handles (`raytrain.driver.interrupts`) instead of Ray's SIGINT handler."""

    def _initialize_and_run_controller(self, **kwargs):
        kwargs["failure_policy"] = FailFastPolicy(kwargs["failure_policy"])
        return super()._initialize_and_run_controller(**kwargs)

    def _register_sigint_handler(self, controller) -> None:
        interrupts.set_controller(controller)
