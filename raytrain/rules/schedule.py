"""The learning rate at every sample count: the scaling rule's peak, warmup, then the schedule.

Counted in samples seen, never in steps or workers, so a resize never restarts warmup or
moves the schedule. Pure: nothing here touches Ray or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raytrain.rules.batch import BatchPlan, lr_scale
from raytrain.rules.budget import Budget, planned_global_batch, samples_after_steps, steps_per_epoch

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig

ONECYCLE_FINAL_FACTOR = 1e-4  # one-cycle ends at this fraction of the peak rate
ONECYCLE_DEFAULT_RISE = 0.3  # without a warmup, one-cycle rises over this share of the run
# A warmup in epochs that --max-steps cuts short becomes this share of the run's steps (HF's
# `warmup_ratio` 0.1 in its examples), so that the rate reaches its peak and then decays.
SHORT_RUN_WARMUP_SHARE = 0.1


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
    warmup_words: tuple[str, str] = field(default=("", ""), compare=False)
    """The plan line's words for the warmup (`Warmup.length`, `Warmup.where`)."""

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


@dataclass(frozen=True)
class Warmup:
    """The run's warmup in samples, and the plan line's words for it: `length` (`warmup 1 epoch`)
    and `where` (where it ends in the run)."""

    samples: int
    length: str
    where: str = ""


def run_warmup(cfg: "TrainConfig", num_train_rows: int) -> Warmup:
    """The warmup of a run of `num_train_rows` training rows, counted at the planned global batch.

    --warmup-steps is taken as given (longer than --max-steps is refused by the config). A warmup
    in epochs (the default is 1) that would not end before --max-steps does is counted in steps
    instead: a tenth of the run's steps (none under 10), so that a short run still reaches its
    peak rate and decays; the words say so. Either way they say where warmup ends."""
    planned = planned_global_batch(cfg)
    budget = Budget.of(cfg)
    run_steps = budget.total_steps(num_train_rows, planned)
    if cfg.warmup_steps is not None:
        samples = samples_after_steps(cfg.warmup_steps, num_train_rows, planned)
        length = f"{cfg.warmup_steps:,} step{'s' if cfg.warmup_steps != 1 else ''}"
    else:
        samples = round(cfg.warmup_epochs * num_train_rows)
        length = f"{cfg.warmup_epochs:g} epoch{'s' if cfg.warmup_epochs != 1 else ''}"
        if cfg.max_steps is not None and samples > 0 and samples >= budget.samples(num_train_rows, planned):
            steps = int(run_steps * SHORT_RUN_WARMUP_SHARE)
            why = f"{length} is {steps_to_samples(samples, num_train_rows, planned):,} steps, not shorter than the run"
            if not steps:
                return Warmup(0, "no warmup", f"({why}, and a tenth of its {run_steps} steps is none)")
            samples = samples_after_steps(steps, num_train_rows, planned)
            where = f"to step {steps:,} of {run_steps:,} (a tenth of the run: {why})"
            return Warmup(samples, f"warmup {steps:,} step{'s' if steps != 1 else ''}", where)
    if samples <= 0:
        return Warmup(0, "no warmup")
    ends = steps_to_samples(samples, num_train_rows, planned)
    where = f"to step {ends:,} of {run_steps:,}"
    if cfg.warmup_steps is None and 2 * ends > run_steps:
        # Legal, and sometimes meant; but most of such a run trains below its peak rate, which a
        # step-based run (--max-steps with an epoch-counted default warmup) gets without asking.
        # A warmup given in steps is what the user counted: said as given.
        where += (
            f" — more than half of the run warms up; for less, give --warmup-steps (e.g. {max(1, run_steps // 10):,}, "
            "a tenth) or a shorter --warmup-epochs"
        )
    return Warmup(samples, f"warmup {length}", where)


def steps_to_samples(samples: int, epoch_rows: int, global_batch_size: int) -> int:
    """The first step count whose samples (`samples_after_steps`) reach `samples`."""
    epochs, rest = divmod(samples, epoch_rows)
    return epochs * steps_per_epoch(epoch_rows, global_batch_size) + -(-rest // global_batch_size)


def run_schedule(cfg: "TrainConfig", batch_plan: BatchPlan, num_train_rows: int) -> LRSchedule:
    """The run's schedule for `batch_plan`: the scaling rule's peak, warmup and the schedule,
    with epochs and steps (warmup, milestones, the run's length: `raytrain.rules.budget`) turned
    into samples. Only the peak depends on the batch plan: the lengths are counted at the
    planned global batch, so a resize changes none of them."""
    peak = cfg.lr * lr_scale(cfg.lr_scaling, batch_plan.global_batch_size, cfg.reference_batch_size)
    start = cfg.lr if cfg.warmup_start_factor is None else peak * cfg.warmup_start_factor
    milestones = tuple(round(m * num_train_rows) for m in (cfg.lr_milestones or ()))
    planned = planned_global_batch(cfg)
    warmup = run_warmup(cfg, num_train_rows)
    return LRSchedule(
        cfg.schedule,
        peak,
        start,
        warmup.samples,
        Budget.of(cfg).samples(num_train_rows, planned),
        milestones,
        cfg.lr_gamma,
        (warmup.length, warmup.where),
    )
