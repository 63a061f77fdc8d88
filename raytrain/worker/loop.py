"""The per-worker training function: restore → build → loop → report.

Ray Train calls `train_loop_per_worker` once per attempt: at the start, after every
failure and after every resize. Resume is the only way in: a fresh run is "no
checkpoint". The batch plan and the learning rate are re-derived from the rules in
`raytrain.rules.batch` at every attempt, for the world size this attempt has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from raytrain.rundir import checkpoints as ckpt
from raytrain.worker import optim
from raytrain.rules import batch as rules
from raytrain.rules.attempt import Attempt, describe_plan
from raytrain.config import TrainConfig
from raytrain.data.checks import DataError, Stream, StreamEpoch, Table, TableEpoch
from raytrain.errors import PipelineCodeError, UserFault, pipeline_code
from raytrain.worker.heartbeat import Heartbeat, diagnose, looks_like_timeout, read_heartbeats
from raytrain.worker.phases import PhaseTimer, StepPhases
from raytrain.pipeline import _CONTEXT, Pipeline, overrides
from raytrain.rules.position import Position
from raytrain.observe.render import sci
from raytrain.rundir.records import Kind, MetricsRow
from raytrain.rundir.writer import RunWriter
from raytrain.worker.replicas import STARTUP_WAIT_S, ReplicaRuntime
from raytrain.worker.runtime import Runtime


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    cfg = TrainConfig.from_dict(payload["config"])
    pipeline: Pipeline = payload["pipeline"]
    per_step = cfg.fault_tolerance == "per-step"
    run_dir = Path(payload["run_dir"])
    runtime = ReplicaRuntime(cfg.collective_timeout_s, cfg.num_checkpoints_to_keep, run_dir) if per_step else Runtime()
    files = RunWriter(run_dir, enabled=runtime.is_rank0)
    heartbeat = Heartbeat(run_dir / "heartbeats", runtime.world_rank, enabled=runtime.world_size > 1)
    if not per_step:  # a replacement replica must not clear what the live quorum is writing
        files.clear_staging()
    try:
        (run_replica if per_step else run_attempt)(cfg, pipeline, runtime, files, heartbeat, payload["sources"])
    except Exception as exc:
        if runtime.world_size > 1 and looks_like_timeout(exc):
            raise StallError(explain_stall(cfg, runtime, heartbeat, run_dir, exc)) from exc
        raise
    finally:
        heartbeat.stop()
        if per_step:
            runtime.shutdown()


class Begun(NamedTuple):
    """An attempt restored and built."""

    state: dict[str, Any] | None  # the checkpoint's (None: a fresh start)
    position: Position
    attempt: Attempt
    train_data: Table | Stream
    val_data: Table | Stream | None
    trainer: StepRunner


def begin(cfg: TrainConfig, pipeline: Pipeline, runtime: Runtime, files: RunWriter, heartbeat: Heartbeat, sources: dict[str, dict], workers: int) -> Begun:
    """Restore (the furthest checkpoint that loads), then build for `workers` workers."""
    state = restore(runtime, files)
    position = Position.restored(state)
    attempt = Attempt.of(state is not None, position.world_sizes, workers)
    heartbeat.mark(position.step, "data")
    train_data = open_source("train", sources["train"], runtime, cfg)
    val_data = open_source("val", sources["val"], runtime, cfg) if "val" in sources else None
    position.data = check_same_data(position, train_data)
    trainer = StepRunner.build(pipeline, cfg, runtime, heartbeat, files.run_dir, batch_plan_for(cfg, workers), len(train_data), state)
    return Begun(state, position, attempt, train_data, val_data, trainer)


def run_attempt(cfg: TrainConfig, pipeline: Pipeline, runtime: Runtime, files: RunWriter, heartbeat: Heartbeat, sources: dict[str, dict]) -> None:
    # restore, build
    state, position, attempt, train_data, val_data, trainer = begin(cfg, pipeline, runtime, files, heartbeat, sources, runtime.world_size)
    announce(files, attempt, trainer, position, state, train_data)
    position.world_sizes = _append_if_new(position.world_sizes, runtime.world_size)

    # loop, report
    run_epochs(trainer, len(train_data), val_data, position, files, lambda runner: (train_epoch(runner, train_data, position, files), runner))


def run_epochs(trainer: StepRunner, num_train_rows: int, val_data: Table | Stream | None, position: Position, files: RunWriter, train_one) -> None:
    """Epochs to the last (`train_one(runner)` trains the rest of one: its result and the
    runner to go on with), or to a stop request; then the final model, or the mark of a stop."""
    epochs = trainer.cfg.epochs
    while position.epoch < epochs:
        epoch, trainer = train_one(trainer)
        if epoch.finished_elsewhere:
            return
        if epoch.stopped and position.epoch_offset < num_train_rows:  # asked to stop mid-epoch: checkpointed at this step
            break
        end_epoch(trainer, val_data, position, files, epoch)
        if epoch.stopped:
            break
    if position.epoch < epochs:
        files.interrupted(position.progress("interrupted"))
    else:
        files.finish(trainer.model, position.progress("finished"))


def run_replica(cfg: TrainConfig, pipeline: Pipeline, runtime: ReplicaRuntime, files: RunWriter, heartbeat: Heartbeat, sources: dict[str, dict]) -> None:
    """One replica of a per-step run (raytrain.worker.replicas): restore, build, then steps over the
    quorum of live replicas; a replacement heals from a live peer at its first step."""
    # restore, build, join
    if run_finished(files, cfg.epochs):
        return  # a replacement that came up after the others finished the run: nothing to join
    state, position, attempt, train_data, val_data, trainer = begin(cfg, pipeline, runtime, files, heartbeat, sources, runtime.replica_count)
    model = runtime.join(trainer.model, lambda: trainer.live_state(position), lambda live: trainer.load_live_state(live, position))
    trainer = dataclasses.replace(trainer, model=model)
    if state is None:  # a fresh start: every replica heartbeats to the lighthouse before the first quorum
        time.sleep(STARTUP_WAIT_S)

    # loop, report: the attempt is announced at its first quorum (a replacement's is the quorum's line)
    pending = [lambda: announce(files, attempt, trainer, position, state, train_data)]

    def one_epoch(runner: StepRunner) -> tuple[EpochResult, StepRunner]:
        return train_epoch_per_step(runner, train_data, position, files, runtime, on_first_quorum=pending.pop() if pending else None)

    run_epochs(trainer, len(train_data), val_data, position, files, one_epoch)


def run_finished(files: RunWriter, epochs: int) -> bool:
    """The run's replicas finished its `epochs` (progress.json says so; a resume that trains on
    to more epochs has not)."""
    progress = files.rundir.progress()
    return progress is not None and progress.status == "finished" and progress.epoch >= epochs


def batch_plan_for(cfg: TrainConfig, replicas: int) -> rules.BatchPlan:
    """The batch plan of a step taken by `replicas` workers or per-step replicas (the rules)."""
    return rules.resolve_batch_plan(
        replicas, global_batch_size=cfg.global_batch_size, batch_size_per_worker=cfg.batch_size_per_worker, micro_batch_size=cfg.micro_batch_size,
    )  # fmt: skip


def announce(files: RunWriter, attempt: Attempt, trainer: StepRunner, position: Position, state: dict | None, train_data: Table | Stream) -> None:
    """Rank 0 says what this attempt is (with the plan and rate it trains with, against the
    checkpoint's rate), and what the data costs the run."""
    lr_before = state.get("lr", math.nan) if state else math.nan
    world_size = trainer.runtime.world_size
    files.start_attempt(attempt.event(position, world_size, trainer.describe_plan(), trainer.lr_at(position.samples_seen), lr_before), position.step)
    for note in data_notes(train_data, world_size):
        files.event(Kind.DATA, note)


def open_source(name: str, source: dict[str, Any], runtime: Runtime, cfg: TrainConfig) -> Table | Stream:
    """A dataset as the driver prepared it (raytrain.driver.run.prepare_datasets): an in-memory
    table in the object store (the same object for every rank, mapped, not copied), or a
    stream of units each rank reads its own share of."""
    if source["kind"] == "memory":
        loaded = runtime.get_object(source["table"])
        return Table(loaded["columns"], dropped_rows=loaded["dropped_rows"])
    return Stream(name, source["units"], source["layout"], source["schema"], source["sample"], skip_nan_rows=cfg.skip_nan_rows)


def check_same_data(position: Position, train_data: Table | Stream) -> dict[str, Any]:
    """What the training set is now; a checkpoint's position is an offset into its order, so
    resuming on other data (rows, units, window, partitions) is refused."""
    now = train_data.layout.digest() if isinstance(train_data, Stream) else {"rows": len(train_data)}
    if position.data and position.data != now and position.epoch_offset:
        raise DataError(
            f"dataset 'train' is not the one the checkpoint at step {position.step} was trained on "
            f"(then {position.data}, now {now}); resume with the same data and --shuffle-window-rows/--data-partitions, "
            "or start a new run with another --name"
        )
    return now


def data_notes(data: Table | Stream, world_size: int) -> list[str]:
    """What the data costs the run: rows skipped in memory, and stream partitions that cannot
    keep every worker equally busy."""
    notes = []
    if isinstance(data, Table) and data.dropped_rows:
        notes.append(f"dataset 'train': skipped {data.dropped_rows:,} row(s) holding NaN or inf (--skip-nan-rows); {len(data):,} left")
    if not isinstance(data, Stream) or world_size == 1:
        return notes
    lanes = data.layout.lanes
    if lanes < world_size:
        notes.append(
            f"dataset 'train' has {lanes} partition(s) for {world_size} workers: {world_size - lanes} worker(s) get no rows "
            f"and wait for the others; give it more files or row groups (raytrain data), or raise --data-partitions"
        )
    elif lanes % world_size:
        notes.append(
            f"dataset 'train': {lanes} partitions over {world_size} workers leave some with one partition more, "
            "and the busiest sets the pace; a worker count that divides --data-partitions keeps them even"
        )
    return notes


class StallError(RuntimeError):
    """A collective timed out; the message names the stalled rank(s) and where each rank was."""


def explain_stall(cfg: TrainConfig, runtime: Runtime, heartbeat: Heartbeat, run_dir: Path, exc: Exception) -> str:
    heartbeat.write()
    records = read_heartbeats(run_dir / "heartbeats", runtime.world_size, since=heartbeat.attempt_start)
    return (
        f"A collective timed out on rank {runtime.world_rank} after --collective-timeout-s {cfg.collective_timeout_s:g}; "
        f"{diagnose(records, runtime.world_size, time.time())}\n  cause: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    )


# -- build -------------------------------------------------------------------------------


def restore(runtime: Runtime, files: RunWriter) -> dict[str, Any] | None:
    """The state to continue from: the furthest checkpoint of this run that loads.

    Ray registers a checkpoint only once its controller has processed the report, so the
    last one or two written before a crash can be missing from `get_checkpoint()` while
    complete on storage; and after a driver loss Ray's own record may be older than the
    run directory. Candidates are Ray's latest and every checkpoint directory of the run;
    the one furthest in training that loads wins, so a failure loses at most
    --checkpoint-every-steps steps. A corrupt or partial directory is skipped, and said.
    (A fresh run has neither: reusing a run name needs --resume.)
    """
    latest = runtime.latest_checkpoint()
    with (latest.as_directory() if latest is not None else contextlib.nullcontext(None)) as directory:
        candidates = ([Path(directory)] if directory else []) + ckpt.checkpoint_dirs(files.run_dir)
        if not candidates:
            return None
        skipped = []
        for candidate in sorted(candidates, key=ckpt.stored_step, reverse=True):
            try:
                state = ckpt.load_state(candidate)
            except ckpt.CheckpointError as error:
                skipped.append(str(error))
                continue
            if skipped:
                files.event(Kind.RESTORE, f"skipped unusable checkpoint(s): {'; '.join(skipped)}")
            return state
    raise ckpt.CheckpointError(f"no usable checkpoint in {files.run_dir}: {'; '.join(skipped)}")


@dataclass
class LossWindow:
    """This rank's steps since the last sync: the sample-weighted training loss, and the first
    step whose loss or gradient norm was NaN/inf (inf: none). On the device: a step adds to
    it without a host sync; `StepRunner.sync` reads and clears it."""

    loss_sum: torch.Tensor
    first_bad_step: torch.Tensor
    loss_count: int = 0

    @classmethod
    def on(cls, device: torch.device) -> "LossWindow":
        return cls(torch.zeros((), device=device), torch.full((), math.inf, dtype=torch.float64, device=device))

    def add(self, loss: torch.Tensor, count: int, step_index: int) -> None:
        """A micro-batch's loss over `count` samples (a non-finite one is noted, not summed)."""
        detached = loss.detach().float()
        self.note_if_bad(detached, step_index)
        self.loss_sum += torch.nan_to_num(detached, nan=0.0, posinf=0.0, neginf=0.0) * count
        self.loss_count += count

    def note_if_bad(self, value: torch.Tensor, step_index: int) -> None:
        """Note the step if `value` (a loss, a gradient norm) is NaN/inf."""
        bad = ~torch.isfinite(value) & torch.isinf(self.first_bad_step)
        self.first_bad_step = torch.where(bad, torch.full_like(self.first_bad_step, step_index), self.first_bad_step)

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.loss_sum.clone(), self.first_bad_step.clone(), self.loss_count

    def restore(self, saved: tuple[torch.Tensor, torch.Tensor, int]) -> None:
        """Back to `snapshot`: a step that was not committed counts for nothing."""
        self.loss_sum, self.first_bad_step, self.loss_count = saved

    def mean_loss(self) -> float | None:
        """This rank's mean loss so far (a host sync; rank 0's live row only)."""
        return float(self.loss_sum.item()) / self.loss_count if self.loss_count else None


@dataclass
class Throughput:
    """Samples per second from one metrics row to the next."""

    since_time: float
    since_samples: int

    def lap(self, samples_seen: int) -> float:
        now = time.perf_counter()
        rate = (samples_seen - self.since_samples) / max(1e-9, now - self.since_time)
        self.since_time, self.since_samples = now, samples_seen
        return rate


@dataclass
class StepRunner:
    """The model, optimizer and rules of one attempt; takes optimizer steps."""

    pipeline: Pipeline
    cfg: TrainConfig
    runtime: Runtime
    heartbeat: Heartbeat
    run_dir: str  # "" in unit tests: no checkpoint to name
    batch_plan: rules.BatchPlan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: rules.Schedule
    rate_multipliers: list[float]  # per parameter group: its rate at build / --lr
    window: LossWindow  # the steps since the last sync
    throughput: Throughput = field(default_factory=lambda: Throughput(time.perf_counter(), 0))
    loss_checked: bool = False  # compute_loss's result was checked (on the first call)

    @classmethod
    def build(
        cls, pipeline: Pipeline, cfg: TrainConfig, runtime: Runtime, heartbeat: Heartbeat, run_dir: Path,
        batch_plan: rules.BatchPlan, num_train_rows: int, state: dict[str, Any] | None,
    ) -> "StepRunner":  # fmt: skip
        """Everything an attempt steps with, from the checkpoint's `state` (None: a fresh start)."""
        # One seed for model init on every rank: identical replicas before DDP's broadcast.
        _seed_everything(cfg.seed)
        with pipeline_code(pipeline, "build_model"):
            model = pipeline.build_model(cfg)
            if not isinstance(model, torch.nn.Module):
                raise PipelineCodeError(f"pipeline {pipeline.name}: build_model returned a {type(model).__name__}, not a torch.nn.Module")
        if state is not None:
            model.load_state_dict(state["model"], strict=True)
        model = runtime.prepare_model(model, dataclasses.asdict(cfg.ddp))
        with pipeline_code(pipeline, "build_optimizer"):
            optimizer = pipeline.build_optimizer(ckpt.unwrap(model), cfg)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise PipelineCodeError(f"pipeline {pipeline.name}: build_optimizer returned a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        multipliers = optim.rate_multipliers(optimizer, cfg.lr)  # before a checkpoint's state overwrites the rates
        scaler = torch.amp.GradScaler(runtime.device.type, enabled=cfg.precision == "fp16")
        if state is not None:
            with pipeline_code(pipeline, "build_optimizer"):  # another optimizer than the checkpoint's is the pipeline's doing
                optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
        _restore_rank_rng(cfg.seed, runtime, state)
        return cls(
            pipeline=pipeline,
            cfg=cfg,
            runtime=runtime,
            heartbeat=heartbeat,
            run_dir=str(run_dir),
            batch_plan=batch_plan,
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            schedule=run_schedule(cfg, batch_plan, num_train_rows),
            rate_multipliers=multipliers,
            window=LossWindow.on(runtime.device),
            throughput=Throughput(time.perf_counter(), Position.restored(state).samples_seen),
        )

    @property
    def peak_lr(self) -> float:
        return self.schedule.peak_lr

    def lr_at(self, samples_seen: int) -> float:
        factor = self.pipeline.lr_factor if overrides(self.pipeline, "lr_factor") else None
        return self.schedule.lr(samples_seen, factor)

    def describe_plan(self) -> str:
        return describe_plan(self.cfg, self.pipeline, self.batch_plan, self.schedule, self.runtime.backend)

    def sync_device(self) -> None:
        # GPU kernels run asynchronously: without a sync, phase times land on whatever
        # waits next. Only when asked (raytrain bench), as it costs overlap.
        if self.cfg.time_phases and self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)

    def autocast(self):
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.runtime.device.type, dtype=dtype)

    def accumulating(self, last: bool):
        """DDP's gradient all-reduce skipped on all micro-batches of a step but the last."""
        return contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()

    def phases(self, position: Position, timed: bool) -> StepPhases:
        """The instrumentation of the step at `position`; `timed`: a steady step, whose phase
        times add to the position's."""
        return StepPhases(self.heartbeat, position.step, PhaseTimer(position.phase_time_s if timed else None, self.sync_device))

    def optimizer_step(self, data: TableEpoch | StreamEpoch, step: rules.Step, position: Position, timed: bool) -> float:
        """One optimizer step over this rank's rows of `step`, from `position`; returns the lr used."""
        phase = self.phases(position, timed)
        self.gradients(data, step, position, phase)
        return self.apply_gradients(position, phase)

    def gradients(self, data: TableEpoch | StreamEpoch, step: rules.Step, position: Position, phase: StepPhases) -> None:
        """Forward and backward over this rank's rows of `step` (gradients averaged over ranks)."""
        step_index = position.step
        for index, piece in enumerate(split_rows(data.rows(step), self.batch_plan.accumulation_steps)):
            # A rank with no rows in a (micro-)step still runs forward and backward (the data
            # gives one row for an empty piece; weight 0 below) so that it joins the
            # gradient all-reduce.
            with phase("data", timed="data_wait"):
                batch, count = data.batch(piece, self.runtime.device)
                batch = self.augment(batch, index, step_index)
            with phase(timed="forward_backward"):  # includes DDP's all-reduce, overlapped with backward
                # DDP averages gradients over ranks; this weight turns that into the mean
                # over the samples actually present in the step (tail steps are smaller).
                weight = rules.gradient_weight(count, self.runtime.world_size, step.size)
                with self.accumulating(last=index == self.batch_plan.accumulation_steps - 1):
                    with phase("forward"):
                        loss, _ = self.compute_loss(batch)
                    with phase("backward"):
                        self.scaler.scale(loss * weight).backward()
                self.window.add(loss, count, step_index)

    def apply_gradients(self, position: Position, phase: StepPhases) -> float:
        """The optimizer's step at the rate of `position`; returns that rate."""
        lr = self.lr_at(position.samples_seen)
        optim.set_rates(self.optimizer, lr, self.rate_multipliers)
        step_index = position.step
        with phase("optimizer", timed="optimizer"):
            self.clip_gradients(step_index)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return lr

    def for_quorum(self, replicas: int, num_train_rows: int) -> "StepRunner":
        """This runner with the batch plan and rate of a quorum of `replicas` (per-step mode)."""
        plan = batch_plan_for(self.cfg, replicas)
        return dataclasses.replace(self, batch_plan=plan, schedule=run_schedule(self.cfg, plan, num_train_rows))

    def live_state(self, position: Position) -> dict[str, Any]:
        """What a joining replica copies from this one (per-step mode)."""
        return {
            "model": ckpt.unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "position": dataclasses.asdict(position),
        }  # fmt: skip

    def load_live_state(self, live: dict[str, Any], position: Position) -> None:
        ckpt.unwrap(self.model).load_state_dict(live["model"])
        self.optimizer.load_state_dict(live["optimizer"])
        self.scaler.load_state_dict(live["scaler"])
        for name, value in live["position"].items():
            setattr(position, name, value)

    def clip_gradients(self, step_index: int) -> None:
        if self.cfg.grad_clip_norm is None:
            return
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16's scaled ones
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm)
        if not self.scaler.is_enabled():  # under fp16 an inf norm is an overflow the scaler skips, not divergence
            self.window.note_if_bad(norm, step_index)

    def augment(self, batch: dict[str, torch.Tensor], micro_index: int, step_index: int) -> dict[str, torch.Tensor]:
        """The pipeline's transform_batch under generators seeded from (seed, epoch, step, rank,
        micro-batch): new every epoch, the same after a resume; the run's own streams untouched."""
        if not overrides(self.pipeline, "transform_batch"):
            return batch
        seed = int(np.random.SeedSequence([self.cfg.seed, _CONTEXT.epoch, step_index, self.runtime.world_rank, micro_index]).generate_state(1)[0])
        devices = [self.runtime.device] if self.runtime.device.type == "cuda" else []
        numpy_state = np.random.get_state()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            np.random.seed(seed)
            try:
                with pipeline_code(self.pipeline, "transform_batch"):
                    out = self.pipeline.transform_batch(Batch(batch), _CONTEXT)
            finally:
                np.random.set_state(numpy_state)
        if not isinstance(out, dict):
            raise PipelineCodeError(f"pipeline {self.pipeline.name}: transform_batch must return the batch (a dict of tensors); it returned a {type(out).__name__}")
        return out

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The pipeline's compute_loss under autocast; its first result is checked, and an
        exception from it is the pipeline's (not retried), unless a collective failed in it."""
        try:
            with self.autocast():
                output = self.pipeline.compute_loss(self.model, Batch(batch))
        except Exception as exc:
            if is_collective_failure(exc):
                raise  # a peer died or stalled inside DDP's forward: a worker fault, retried
            with pipeline_code(self.pipeline, "compute_loss"):
                raise
        if not self.loss_checked:
            check_loss_output(self.pipeline, output, training=self.model.training)
            self.loss_checked = True
        return split_loss(output)

    def sync(self, position: Position, stop_requested: bool = False) -> tuple[float, int, bool]:
        """One collective at the logging cadence (every rank calls it at the same steps, after
        the step to `position`): the sample-weighted mean training loss over all ranks since the
        last call, the samples it covers, and whether any rank was asked to stop. A NaN/inf loss
        on any rank since the last call ends the run here (TrainingDiverged), before its
        weights are saved."""
        self.heartbeat.mark(position.step - 1, "all_reduce")  # in the step just taken
        world, rank, window = self.runtime.world_size, self.runtime.world_rank, self.window
        first_bad = [math.inf] * world
        first_bad[rank] = float(window.first_bad_step.item())
        # Sum-reduce: each rank fills only its own slot of the first-bad-step vector (others 0).
        slots = [value if index == rank else 0.0 for index, value in enumerate(first_bad)]
        totals = self.runtime.all_reduce_sum([float(window.loss_sum.item()), float(window.loss_count), float(stop_requested), *slots])
        total, count, stop, bad_steps = totals[0], int(totals[1]), totals[2] > 0, totals[3:]
        window.loss_sum.zero_()
        window.loss_count = 0
        diverged = {r: int(step) for r, step in enumerate(bad_steps) if math.isfinite(step)}
        if diverged:
            raise TrainingDiverged(self.divergence_message(diverged, stopped_at=position.step))
        window.first_bad_step.fill_(math.inf)
        return (total / count if count else float("nan")), count, stop

    def divergence_message(self, diverged: dict[int, int], stopped_at: int) -> str:
        step = min(diverged.values())
        ranks = ", ".join(str(r) for r, s in sorted(diverged.items()) if s == step)
        good = ckpt.latest_complete(Path(self.run_dir)) if self.run_dir else None
        precision = (
            " or train in bf16 or fp32 instead of fp16 (--precision)" if self.cfg.precision == "fp16" else
            " or use --precision fp32" if self.cfg.precision == "bf16" else ""
        )  # fmt: skip
        return (
            f"The training loss became NaN or inf at step {step} on rank {ranks}; the run stopped at step {stopped_at} "
            f"and saved nothing from these weights. Last good checkpoint: {good or 'none yet'}. Lower the learning rate "
            f"(--lr, now {sci(self.cfg.lr)}, peak {sci(self.peak_lr)}; or a longer --warmup-epochs){precision}, "
            "then --resume continues from that checkpoint"
        )

    def metrics_row(self, position: Position, *, loss: float, samples_per_s: float, extra: dict | None = None) -> MetricsRow:
        return MetricsRow(
            epoch=position.epoch if position.epoch_offset == 0 else position.epoch + 1,
            step=position.step,
            samples_seen=position.samples_seen,
            world_size=self.runtime.world_size,
            global_batch_size=self.batch_plan.global_batch_size,
            lr=self.lr_at(position.samples_seen),
            loss=loss,
            samples_per_s=samples_per_s,
            time_s=time.time(),
            extra=dict(extra or {}),
        )

    def state(self, position: Position) -> dict[str, Any]:
        """Everything needed to continue; collected on every rank (RNG states are gathered)."""
        rng_states = self.runtime.all_gather_object(ckpt.rng_state())
        return {
            "model": ckpt.model_state(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": {"samples_seen": position.samples_seen, "peak_lr": self.peak_lr, "schedule": self.cfg.schedule, "rate_multipliers": self.rate_multipliers},
            "scaler": self.scaler.state_dict(),
            "rng": rng_states,
            "position": dataclasses.asdict(position),
            "batch_plan": dataclasses.asdict(self.batch_plan),
            "lr": self.lr_at(position.samples_seen),
        }


# -- loop --------------------------------------------------------------------------------


class EpochResult(NamedTuple):
    loss: float  # the epoch's mean training loss over all ranks
    samples_per_s: float
    stopped: bool  # the run was asked to stop: a checkpoint at the current step has been reported
    finished_elsewhere: bool = False  # per-step: a replacement found the others done with the run


def train_epoch(trainer: StepRunner, source: Table | Stream, position: Position, files: RunWriter) -> EpochResult:
    """Train the rest of the current epoch (to the step where the run was asked to stop, if it was)."""
    cfg, start, samples_before = trainer.cfg, time.perf_counter(), position.samples_seen
    data = source.epoch(cfg.seed, position.epoch, position.epoch_offset, trainer.runtime.world_rank, trainer.runtime.world_size)
    steps = rules.epoch_steps(len(source), trainer.batch_plan.global_batch_size, position.epoch_offset)
    trainer.model.train()
    epoch_loss, stop = EpochLoss(), False
    for step in steps:
        take_step(trainer, data, step, position)
        last = step is steps[-1]
        stop = after_step(trainer, position, files, len(source), last, epoch_loss)
        if stop and not last:
            return EpochResult(math.nan, math.nan, stopped=True)
    note_skipped_rows(trainer, data, position, files)
    samples_per_s = (position.samples_seen - samples_before) / max(1e-9, time.perf_counter() - start)
    return EpochResult(epoch_loss.mean(), samples_per_s, stop)


@dataclass
class EpochLoss:
    """The epoch's sample-weighted training loss over all ranks, from the syncs."""

    total: float = 0.0
    count: int = 0

    def add(self, loss: float, count: int) -> None:
        self.total += loss * count
        self.count += count

    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan


def after_step(
    trainer: StepRunner, position: Position, files: RunWriter, epoch_rows: int, last: bool, epoch_loss: EpochLoss,
    every_replica_looks: bool = False,
) -> bool:  # fmt: skip
    """After a step: rank 0's live row; at the logging cadence the sync (loss, stop request)
    and a metrics row; a checkpoint when one is due, or when the run is asked to stop
    mid-epoch. Returns whether it was asked to stop. `every_replica_looks` (per-step mode):
    each replica reads the stop request itself rather than trusting the sync to carry it."""
    cfg, stop = trainer.cfg, False
    report_live(files, trainer, position, epoch_rows)
    checkpoint_now = bool(cfg.checkpoint_every_steps) and position.step % cfg.checkpoint_every_steps == 0 and not last
    if position.step % cfg.log_every_steps == 0 or last or checkpoint_now:
        # Every checkpoint follows a sync: weights are saved only after their loss was seen finite.
        asked = files.stop_requested(anyone=every_replica_looks)
        loss, count, stop = trainer.sync(position, stop_requested=asked)
        stop = stop or asked
        epoch_loss.add(loss, count)
        if not last:
            files.metrics(trainer.metrics_row(position, loss=loss, samples_per_s=trainer.throughput.lap(position.samples_seen)))
        if stop and not last:
            report_checkpoint(trainer, position)
            return True
    if checkpoint_now:
        report_checkpoint(trainer, position)
    return stop


def train_epoch_per_step(
    trainer: StepRunner, source: Table | Stream, position: Position, files: RunWriter, replicas: ReplicaRuntime,
    on_first_quorum: Callable[[], None] | None = None,
) -> tuple[EpochResult, StepRunner]:  # fmt: skip
    """Train the rest of the current epoch one step at a time over the quorum of live replicas.

    Each step: the quorum (a joining replica heals here, position included); on a new quorum
    the batch plan and rate follow its size and the rows from the current offset are split
    over its members; forward and backward; then the step is applied only if every member
    commits it. An uncommitted step is taken again from the same offset, so a committed step
    is the only one that counts its rows: every row once per epoch. Returns the epoch's
    result and the runner of the last quorum."""
    cfg, start, samples_before = trainer.cfg, time.perf_counter(), position.samples_seen
    trainer.model.train()
    data, split, taken, stop = None, None, 0, False
    while position.epoch_offset < len(source):
        quorum = replicas.start_step(position.step)
        files.enabled = replicas.is_rank0
        if replicas.healed:  # the position (and the epoch's loss so far) came from a live peer
            start, samples_before = time.perf_counter(), position.samples_seen
        if position.epoch_loss[0] != position.epoch:
            position.epoch_loss = [float(position.epoch), 0.0, 0.0]
        if on_first_quorum is not None:
            # Alone in its first quorum after the others wrote the end: a replacement too late to join.
            if quorum.size == 1 < replicas.replica_count and run_finished(files, cfg.epochs):
                return EpochResult(math.nan, math.nan, stopped=False, finished_elsewhere=True), trainer
            if not replicas.healed:  # a replacement says nothing of its own: the quorum's line does
                on_first_quorum()
            on_first_quorum = None
        if quorum != split:
            trainer = follow_quorum(trainer, quorum.size, position, files, len(source))
            split, data = quorum, None
        if data is None:  # a new split, or the rows of an uncommitted step to read again
            data = source.epoch(cfg.seed, position.epoch, position.epoch_offset, quorum.rank, quorum.size)
        step = rules.next_step(len(source), trainer.batch_plan.global_batch_size, position.epoch_offset, index=taken)
        _update_context(trainer, position)
        tick, steady = time.perf_counter(), step.index >= cfg.timing_warmup_steps
        phase, window = trainer.phases(position, timed=steady), trainer.window.snapshot()
        trainer.gradients(data, step, position, phase)
        if not replicas.commit():  # a member failed inside the step: nothing of it is applied
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.window.restore(window)
            data = None
            continue
        trainer.apply_gradients(position, phase)
        advance(position, step, steady, time.perf_counter() - tick)
        taken += 1
        last = position.epoch_offset >= len(source)
        epoch_loss = EpochLoss(position.epoch_loss[1], int(position.epoch_loss[2]))
        stop = after_step(trainer, position, files, len(source), last, epoch_loss, every_replica_looks=True)
        position.epoch_loss[1:] = [epoch_loss.total, float(epoch_loss.count)]
        if stop and not last:
            return EpochResult(math.nan, math.nan, stopped=True), trainer
    samples_per_s = (position.samples_seen - samples_before) / max(1e-9, time.perf_counter() - start)
    total, count = position.epoch_loss[1], position.epoch_loss[2]
    return EpochResult(total / count if count else math.nan, samples_per_s, stop), trainer


def follow_quorum(trainer: StepRunner, size: int, position: Position, files: RunWriter, num_train_rows: int) -> StepRunner:
    """The runner for a quorum of `size` replicas (its batch plan and rate), and one event line
    when the size differs from the one the run last trained with (the position says it, the
    same on every member, a healed one included)."""
    if size != trainer.batch_plan.world_size:
        trainer = trainer.for_quorum(size, num_train_rows)
    previous = position.world_sizes[-1] if position.world_sizes else size
    if size != previous:
        files.event(Kind.QUORUM, quorum_line(trainer, position, previous), world_size=size, previous_world_size=previous, step=position.step)
    position.world_sizes = _append_if_new(position.world_sizes, size)
    return trainer


def quorum_line(trainer: StepRunner, position: Position, previous: int) -> str:
    """`Quorum 3 → 2 replicas at step 40 (epoch 1, 1,280 samples into it): <plan>; lr now …`."""
    now = trainer.runtime.world_size
    why = "a replica was lost; the survivors go on" if now < previous else "a replica rejoined, healed from a live peer"
    return (
        f"Quorum {previous} → {now} replicas at step {position.step} (epoch {position.epoch + 1}, {position.epoch_offset:,} samples "
        f"into it; {why}): {trainer.describe_plan()}; lr now {sci(trainer.lr_at(position.samples_seen))}"
    )


def advance(position: Position, step: rules.Step, steady: bool, seconds: float) -> None:
    """The position after `step` (a timed step adds to the steady throughput)."""
    position.step += 1
    position.samples_seen += step.size
    position.epoch_offset = step.end
    if steady:
        position.steady_steps += 1
        position.steady_samples += step.size
        position.steady_time_s += seconds


def take_step(trainer: StepRunner, data: TableEpoch | StreamEpoch, step: rules.Step, position: Position) -> None:
    """One optimizer step, and the position after it; steps past --timing-warmup-steps are timed."""
    tick = time.perf_counter()
    _update_context(trainer, position)
    steady = step.index >= trainer.cfg.timing_warmup_steps
    trainer.optimizer_step(data, step, position, timed=steady)
    advance(position, step, steady, time.perf_counter() - tick)


def end_epoch(trainer: StepRunner, val_data: Table | Stream | None, position: Position, files: RunWriter, epoch: EpochResult) -> None:
    """Validate, write the epoch's row and report it with a checkpoint."""
    trainer.heartbeat.mark(position.step, "eval")
    val_metrics = evaluate(trainer, val_data) if val_data is not None else {}
    position.epoch, position.epoch_offset = position.epoch + 1, 0
    row = trainer.metrics_row(position, loss=epoch.loss, samples_per_s=epoch.samples_per_s, extra=val_metrics)
    files.epoch_end(row, trainer.cfg.epochs)
    # report: a barrier on every rank; rank 0 attaches the checkpoint.
    trainer.heartbeat.mark(position.step, "report")
    trainer.runtime.report(row.to_json(), trainer.state(position), ckpt.save_state, files.run_dir)


def report_checkpoint(trainer: StepRunner, position: Position) -> None:
    """A mid-epoch checkpoint at the current step (a barrier on every rank)."""
    trainer.heartbeat.mark(position.step, "report")
    row = trainer.metrics_row(position, loss=float("nan"), samples_per_s=0.0)
    trainer.runtime.report(row.to_json(), trainer.state(position), ckpt.save_state, trainer.run_dir)


def report_live(files: RunWriter, trainer: StepRunner, position: Position, epoch_rows: int) -> None:
    """About once a second, where rank 0 is in the epoch (for the driver's progress bar)."""
    if files.live_due():
        files.live(
            epoch=position.epoch + 1, step=position.step, samples_seen=position.samples_seen, epoch_rows=epoch_rows,
            global_batch_size=trainer.batch_plan.global_batch_size, world_size=trainer.runtime.world_size,
            loss=trainer.window.mean_loss(),
        )  # fmt: skip


def note_skipped_rows(trainer: StepRunner, data: TableEpoch | StreamEpoch, position: Position, files: RunWriter) -> None:
    """Rows of the stream skipped this epoch for NaN/inf (--skip-nan-rows), over all ranks."""
    if trainer.cfg.skip_nan_rows and isinstance(data, StreamEpoch):  # a collective: every rank, at the epoch's end
        skipped = int(trainer.runtime.all_reduce_sum([float(data.skipped_rows)])[0])
        if skipped:
            files.event(Kind.DATA, f"epoch {position.epoch + 1}: skipped {skipped:,} row(s) holding NaN or inf (--skip-nan-rows)")


@torch.no_grad()
def evaluate(trainer: StepRunner, source: Table | Stream) -> dict[str, float]:
    """Validation loss and metrics, averaged over all validation samples of all ranks."""
    runtime = trainer.runtime
    trainer.model.eval()
    batch_size = max(1, trainer.batch_plan.per_worker_max if not trainer.cfg.micro_batch_size else trainer.cfg.micro_batch_size)
    sums: dict[str, float] = {}
    count = 0
    # A rank without validation rows evaluates one row with weight 0 (n == 0), so every
    # rank learns the metric names and joins the reduction below.
    rank, world = runtime.evaluation_share()
    for n, batch in source.eval_batches(rank, world, batch_size, runtime.device):
        loss, metrics = trainer.compute_loss(batch)
        for name, value in {"loss": loss, **metrics}.items():
            sums[name] = sums.get(name, 0.0) + float(value) * n
        count += n
    names = sorted(sums)
    values = [sums[name] for name in names] + [float(count)]
    totals = runtime.all_reduce_sum(values) if world > 1 else values
    trainer.model.train()
    return {f"val_{name}": total / totals[-1] for name, total in zip(names, totals[:-1])}


def split_rows(rows: list[tuple], parts: int) -> list[list[tuple]]:
    """A rank's rows of a step — ranges whose last two fields are (lo, hi) — cut into `parts`
    micro-batches of near-equal size (some may be empty)."""
    sizes = [r[-1] - r[-2] for r in rows]
    out: list[list[tuple]] = [[] for _ in range(parts)]
    taken = 0  # rows of `rows` handed out so far
    for part, (start, end) in enumerate(rules.split_range(sum(sizes), parts)):
        while taken < end:
            offset = taken
            for r, size in zip(rows, sizes):
                if offset < size:
                    lo = r[-2] + offset
                    hi = min(r[-1], lo + end - taken)
                    out[part].append((*r[:-2], lo, hi))
                    taken += hi - lo
                    break
                offset -= size
    return out


def run_schedule(cfg: TrainConfig, batch_plan: rules.BatchPlan, num_train_rows: int) -> rules.Schedule:
    """The rate at every sample count: the scaling rule's peak, warmup and schedule (plan.Schedule)."""
    peak = cfg.lr * rules.lr_scale(cfg.lr_scaling, batch_plan.global_batch_size, cfg.reference_batch_size)
    start = cfg.lr if cfg.warmup_start_factor is None else peak * cfg.warmup_start_factor
    milestones = tuple(round(m * num_train_rows) for m in (cfg.lr_milestones or ()))
    return rules.Schedule(
        cfg.schedule, peak, start, round(cfg.warmup_epochs * num_train_rows), cfg.epochs * num_train_rows, milestones, cfg.lr_gamma
    )


class Batch(dict):
    """A batch whose missing key names the keys it has (what compute_loss sees)."""

    def __missing__(self, key):
        raise KeyError(f"{key!r}: the batch has no such column; it has {', '.join(map(repr, self))} (columns of the dataset)")


class TrainingDiverged(UserFault, FloatingPointError):
    """A NaN/inf training loss: retrying from the last checkpoint would diverge the same way."""


def is_collective_failure(exc: BaseException) -> bool:
    """An error from torch.distributed (a peer that died or stalled), not from user code."""
    dist_errors = tuple(getattr(torch.distributed, name) for name in ("DistError",) if hasattr(torch.distributed, name))
    if dist_errors and isinstance(exc, dist_errors):
        return True
    text = str(exc)
    return looks_like_timeout(exc) or any(mark in text for mark in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "ProcessGroup"))


