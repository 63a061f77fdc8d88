"""The rates of a run's optimizer: the config's choice (`raytrain.pipeline.default_optimizer`,
`Pipeline.build_optimizer`'s default) or the pipeline's own `build_optimizer`.

raytrain owns the learning rate whatever the optimizer: at every step each parameter group
gets the rate of the rules (scaling rule × warmup × schedule, keyed to samples seen) times the
group's own multiplier — its rate when the optimizer was built, divided by `--lr`. A group built
with `lr=cfg.lr * 0.1` trains at a tenth of the schedule's rate, through scaling, warmup and
resizes; a group built without its own `lr` follows the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from raytrain.rules.schedule import LRSchedule


@dataclass(frozen=True)
class Rate:
    """The learning rate of an attempt at its quorum's size: the schedule's (scaling rule ×
    warmup × schedule, keyed to samples seen), times the pipeline's lr_factor when it has one,
    times each group's multiplier."""

    schedule: LRSchedule
    multipliers: list[float]  # per parameter group: its rate at build / --lr
    factor: Callable | None = None  # the pipeline's lr_factor hook

    @classmethod
    def of(cls, pipeline: Any, schedule: LRSchedule, multipliers: list[float]) -> "Rate":
        """The rate of `schedule`, with `pipeline`'s lr_factor when it overrides it."""
        from raytrain import hooks
        from raytrain.pipeline import overrides

        return cls(
            schedule, multipliers, hooks.bound(pipeline, "lr_factor") if overrides(pipeline, "lr_factor") else None
        )

    @property
    def peak_lr(self) -> float:
        return self.schedule.peak_lr

    def at(self, samples_seen: int) -> float:
        return self.schedule.lr(samples_seen, self.factor)

    def set_on(self, optimizer: torch.optim.Optimizer, samples_seen: int) -> float:
        """Every group's rate at `samples_seen`; returns the run's."""
        lr = self.schedule.lr(samples_seen, self.factor)
        set_rates(optimizer, lr, self.multipliers)
        return lr


def rate_multipliers(optimizer: torch.optim.Optimizer, base_lr: float) -> list[float]:
    """Each group's rate when built, over --lr: what raytrain multiplies its own rate by."""
    return [float(group.get("lr", base_lr)) / base_lr for group in optimizer.param_groups]


def set_rates(optimizer: torch.optim.Optimizer, lr: float, multipliers: list[float]) -> None:
    for group, multiplier in zip(optimizer.param_groups, multipliers):
        group["lr"] = lr * multiplier


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`AdamW, 2 groups`: what a pipeline's build_optimizer built, for the plan line and config.yaml."""
    groups = len(optimizer.param_groups)
    return f"{type(optimizer).__name__}, {groups} group{'s' if groups != 1 else ''}"
