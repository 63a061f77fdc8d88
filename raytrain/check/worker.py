"""The check's per-worker function: the 1-worker reference and the N-worker run, step by step.

Ray Train runs `check_loop_per_worker` on N workers. Rank 0 first takes the reference steps
by itself (rank 0 of 1 on its own device, no DDP: one worker's run, the same math as
`raytrain train --workers 1`), then once more with each step's rows rotated by half (the
pipeline's horizon: `raytrain.check.verdict`), while the others wait; then all N take the
same steps from the same initial weights over the same rows. Every side is built from the
trainer's own pieces (`StepRunner`, `open_source`, `rules.steps`) and records every step's
global loss and gradient norm before its update; under ddp the N-worker run also records every
rank's fingerprint after each update (`replica_fingerprints`).

When the runs differ, a model with per-rank BatchNorm is run again for a few steps with
--sync-batchnorm on all N workers, to see whether the gap closes, and the in-process probes
(`raytrain.check.probes`) run on rank 0. Rank 0's `Outcome` reaches the driver as Ray Train's
`return_value`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raytrain.check import probes
from raytrain.check.verdict import Cause, Replicas, StepRecord, compare, horizon_of
from raytrain.config import TrainConfig
from raytrain.data.sources import Source, open_source
from raytrain.data.stream import Stream, StreamEpoch
from raytrain.data.table import Table, TableEpoch
from raytrain.instruments.agreement import shared_fingerprints
from raytrain.parallel.strategy import local_part
from raytrain.pipeline import Pipeline, overrides
from raytrain.rules import agreement, steps
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.position import Position
from raytrain.rundir.heartbeats import Heartbeat
from raytrain.worker.epoch import advance
from raytrain.worker.runtime import Runtime
from raytrain.worker.state import unwrap
from raytrain.worker.step import Batch, StepRunner

PAYLOAD = "raytrain_check"
# Steps of the rerun that sees whether --sync-batchnorm closes a BatchNorm gap.
RERUN_STEPS = 5


@dataclass(frozen=True)
class CheckPayload:
    """What the driver hands every worker."""

    config: TrainConfig  # the N-worker run's (global batch fixed)
    reference: TrainConfig  # the 1-worker reference's
    pipeline: Pipeline
    sources: dict[str, Source]
    steps: int
    tolerance: float


@dataclass
class Outcome:
    """Rank 0's records: both runs, the reruns, what the probes found, and what was neutralized."""

    reference: list[StepRecord]
    reordered: list[StepRecord]  # the reference again, each step's rows rotated by half (the horizon)
    run: list[StepRecord]
    reruns: dict[str, list[StepRecord]] = field(default_factory=dict)  # "sync_batchnorm": its steps
    causes: list[Cause] = field(default_factory=list)
    dropout_layers: int = 0
    augmented_row_by_row: bool = False  # the pipeline's transform_batch, applied one row at a time (RowByRow)
    replicas: Replicas | None = None  # the N-worker run's fingerprints, every rank's after every step


def check_loop_per_worker(loop_config: dict[str, Any]) -> Outcome | None:
    payload: CheckPayload = loop_config[PAYLOAD]
    runtime = Runtime()
    pristine = copy.deepcopy(payload.pipeline)  # before any call: what a fresh worker holds
    reference = reordered = None
    if runtime.is_rank0:
        alone = runtime.alone()
        reference, _ = record_steps(payload.reference, copy.deepcopy(pristine), alone, payload)
        reordered, _ = record_steps(payload.reference, copy.deepcopy(pristine), alone, payload, reorder=True)
    runtime.all_gather_object(None)  # the others wait here while rank 0 takes the 1-worker steps
    # Who holds one copy of the model, as in training: every rank under ddp; all of them, a shard
    # each, under fsdp (nothing to compare, nothing fingerprinted).
    shards = agreement.shards_per_replica(payload.config.strategy, runtime.world_size)
    prints: list[tuple[int, ...]] | None = [] if shards == 1 else None
    run, model = record_steps(payload.config, copy.deepcopy(pristine), runtime, payload, fingerprints=prints)
    layers = probes.batchnorm_layers(unwrap(model))
    differs = reference is not None and not agrees(reference, reordered, run, payload.tolerance, runtime.world_size)
    outcome = Outcome(
        reference or [],
        reordered or [],
        run,
        dropout_layers=probes.dropout_to_eval(model),
        augmented_row_by_row=overrides(pristine, "transform_batch"),
        replicas=Replicas(runtime.world_size, shards, tuple(prints or ())),
    )
    # Every rank must agree to rerun; rank 0 alone holds the reference.
    rerun = runtime.all_reduce_sum([float(differs and bool(layers))])[0] > 0
    if rerun:
        synced = dataclasses.replace(payload.config, sync_batchnorm=True)
        outcome.reruns["sync_batchnorm"], _ = record_steps(
            synced, copy.deepcopy(pristine), runtime, payload, min(payload.steps, RERUN_STEPS)
        )
    if differs:
        outcome.causes = probe(pristine, payload, runtime.alone())
    return outcome if runtime.is_rank0 else None