def check_loss_output(pipeline: Pipeline, output: Any, *, training: bool) -> None:
    """compute_loss must return a scalar tensor (with grad, when training) or (loss, dict)."""
    what = f"pipeline {pipeline.name}: compute_loss must return a scalar loss tensor or (loss, {{name: value}})"
    loss, metrics = output if isinstance(output, tuple) and len(output) == 2 else (output, {})
    if isinstance(output, tuple) and len(output) != 2:
        raise PipelineCodeError(f"{what}; it returned a tuple of {len(output)}")
    if not isinstance(loss, torch.Tensor):
        raise PipelineCodeError(f"{what}; it returned a {type(loss).__name__} ({str(loss)[:60]}): return the torch tensor itself, not .item() or a float")
    if loss.numel() != 1:
        raise PipelineCodeError(f"{what}; its loss has shape {tuple(loss.shape)}: reduce it, e.g. F.cross_entropy(..., reduction='mean') or loss.mean()")
    if training and not loss.requires_grad:
        raise PipelineCodeError(f"{what}; its loss has no gradient (requires_grad=False): compute it from the model's output, without .detach() or torch.no_grad()")
    if not isinstance(metrics, dict):
        raise PipelineCodeError(f"{what}; its second item is a {type(metrics).__name__}, not a dict of metrics")


