"""What an attempt is — a fresh start, a restart or a resize — and the line it says.

Ray Train calls the per-worker function once per attempt: at the start, after every failure
and after every resize. Which of these it is follows from the restored checkpoint and the
worker counts alone (`Attempt.of`); rank 0 writes one event saying so, with the batch plan
and learning rate this attempt trains with.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain.config import TrainConfig
from raytrain.pipeline import Pipeline, overrides
from raytrain.rules import resume
from raytrain.rules.batch import BatchPlan
from raytrain.rules.budget import Budget
from raytrain.rules.position import Position
from raytrain.rules.schedule import LRSchedule
from raytrain.rundir.records import Event, Kind
from raytrain.text import sci


class Attempt(enum.Enum):
    """The kind of attempt; its value is the kind of the event that announces it."""

    FRESH = Kind.PLAN  # no checkpoint: training starts
    RESTART = Kind.RESTORE  # from a checkpoint, with the worker count it was taken with
    RESIZE = Kind.RESIZE  # from a checkpoint, with another worker count

    @classmethod
    def of(cls, resumed: bool, world_sizes: Sequence[int], world_size: int) -> "Attempt":
        """`resumed`: a checkpoint was restored; `world_sizes`: the worker counts it trained
        with, in order (empty: taken as this attempt's); `world_size`: this attempt's."""
        if not resumed:
            return cls.FRESH
        previous = world_sizes[-1] if world_sizes else world_size
        return cls.RESIZE if previous != world_size else cls.RESTART

    def event(
        self, position: Position, world_size: int, plan_text: str, lr_now: float, lr_before: float = math.nan
    ) -> Event:
        """The plan; or, on a restart or resize, the line saying where training continues and
        with what plan and rate (the rules' rate for this worker count and batch), against
        `lr_before`, the rate the checkpoint was taken at."""
        if self is Attempt.FRESH:
            return Event(Kind.PLAN, plan_text, extra={"world_size": world_size})
        lr_change = (
            "unchanged" if abs(lr_now - lr_before) <= 1e-9 * max(1e-12, abs(lr_before)) else f"(was {sci(lr_before)})"
        )
        where = f"step {position.step} (epoch {position.epoch + 1}, {position.epoch_offset:,} samples into it)"
        plan = f"{plan_text}; lr now {sci(lr_now)} {lr_change}"
        if self is Attempt.RESIZE:
            previous = position.world_sizes[-1]
            extra = {"world_size": world_size, "previous_world_size": previous, "step": position.step}
            return Event(Kind.RESIZE, f"Resized {previous} → {world_size} workers at {where}: {plan}", extra=extra)
        message = f"Restarted from the checkpoint at {where} with {world_size} workers: {plan}"
        return Event(Kind.RESTORE, message, extra={"world_size": world_size, "step": position.step})


def describe_plan(
    cfg: TrainConfig,
    pipeline: Pipeline,
    batch_plan: BatchPlan,
    schedule: LRSchedule,
    backend: str,
    optimizer_detail: str | None = None,
    model: str = "",
) -> str:
    """`global 64 = 2 workers × 32 per worker × 1 accumulation step; lr 2.0e-3 = 1.0e-3 × 2 (linear rule, ...);
    warmup 1 epoch, to step 16 of 64; cosine; adamw; gloo; 4 epochs`. `optimizer_detail`: what the pipeline's
    build_optimizer built; `model`: how the strategy holds the model, when there is more to say than DDP's default."""
    factor = schedule.peak_lr / cfg.lr
    rule = {"linear": "linear rule", "sqrt": "square-root rule", "none": "no scaling"}[cfg.lr_scaling]
    warmup, where = schedule.warmup_words
    if not warmup:  # a schedule built by hand, not by run_schedule
        warmup = f"warmup {schedule.warmup_samples:,} samples" if schedule.warmup_samples else "no warmup"
    if schedule.warmup_samples and cfg.warmup_start_factor is not None:
        warmup += f" from {sci(schedule.warmup_start_lr)}"
    if where:
        warmup += f" {where}" if where.startswith("(") else f", {where}"
    schedule_text = resume.hook_text("lr_factor") if overrides(pipeline, "lr_factor") else cfg.schedule
    if cfg.schedule == "step" and schedule_text == "step":
        schedule_text += f" ×{cfg.lr_gamma:g} at epochs {', '.join(f'{m:g}' for m in cfg.lr_milestones or [])}"
    own = overrides(pipeline, "build_optimizer")
    optimizer = resume.hook_text("build_optimizer", optimizer_detail) if own else cfg.optimizer
    return (
        f"{batch_plan.describe()}; lr {sci(schedule.peak_lr)} = {sci(cfg.lr)} × {factor:.3g} "
        f"({rule}, reference batch {cfg.reference_batch_size}); {warmup}; {schedule_text}; {optimizer}; {backend}; "
        + (f"{model}; " if model else "")
        + Budget.of(cfg).describe()
    )


@dataclass(frozen=True)
class Tally:
    """What happened to one invocation of a run, counted from its events (summary.json)."""

    failures_recovered: int = 0  # worker or node failures training went on after
    resumes: int = 0  # 1 when this invocation continued the run from a checkpoint (--resume)
    interruptions: int = 0  # 1 when it was stopped by SIGINT/SIGTERM
    checkpoints_skipped: int = 0  # unusable checkpoints passed over for an earlier one
    preemptions: int = 0  # restarts and lost replicas that came of a preemption notice, not of a failure


def tally(events: Sequence[Event], *, interrupted: bool = False, stop_requested_at: float | None = None) -> Tally:
    """The counts of one invocation from its events, in order. Its first attempt is its start
    (a fresh one, or a resume from a checkpoint); every later restart or shrink is a failure
    recovered — a start again from scratch too (no checkpoint yet), unless it has more workers —
    but one after a stop was asked (`stop_requested_at`, a time.time()) comes of the stop, not
    of a failure, and one after a preemption notice (a `preempted` event) is a preemption. A growth
    is never a failure."""
    failures, resumes, preemptions, size, noticed = 0, 0, 0, None, False
    skipped: set[str] = set()
    for event in events:
        after_stop = stop_requested_at is not None and (event.time or 0) >= stop_requested_at
        if event.kind == Kind.PREEMPTED:
            noticed = True
            continue
        if event.kind in (Kind.PLAN, Kind.RESTORE, Kind.RESIZE) and size is None:
            size, resumes = event.extra.get("world_size", 0), int(event.kind != Kind.PLAN)
            continue
        if event.kind == Kind.SKIPPED:
            skipped.update(event.extra.get("checkpoints") or [event.message])
            continue
        again = event.kind == Kind.PLAN and event.extra.get("world_size", 0) <= (size or 0)
        if not after_stop and (event.recovers_a_failure or again):
            preemptions, failures, noticed = preemptions + noticed, failures + (not noticed), False
        size = event.extra.get("world_size", size)
    return Tally(failures, resumes, int(interrupted), len(skipped), preemptions)
