"""The batch plan: how one optimizer step's samples spread over workers and micro-batches,
and how the peak learning rate follows the global batch (the scaling rules).

Pure: nothing here touches Ray or torch. The per-worker loop asks at each (re)start, which is
what keeps the optimization right when the worker count changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config.optimization import OptimizationSection


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are spread over workers and micro-batches."""

    global_batch_size: int
    world_size: int
    accumulation_steps: int

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


def batch_plan_for(cfg: "OptimizationSection", workers: int) -> BatchPlan:
    """The batch plan of a step taken by `workers` workers (or per-step replicas) under `cfg`
    (a `TrainConfig`, or its optimization section alone)."""
    return resolve_batch_plan(
        workers,
        global_batch_size=cfg.global_batch_size,
        batch_size_per_worker=cfg.batch_size_per_worker,
        micro_batch_size=cfg.micro_batch_size,
    )