def split_loss(output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A pipeline's compute_loss returns loss or (loss, metrics)."""
    if isinstance(output, tuple):
        loss, metrics = output
        return loss, dict(metrics or {})
    return output, {}


# -- helpers -----------------------------------------------------------------------------


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _restore_rank_rng(seed: int, runtime: Runtime, state: dict | None) -> None:
    """Per-rank RNG for dropout and augmentation: restored when the world size is unchanged,
    else derived from (seed, rank, step) so ranks never share a stream."""
    stored = (state or {}).get("rng") or []
    if len(stored) == runtime.world_size:
        ckpt.set_rng_state(stored[runtime.world_rank])
        return
    step = (state or {}).get("position", {}).get("step", 0)
    _seed_everything(int(np.random.SeedSequence([seed, runtime.world_rank, step]).generate_state(1)[0]))


def _update_context(trainer: StepRunner, position: Position) -> None:
    _CONTEXT.epoch = position.epoch
    _CONTEXT.step = position.step
    _CONTEXT.samples_seen = position.samples_seen
    _CONTEXT.world_rank = trainer.runtime.world_rank
    _CONTEXT.world_size = trainer.runtime.world_size
    _CONTEXT.global_batch_size = trainer.batch_plan.global_batch_size
    _CONTEXT.lr = trainer.lr_at(position.samples_seen)


def _append_if_new(sizes: list[int], size: int) -> list[int]:
    return sizes if sizes and sizes[-1] == size else [*sizes, size]
