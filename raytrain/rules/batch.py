"""Pure decisions: the batch plan, the learning rate, the order of every epoch.

Nothing here touches Ray or torch.distributed, so every rule is unit-tested on its
own. The per-worker loop calls these at each (re)start, which is what keeps the
optimization right when the worker count changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are spread over workers and micro-batches."""

    global_batch_size: int
    world_size: int
    accumulation_steps: int

    def rank_share(self, rank: int, rows_in_step: int | None = None) -> int:
        """Samples rank `rank` trains on in a step holding `rows_in_step` samples (default: full)."""
        start, end = split_range(self.global_batch_size if rows_in_step is None else rows_in_step, self.world_size)[rank]
        return end - start

    @property
    def per_worker_min(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def per_worker_max(self) -> int:
        return -(-self.global_batch_size // self.world_size)

    def describe(self) -> str:
        """`global 64 = 2 workers × 32 per worker × 1 accumulation step`."""
        low, high = self.per_worker_min, self.per_worker_max
        per_worker = f"{high}" if low == high else f"{low}–{high}"
        steps = "step" if self.accumulation_steps == 1 else "steps"
        workers = "worker" if self.world_size == 1 else "workers"
        return (
            f"global {self.global_batch_size} = {self.world_size} {workers} × {per_worker} per worker"
            f" × {self.accumulation_steps} accumulation {steps}"
        )


def resolve_batch_plan(
    world_size: int,
    *,
    global_batch_size: int | None = None,
    batch_size_per_worker: int | None = None,
    micro_batch_size: int | None = None,
) -> BatchPlan:
    """The plan for `world_size` workers. Exactly one of the two batch knobs is set.

    With `global_batch_size` the optimizer's batch is fixed and the per-worker share
    follows the worker count; with `batch_size_per_worker` the global batch grows
    with the workers. `micro_batch_size` caps one forward pass; a larger share is
    split into that many accumulation steps.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if (global_batch_size is None) == (batch_size_per_worker is None):
        raise ValueError("set exactly one of global_batch_size and batch_size_per_worker")
    total = global_batch_size if global_batch_size is not None else batch_size_per_worker * world_size
    share = -(-total // world_size)
    accumulation = 1 if not micro_batch_size else max(1, -(-share // micro_batch_size))
    return BatchPlan(global_batch_size=total, world_size=world_size, accumulation_steps=accumulation)


def default_reference_batch_size(
    max_workers: int, *, global_batch_size: int | None = None, batch_size_per_worker: int | None = None
) -> int:
    """The batch `lr` was tuned for when the user does not say: the per-worker batch.

    With a fixed global batch the per-worker batch depends on the worker count, so it
    is taken once, at the largest worker count, and frozen in the run's config: a
    resize then never changes the learning rate.
    """
    if batch_size_per_worker is not None:
        return batch_size_per_worker
    return max(1, -(-global_batch_size // max(1, max_workers)))


def lr_scale(rule: str, global_batch_size: int, reference_batch_size: int) -> float:
    """f(global / reference): linear, square root, or 1."""
    ratio = global_batch_size / reference_batch_size
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown lr scaling rule {rule!r}")


SCHEDULES = ("cosine", "constant", "linear", "step", "onecycle")
ONECYCLE_FINAL_FACTOR = 1e-4  # one-cycle ends at this fraction of the peak rate
ONECYCLE_DEFAULT_RISE = 0.3  # without a warmup, one-cycle rises over this share of the run


@dataclass(frozen=True)
class Schedule:
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
    """Learning rate after `samples_seen` training samples, warmup from `base_lr` (see Schedule)."""
    return Schedule(schedule, peak_lr, base_lr, warmup_samples, total_samples).lr(samples_seen)


# -- data order ------------------------------------------------------------------------


def split_range(count: int, parts: int) -> list[tuple[int, int]]:
    """Split `count` items into `parts` contiguous ranges whose sizes differ by at most 1."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The global order of rows in `epoch`: a permutation that depends on (seed, epoch) only.

    It does not depend on the worker count, which is what lets an interrupted epoch
    continue at another size from a stored offset.
    """
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_rows)


@dataclass(frozen=True)
class Step:
    """One optimizer step of an epoch: rows [start, end) of the epoch's order."""

    index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def epoch_steps(num_rows: int, global_batch_size: int, start_offset: int = 0) -> list[Step]:
    """The optimizer steps that train rows [start_offset, num_rows) of an epoch's order.

    Every row exactly once; the last step may be partial and is never dropped. The
    step count is the same on every rank because every rank computes it from the
    same numbers.
    """
    steps, offset = [], start_offset
    while offset < num_rows:
        steps.append(next_step(num_rows, global_batch_size, offset, index=len(steps)))
        offset = steps[-1].end
    return steps


def next_step(num_rows: int, global_batch_size: int, offset: int, index: int = 0) -> Step:
    """The step that trains the rows from `offset` on: the same rows as `epoch_steps` gives
    when the global batch stays the same. Per-step fault tolerance takes steps one at a time,
    as the global batch may change with the quorum (and an uncommitted step is taken again
    from the same offset)."""
    return Step(index=index, start=offset, end=min(num_rows, offset + global_batch_size))


def gradient_weight(count: int, world_size: int, step_size: int) -> float:
    """The factor on a rank's mean loss over its `count` rows of a step that makes DDP's mean
    over the `world_size` ranks (or a quorum's participants) the mean over the step's rows."""
    return count * world_size / step_size


def rank_rows(step: Step, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's slice [start, end) of a step's rows, in epoch-order offsets."""
    start, end = split_range(step.size, world_size)[rank]
    return step.start + start, step.start + end


def micro_batches(start: int, end: int, accumulation_steps: int) -> list[tuple[int, int]]:
    """Split a rank's rows into `accumulation_steps` micro-batches (some may be empty)."""
    return [(start + a, start + b) for a, b in split_range(end - start, accumulation_steps)]