def agrees(reference, reordered, run, tolerance: float, workers: int) -> bool:
    """Whether the N-worker run agrees with the reference up to the pipeline's horizon."""
    return compare(reference, run, tolerance, workers, horizon_of(reference, reordered, tolerance)).equivalent


def record_steps(
    cfg: TrainConfig,
    pipeline: Pipeline,
    runtime: Runtime,
    payload: CheckPayload,
    count: int | None = None,
    reorder: bool = False,
    fingerprints: list[tuple[int, ...]] | None = None,
) -> tuple[list[StepRecord], torch.nn.Module]:
    """`count` optimizer steps (default: the check's) from the seeded initial weights, each
    recorded before its update (`reorder`: each step's rows rotated by half); returns them
    and the model. Given `fingerprints`, every rank's after each update is appended to it."""
    runner, train = build_runner(cfg, pipeline, runtime, payload)
    position, records = Position(), []
    count = payload.steps if count is None else count
    while len(records) < count:
        data = runner.epoch_data(train, position)
        data = Rotated(data) if reorder else data
        for step in steps.epoch_steps(len(train), runner.batch_plan.global_batch_size, position.epoch_offset):
            runner.update_context(position)
            phase = runner.measures.phases(position.step, timed=False)
            runner.gradients(data, step, phase)
            records.append(StepRecord(global_loss(runner), grad_norm(runner)))
            runner.apply_gradients(position, phase)
            if fingerprints is not None:
                fingerprints.append(replica_fingerprints(runner))
            advance(position, step)
            if len(records) == count:
                break
        if position.epoch_offset >= len(train):
            position.epoch, position.epoch_offset = position.epoch + 1, 0
    return records, runner.model


def build_runner(
    cfg: TrainConfig, pipeline: Pipeline, runtime: Runtime, payload: CheckPayload
) -> tuple[StepRunner, Table | Stream]:
    """The trainer's own step runner for `cfg` on `runtime` (seeded initial weights, dropout
    layers in evaluation mode), and the training set."""
    train = open_source("train", payload.sources["train"], runtime.get_object, cfg.skip_nan_rows)
    heartbeat = Heartbeat(Path("."), runtime.world_rank, enabled=False)  # no run directory: nothing to write
    plan = batch_plan_for(cfg, runtime.world_size)
    runner = CheckRunner.build(pipeline, cfg, runtime, heartbeat, plan, len(train))
    runner.model.train()
    probes.dropout_to_eval(runner.model)
    return runner, train


def global_loss(runner: StepRunner) -> float:
    """The step's loss over every rank's rows, sample-weighted (one collective); the window
    is cleared for the next step."""
    window = runner.window
    total, count = runner.runtime.all_reduce_sum([float(window.loss_sum.item()), float(window.loss_count)])
    window.clear()
    return total / count if count else math.nan


def grad_norm(runner: StepRunner) -> float:
    """The global gradient norm, unscaled under a gradient scaler. Under DDP every rank holds
    the averaged gradients; under --strategy fsdp each holds its shards' (DTensors), whose
    squared norms are summed over the ranks (one collective)."""
    local = [local_part(p.grad) for p in unwrap(runner.model).parameters() if p.grad is not None]
    squares = sum(float(g.detach().double().square().sum()) for g in local)
    if not runner.prepared.strategy.holds_whole_model:
        squares = runner.runtime.all_reduce_sum([squares])[0]
    scale = runner.scaler.get_scale() if runner.scaler.is_enabled() else 1.0
    return math.sqrt(squares) / scale


