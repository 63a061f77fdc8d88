"""The learning rate at every sample count: the scaling rule's peak, warmup, then the schedule.

Counted in samples seen, never in steps or workers, so a resize never restarts warmup or
moves the schedule. Pure: nothing here touches Ray or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain.rules.batch import BatchPlan, lr_scale
from raytrain.rules.budget import Budget, planned_global_batch, samples_after_steps

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig

ONECYCLE_FINAL_FACTOR = 1e-4  # one-cycle ends at this fraction of the peak rate
ONECYCLE_DEFAULT_RISE = 0.3  # without a warmup, one-cycle rises over this share of the run


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a function of samples seen (never of steps or workers).

    Warmup rises linearly from `warmup_start_lr` (Goyal et al. 2017: the unscaled rate) to
    `peak_lr` over `warmup_samples`; then, with p the progress from the end of warmup (0) to
    the end of training (1):

    - cosine: peak · ½(1 + cos πp), to 0;
    - constant: peak;
    - linear: peak · (1 − p), to 0;
    - step: peak · gamma^k, k = milestones passed (in samples; given in epochs);
    - onecycle: a cosine rise from the warmup start to the peak over the warmup (or the first
      30 % of training without one), then a cosine fall to peak · 1e-4;
    - `factor(p)`, a pipeline's own `lr_factor`, replaces the kind: peak · factor(p).
    """

    kind: str
    peak_lr: float
    warmup_start_lr: float
    warmup_samples: int
    total_samples: int
    milestones_samples: tuple[int, ...] = ()
    gamma: float = 0.1

    def lr(self, samples_seen: int, factor=None) -> float:
        warmup = self.warmup_samples
        if self.kind == "onecycle" and warmup <= 0:
            warmup = round(ONECYCLE_DEFAULT_RISE * self.total_samples)
        if warmup > 0 and samples_seen < warmup:
            rise = samples_seen / warmup
            if self.kind == "onecycle":
                rise = 0.5 * (1.0 - math.cos(math.pi * rise))
            return self.warmup_start_lr + (self.peak_lr - self.warmup_start_lr) * rise
        progress = min(1.0, max(0.0, (samples_seen - warmup) / max(1, self.total_samples - warmup)))
        if factor is not None:
            return self.peak_lr * float(factor(progress))
        if self.kind == "constant":
            return self.peak_lr
        if self.kind == "linear":
            return self.peak_lr * (1.0 - progress)
        if self.kind == "step":
            return self.peak_lr * self.gamma ** sum(samples_seen >= m for m in self.milestones_samples)
        if self.kind == "onecycle":
            low = self.peak_lr * ONECYCLE_FINAL_FACTOR
            return low + (self.peak_lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.kind == "cosine":
            return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown schedule {self.kind!r}")


def lr_at(
    samples_seen: int,
    *,
    base_lr: float,
    peak_lr: float,
    warmup_samples: int,
    total_samples: int,
    schedule: str = "cosine",
) -> float:
    """Learning rate after `samples_seen` training samples, warmup from `base_lr` (see LRSchedule)."""
    return LRSchedule(schedule, peak_lr, base_lr, warmup_samples, total_samples).lr(samples_seen)


def run_schedule(cfg: "TrainConfig", batch_plan: BatchPlan, num_train_rows: int) -> LRSchedule:
    """The run's schedule for `batch_plan`: the scaling rule's peak, warmup and the schedule,
    with epochs and steps (warmup, milestones, the run's length: `raytrain.rules.budget`) turned
    into samples. Only the peak depends on the batch plan: the lengths are counted at the
    planned global batch, so a resize changes none of them."""
    peak = cfg.lr * lr_scale(cfg.lr_scaling, batch_plan.global_batch_size, cfg.reference_batch_size)
    start = cfg.lr if cfg.warmup_start_factor is None else peak * cfg.warmup_start_factor
    milestones = tuple(round(m * num_train_rows) for m in (cfg.lr_milestones or ()))
    planned = planned_global_batch(cfg)
    if cfg.warmup_steps is not None:
        warmup = samples_after_steps(cfg.warmup_steps, num_train_rows, planned)
    else:
        warmup = round(cfg.warmup_epochs * num_train_rows)
    return LRSchedule(
        cfg.schedule,
        peak,
        start,
        warmup,
        Budget.of(cfg).samples(num_train_rows, planned),
        milestones,
        cfg.lr_gamma,
    )
