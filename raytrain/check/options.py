"""What `raytrain check` takes besides the training options, and the training options it
decides itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain.errors import ConfigError

DEFAULT_STEPS = 20
# Train options the check does not take: it writes no run (no name, storage, checkpoints,
# trackers or progress), compares the restart mode's DDP, and runs each side once.
CHECK_SKIPPED = tuple(
    "resume name storage max_failures fault_tolerance checkpoint_every_steps num_checkpoints_to_keep checkpoint_async "
    "log_every_steps progress progress_interval_s mlflow_uri mlflow_experiment wandb_project time_phases "
    "timing_warmup_steps peak_tflops".split()
)


@dataclass(kw_only=True)
class CheckOptions:
    """What `raytrain check` compares, besides the training options."""

    steps: int = DEFAULT_STEPS
    """Optimizer steps taken and compared at 1 worker and at N (default 20)."""
    tolerance: float | None = None
    """Relative difference allowed per step, for the loss and the gradient norm alike; default 1e-5 at fp32 and 0.1
    under bf16 or fp16 (docs/porting.md says how they were measured)."""

    def __post_init__(self) -> None:
        problems = []
        if self.steps < 1:
            problems.append(("steps", f"got {self.steps}; must be a positive number of steps, e.g. --steps 20"))
        if self.tolerance is not None and not 0 < self.tolerance < math.inf:
            problems.append(("tolerance", f"got {self.tolerance}; must be a positive fraction, e.g. --tolerance 1e-5"))
        if problems:
            raise ConfigError(problems)