def replica_fingerprints(runner: StepRunner) -> tuple[int, ...]:
    """Every rank's fingerprint of what it holds (weights and optimizer state), shared as training
    compares its replicas (`raytrain.instruments.agreement.shared_fingerprints`)."""
    return tuple(shared_fingerprints(runner.runtime, unwrap(runner.model), runner.optimizer).fingerprints)


def probe(pipeline: Pipeline, payload: CheckPayload, alone: Runtime) -> list[Cause]:
    """The in-process probes on rank 0, on the rows of the first step at the initial weights."""
    cfg = dataclasses.replace(payload.reference, precision="fp32")
    runner, train = build_runner(cfg, copy.deepcopy(pipeline), alone, payload)
    data = runner.epoch_data(train, Position())
    first = steps.next_step(len(train), cfg.global_batch_size, 0)
    runner.update_context(Position())
    batch, _ = data.batch(data.rows(first), alone.device)
    subject = probes.Subject(pipeline, runner.model, batch, wrap=Batch)
    return probes.find_causes(subject, payload.config.max_workers, batchnorm_synced=payload.config.sync_batchnorm)


class CheckRunner(StepRunner):
    """The trainer's step runner, but transform_batch is applied by the data, row by row
    (`RowByRow`), not to each rank's share as a whole."""

    exact = True  # no TF32: its 10-bit mantissa would swamp reduction-order differences
    row_transform = StepRunner.transform  # transform_batch on one row, seeded by its place (`RowByRow`)

    def transform(self, batch: dict[str, torch.Tensor], key: list[int]) -> dict[str, torch.Tensor]:
        """The share as it is: the data has applied transform_batch to it row by row."""
        return batch

    def epoch_data(self, train: Table | Stream, position: Position) -> "TableEpoch | StreamEpoch | RowByRow":
        """This rank's rows of the epoch at `position`; augmented row by row when the pipeline augments."""
        rank, world = self.runtime.world_rank, self.runtime.world_size
        data = train.epoch(self.cfg.seed, position.epoch, position.epoch_offset, rank, world)
        return RowByRow(data, self, position.epoch) if overrides(self.pipeline, "transform_batch") else data


@dataclass
class RowByRow:
    """An epoch's data whose batches come through transform_batch one row at a time, each
    row's random draws seeded from (seed, epoch, its place in the epoch): the same row gets
    the same augmentation however the step's rows are split over ranks. (In training,
    transform_batch takes a rank's whole share, seeded per rank: a legitimate difference with
    the worker count, as dropout's masks are. A transform that mixes rows, such as mixup, is
    checked row by row.)"""

    data: TableEpoch | StreamEpoch
    runner: CheckRunner
    epoch: int

    def rows(self, step: steps.Step) -> list[tuple]:
        return self.data.rows(step)

    def batch(self, rows: list[tuple], device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        batch, count = self.data.batch(rows, device)
        if not count:
            return batch, count
        # A place is the row's position in the epoch's order (in memory) or in its lane (streamed):
        # neither depends on the worker count.
        places = [(*piece[:-2], place) for piece in rows for place in range(piece[-2], piece[-1])][:count]
        seed = self.runner.cfg.seed
        one_by_one = [
            self.runner.row_transform(
                {name: value[i : i + 1] for name, value in batch.items()}, [seed, self.epoch, *place]
            )
            for i, place in enumerate(places)
        ]
        return {name: torch.cat([row[name] for row in one_by_one]) for name in one_by_one[0]}, count


@dataclass
class Rotated:
    """An epoch's data with each batch's rows rotated by half (the second half first): the
    same step, its sums taken in another order, as a split over ranks takes them (what makes
    the horizon: `raytrain.check.verdict.horizon_of`)."""

    data: Any

    def rows(self, step: steps.Step) -> list[tuple]:
        return self.data.rows(step)

    def batch(self, rows: list[tuple], device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        batch, count = self.data.batch(rows, device)
        return ({name: value.roll(count // 2, 0) for name, value in batch.items()} if count else batch), count
