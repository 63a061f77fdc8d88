"""The per-worker training function: restore → build → loop → report.

Ray Train calls `train_loop_per_worker` once per attempt: at the start, after every
failure and after every resize. Resume is the only way in: a fresh run is "no
checkpoint". The batch plan and the learning rate are re-derived from the rules in
`raytrain.plan` at every attempt, for the world size this attempt has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytrain import checkpoint as ckpt
from raytrain import optim, rundir
from raytrain import plan as rules
from raytrain.config import TrainConfig
from raytrain.data import DataError, Stream, StreamEpoch, Table, TableEpoch
from raytrain.errors import PipelineCodeError, UserFault, pipeline_code
from raytrain.heartbeat import Heartbeat, diagnose, looks_like_timeout, read_heartbeats
from raytrain.pipeline import _CONTEXT, Pipeline, overrides
from raytrain.runtime import Runtime

LIVE_INTERVAL_S = 1.0  # rank 0 writes live.jsonl at most this often


@dataclass
class Position:
    """Where training is: stored in every checkpoint, enough to continue exactly."""

    epoch: int = 0  # epoch being trained, 0-based
    epoch_offset: int = 0  # rows of this epoch's order already trained on
    step: int = 0  # optimizer steps taken since the run began
    samples_seen: int = 0  # training samples since the run began
    world_sizes: list[int] = field(default_factory=list)
    steady_steps: int = 0  # steps timed for the steady throughput (past --timing-warmup-steps)
    steady_samples: int = 0
    steady_time_s: float = 0.0
    phase_time_s: dict[str, float] = field(default_factory=dict)  # steady steps only, this rank
    data: dict[str, Any] = field(default_factory=dict)  # what the training set was (its layout): resume needs the same

    def timer(self, enabled: bool, sync) -> "PhaseTimer":
        return PhaseTimer(self.phase_time_s if enabled else None, sync)


class PhaseTimer:
    """Splits a step's time into phases (data wait, forward+backward, optimizer)."""

    def __init__(self, totals: dict[str, float] | None, sync):
        self.totals, self.sync = totals, sync
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.totals is None:
            return
        self.sync()
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    cfg = TrainConfig.from_dict(payload["config"])
    pipeline: Pipeline = payload["pipeline"]
    runtime = Runtime()
    run_dir = Path(payload["run_dir"])
    files = RunFiles(run_dir, enabled=runtime.is_rank0)
    heartbeat = Heartbeat(run_dir / "heartbeats", runtime.world_rank, enabled=runtime.world_size > 1)
    files.clear_staging()
    try:
        run_attempt(cfg, pipeline, runtime, files, heartbeat, payload["sources"])
    except Exception as exc:
        if runtime.world_size > 1 and looks_like_timeout(exc):
            raise StallError(explain_stall(cfg, runtime, heartbeat, run_dir, exc)) from exc
        raise
    finally:
        heartbeat.stop()


def run_attempt(cfg: TrainConfig, pipeline: Pipeline, runtime: Runtime, files: "RunFiles", heartbeat: Heartbeat, sources: dict[str, dict]) -> None:
    # restore
    state = restore(runtime, files)
    position = Position(**state["position"]) if state else Position()

    # build
    batch_plan = rules.resolve_batch_plan(
        runtime.world_size,
        global_batch_size=cfg.global_batch_size,
        batch_size_per_worker=cfg.batch_size_per_worker,
        micro_batch_size=cfg.micro_batch_size,
    )
    heartbeat.mark(position.step, "data")
    train_data = open_source("train", sources["train"], runtime, cfg)
    val_data = open_source("val", sources["val"], runtime, cfg) if "val" in sources else None
    position.data = check_same_data(position, train_data)
    trainer = StepRunner.build(pipeline, cfg, runtime, files.run_dir, batch_plan, len(train_data), state)
    trainer.heartbeat = heartbeat
    trainer.last_log_samples = position.samples_seen
    files.start_attempt(position, state, trainer, cfg)
    files.data_notes(train_data, runtime.world_size)
    position.world_sizes = _append_if_new(position.world_sizes, runtime.world_size)

    # loop
    while position.epoch < cfg.epochs:
        epoch_start, samples_before = time.perf_counter(), position.samples_seen
        train_loss, stop = train_epoch(trainer, train_data, position, cfg, files)
        if stop and position.epoch_offset < len(train_data):  # asked to stop mid-epoch: checkpointed at this step
            files.interrupted(position)
            return
        epoch_samples_per_s = (position.samples_seen - samples_before) / max(1e-9, time.perf_counter() - epoch_start)
        heartbeat.mark(position.step, "eval")
        val_metrics = evaluate(trainer, val_data) if val_data is not None else {}
        position.epoch, position.epoch_offset = position.epoch + 1, 0
        row = trainer.metrics_row(position, loss=train_loss, samples_per_s=epoch_samples_per_s, extra=val_metrics)
        files.epoch_end(row, cfg.epochs)
        # report: a barrier on every rank; rank 0 attaches the checkpoint.
        heartbeat.mark(position.step, "report")
        runtime.report(row, trainer.state(position), ckpt.save_state, files.run_dir)
        if stop and position.epoch < cfg.epochs:
            files.interrupted(position)
            return

    files.finish(trainer, position)


def open_source(name: str, source: dict[str, Any], runtime: Runtime, cfg: TrainConfig) -> Table | Stream:
    """A dataset as the driver prepared it (raytrain.trainer.prepare_datasets): an in-memory
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


def restore(runtime: Runtime, files: "RunFiles") -> dict[str, Any] | None:
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
                files.event("restore", f"skipped unusable checkpoint(s): {'; '.join(skipped)}")
            return state
    raise ckpt.CheckpointError(f"no usable checkpoint in {files.run_dir}: {'; '.join(skipped)}")


@dataclass
class StepRunner:
    """The model, optimizer and rules of one attempt; takes optimizer steps."""

    pipeline: Pipeline
    cfg: TrainConfig
    runtime: Runtime
    runtime_run_dir: str
    batch_plan: rules.BatchPlan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: rules.Schedule
    rate_multipliers: list[float]  # per parameter group: its rate at build / --lr
    loss_sum: torch.Tensor = None  # running sample-weighted loss since the last metrics row
    loss_count: int = 0
    last_log_time: float = 0.0
    last_log_samples: int = 0
    heartbeat: Heartbeat = None
    step_index: int = 0  # global optimizer step being taken, for heartbeats
    first_bad_step: torch.Tensor = None  # first step whose loss was NaN/inf since the last sync (inf: none); on the device
    loss_checked: bool = False  # compute_loss's result was checked (on the first call)

    @classmethod
    def build(cls, pipeline, cfg, runtime, run_dir, batch_plan, num_train_rows, state) -> "StepRunner":
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
            runtime_run_dir=str(run_dir),
            batch_plan=batch_plan,
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            schedule=run_schedule(cfg, batch_plan, num_train_rows),
            rate_multipliers=multipliers,
            loss_sum=torch.zeros((), device=runtime.device),
            first_bad_step=torch.full((), math.inf, dtype=torch.float64, device=runtime.device),
            last_log_time=time.perf_counter(),
        )

    @property
    def peak_lr(self) -> float:
        return self.schedule.peak_lr

    def lr_at(self, samples_seen: int) -> float:
        factor = self.pipeline.lr_factor if overrides(self.pipeline, "lr_factor") else None
        return self.schedule.lr(samples_seen, factor)

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

    def optimizer_step(self, data: TableEpoch | StreamEpoch, step: rules.Step, samples_seen: int, timer: "PhaseTimer") -> float:
        """One optimizer step over this rank's rows of `step`; returns the lr used."""
        lr = self.lr_at(samples_seen)
        optim.set_rates(self.optimizer, lr, self.rate_multipliers)
        rows = data.rows(step)
        for index, piece in enumerate(split_rows(rows, self.batch_plan.accumulation_steps)):
            # A rank with no rows in a (micro-)step still runs forward and backward (the data
            # gives one row for an empty piece; weight 0 below) so that it joins the
            # gradient all-reduce.
            self.heartbeat.mark(self.step_index, "data")
            batch, count = data.batch(piece, self.runtime.device)
            batch = self.augment(batch, index)
            timer.lap("data_wait")
            # DDP averages gradients over ranks; this weight turns that into the mean
            # over the samples actually present in the step (tail steps are smaller).
            weight = count * self.runtime.world_size / step.size
            last = index == self.batch_plan.accumulation_steps - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                self.heartbeat.mark(self.step_index, "forward")
                loss, _ = self.compute_loss(batch)
                self.heartbeat.mark(self.step_index, "backward")
                self.scaler.scale(loss * weight).backward()
            detached = loss.detach().float()
            self.note_if_bad(detached)
            self.loss_sum += torch.nan_to_num(detached, nan=0.0, posinf=0.0, neginf=0.0) * count
            self.loss_count += count
            timer.lap("forward_backward")  # includes DDP's all-reduce, overlapped with backward
        self.heartbeat.mark(self.step_index, "optimizer")
        if self.cfg.grad_clip_norm is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16's scaled ones
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm)
            if not self.scaler.is_enabled():  # under fp16 an inf norm is an overflow the scaler skips, not divergence
                self.note_if_bad(norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        timer.lap("optimizer")
        return lr

    def note_if_bad(self, value: torch.Tensor) -> None:
        """Note the step if `value` (a loss, a gradient norm) is NaN/inf — on the device, without
        a host sync; `sync` reads it."""
        bad = ~torch.isfinite(value) & torch.isinf(self.first_bad_step)
        self.first_bad_step = torch.where(bad, torch.full_like(self.first_bad_step, self.step_index), self.first_bad_step)

    def augment(self, batch: dict[str, torch.Tensor], micro_index: int) -> dict[str, torch.Tensor]:
        """The pipeline's transform_batch under generators seeded from (seed, epoch, step, rank,
        micro-batch): new every epoch, the same after a resume; the run's own streams untouched."""
        if not overrides(self.pipeline, "transform_batch"):
            return batch
        seed = int(np.random.SeedSequence([self.cfg.seed, _CONTEXT.epoch, self.step_index, self.runtime.world_rank, micro_index]).generate_state(1)[0])
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

    def sync(self, stop_requested: bool = False) -> tuple[float, int, bool]:
        """One collective at the logging cadence (every rank calls it at the same steps): the
        sample-weighted mean training loss over all ranks since the last call, the samples it
        covers, and whether any rank was asked to stop. A NaN/inf loss on any rank since the
        last call ends the run here (TrainingDiverged), before its weights are saved."""
        self.heartbeat.mark(self.step_index, "all_reduce")
        world, rank = self.runtime.world_size, self.runtime.world_rank
        first_bad = [math.inf] * world
        first_bad[rank] = float(self.first_bad_step.item())
        # Sum-reduce: each rank fills only its own slot of the first-bad-step vector (others 0).
        slots = [value if index == rank else 0.0 for index, value in enumerate(first_bad)]
        totals = self.runtime.all_reduce_sum([float(self.loss_sum.item()), float(self.loss_count), float(stop_requested), *slots])
        total, count, stop, bad_steps = totals[0], int(totals[1]), totals[2] > 0, totals[3:]
        self.loss_sum.zero_()
        self.loss_count = 0
        diverged = {r: int(step) for r, step in enumerate(bad_steps) if math.isfinite(step)}
        if diverged:
            raise TrainingDiverged(self.divergence_message(diverged))
        self.first_bad_step.fill_(math.inf)
        return (total / count if count else float("nan")), count, stop

    def divergence_message(self, diverged: dict[int, int]) -> str:
        step = min(diverged.values())
        ranks = ", ".join(str(r) for r, s in sorted(diverged.items()) if s == step)
        good = ckpt.latest_complete(Path(self.runtime_run_dir)) if self.runtime_run_dir else None
        precision = (
            " or train in bf16 or fp32 instead of fp16 (--precision)" if self.cfg.precision == "fp16" else
            " or use --precision fp32" if self.cfg.precision == "bf16" else ""
        )  # fmt: skip
        return (
            f"The training loss became NaN or inf at step {step} on rank {ranks}; the run stopped at step {self.step_index + 1} "
            f"and saved nothing from these weights. Last good checkpoint: {good or 'none yet'}. Lower the learning rate "
            f"(--lr, now {sci(self.cfg.lr)}, peak {sci(self.peak_lr)}; or a longer --warmup-epochs){precision}, "
            "then --resume continues from that checkpoint"
        )

    def metrics_row(self, position: Position, *, loss: float, samples_per_s: float, extra: dict | None = None) -> dict:
        return {
            "epoch": position.epoch if position.epoch_offset == 0 else position.epoch + 1,
            "step": position.step,
            "samples_seen": position.samples_seen,
            "world_size": self.runtime.world_size,
            "global_batch_size": self.batch_plan.global_batch_size,
            "lr": self.lr_at(position.samples_seen),
            "loss": loss,
            "samples_per_s": samples_per_s,
            "time_s": time.time(),
            **(extra or {}),
        }

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


def train_epoch(trainer: StepRunner, source: Table | Stream, position: Position, cfg: TrainConfig, files: "RunFiles") -> tuple[float, bool]:
    """Train the rest of the current epoch: (its mean training loss over all ranks, whether
    the run was asked to stop — then a checkpoint at the current step has been reported)."""
    data = source.epoch(cfg.seed, position.epoch, position.epoch_offset, trainer.runtime.world_rank, trainer.runtime.world_size)
    steps = rules.epoch_steps(len(source), trainer.batch_plan.global_batch_size, position.epoch_offset)
    trainer.model.train()
    epoch_loss_sum, epoch_count, stop = 0.0, 0, False
    for step in steps:
        tick = time.perf_counter()
        _update_context(trainer, position)
        steady = step.index >= cfg.timing_warmup_steps
        timer = position.timer(enabled=steady, sync=trainer.sync_device)
        trainer.step_index = position.step
        trainer.optimizer_step(data, step, position.samples_seen, timer)
        position.step += 1
        position.samples_seen += step.size
        position.epoch_offset = step.end
        if steady:
            position.steady_steps += 1
            position.steady_samples += step.size
            position.steady_time_s += time.perf_counter() - tick
        last = step is steps[-1]
        files.live(trainer, position, len(source))
        checkpoint_now = bool(cfg.checkpoint_every_steps) and position.step % cfg.checkpoint_every_steps == 0 and not last
        if position.step % cfg.log_every_steps == 0 or last or checkpoint_now:
            # Every checkpoint follows a sync: weights are saved only after their loss was seen finite.
            loss, count, stop = trainer.sync(stop_requested=files.stop_requested())
            epoch_loss_sum += loss * count
            epoch_count += count
            if not last:
                files.metrics(trainer.metrics_row(position, loss=loss, samples_per_s=_throughput(trainer, position)))
            if stop and not last:
                report_checkpoint(trainer, position)
                return float("nan"), True
        if checkpoint_now:
            report_checkpoint(trainer, position)
    if cfg.skip_nan_rows and isinstance(data, StreamEpoch):  # a collective: every rank, at the epoch's end
        skipped = int(trainer.runtime.all_reduce_sum([float(data.skipped_rows)])[0])
        if skipped:
            files.event("data", f"epoch {position.epoch + 1}: skipped {skipped:,} row(s) holding NaN or inf (--skip-nan-rows)")
    return (epoch_loss_sum / epoch_count if epoch_count else float("nan")), stop


def report_checkpoint(trainer: StepRunner, position: Position) -> None:
    """A mid-epoch checkpoint at the current step (a barrier on every rank)."""
    trainer.heartbeat.mark(position.step, "report")
    row = trainer.metrics_row(position, loss=float("nan"), samples_per_s=0.0)
    trainer.runtime.report(row, trainer.state(position), ckpt.save_state, trainer.runtime_run_dir)


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
    for n, batch in source.eval_batches(runtime.world_rank, runtime.world_size, batch_size, runtime.device):
        loss, metrics = trainer.compute_loss(batch)
        for name, value in {"loss": loss, **metrics}.items():
            sums[name] = sums.get(name, 0.0) + float(value) * n
        count += n
    names = sorted(sums)
    totals = runtime.all_reduce_sum([sums[name] for name in names] + [float(count)])
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


# -- run files (rank 0) ------------------------------------------------------------------


class RunFiles:
    """The run directory's files written from the workers: by rank 0 only, strict JSON,
    and any OSError as one StorageError naming the path and errno (not retried)."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self.last_live = 0.0
        self.live_mark: tuple[float, int] | None = None

    def _append(self, name: str, record: dict) -> None:
        if self.enabled:
            rundir.append_jsonl(self.run_dir / name, record)

    def event(self, kind: str, message: str, **fields: Any) -> None:
        self._append("events.jsonl", {"time": time.time(), "kind": kind, "message": message, **fields})

    def metrics(self, row: dict) -> None:
        self._append("metrics.jsonl", row)

    def stop_requested(self) -> bool:
        """The driver asks the run to stop (SIGINT/SIGTERM) with a file; rank 0 looks, and the
        next sync tells every rank."""
        return self.enabled and (self.run_dir / rundir.STOP_FILE).exists()

    def clear_staging(self) -> None:
        """Checkpoints half-written by an attempt that died: never published, so removed."""
        if self.enabled:
            shutil.rmtree(ckpt.staging_dir(self.run_dir), ignore_errors=True)

    def live(self, trainer: "StepRunner", position: Position, epoch_rows: int) -> None:
        """About once a second, where rank 0 is in the epoch (for the driver's progress bar).
        Rank 0's own running loss: no collective, so it costs the other ranks nothing."""
        now = time.time()
        if not self.enabled or now - self.last_live < LIVE_INTERVAL_S:
            return
        previous, self.live_mark = self.live_mark, (now, position.samples_seen)
        rate = (position.samples_seen - previous[1]) / (now - previous[0]) if previous and now > previous[0] else None
        self.last_live = now
        count = trainer.loss_count
        self._append("live.jsonl", {
            "time": now,
            "epoch": position.epoch + 1,
            "step": position.step,
            "samples_seen": position.samples_seen,
            "epoch_rows": epoch_rows,
            "global_batch_size": trainer.batch_plan.global_batch_size,
            "world_size": trainer.runtime.world_size,
            "loss": float(trainer.loss_sum.item()) / count if count else None,
            "samples_per_s": rate,
        })

    def start_attempt(self, position: Position, state: dict | None, trainer: StepRunner, cfg: TrainConfig) -> None:
        """The plan, or on a restart, resize or resume the line saying where training continues
        and with what plan and rate (the rules' rate for this worker count and batch)."""
        if not self.enabled:
            return
        # Rows written after the checkpoint we resume from describe training that is
        # about to be redone: drop them so the curve continues from the checkpoint.
        _truncate_metrics(self.run_dir / "metrics.jsonl", position.step)
        plan_text = describe_plan(trainer, cfg)
        if state is None:
            self.event("plan", plan_text, world_size=trainer.runtime.world_size)
            return
        previous = position.world_sizes[-1] if position.world_sizes else trainer.runtime.world_size
        lr_now, lr_before = trainer.lr_at(position.samples_seen), state.get("lr", float("nan"))
        lr_change = "unchanged" if abs(lr_now - lr_before) <= 1e-9 * max(1e-12, abs(lr_before)) else f"(was {sci(lr_before)})"
        where = f"step {position.step} (epoch {position.epoch + 1}, {position.epoch_offset:,} samples into it)"
        plan = f"{plan_text}; lr now {sci(lr_now)} {lr_change}"
        if previous != trainer.runtime.world_size:
            message = f"Resized {previous} → {trainer.runtime.world_size} workers at {where}: {plan}"
            self.event("resize", message, world_size=trainer.runtime.world_size, previous_world_size=previous, step=position.step)
        else:
            message = f"Restarted from the checkpoint at {where} with {trainer.runtime.world_size} workers: {plan}"
            self.event("restore", message, world_size=trainer.runtime.world_size, step=position.step)

    def data_notes(self, data: Table | Stream, world_size: int) -> None:
        """Say what the data costs the run: rows skipped in memory, and stream partitions
        that cannot keep every worker equally busy."""
        if not self.enabled:
            return
        if isinstance(data, Table) and data.dropped_rows:
            self.event("data", f"dataset 'train': skipped {data.dropped_rows:,} row(s) holding NaN or inf (--skip-nan-rows); {len(data):,} left")
        if not isinstance(data, Stream) or world_size == 1:
            return
        lanes = data.layout.lanes
        if lanes < world_size:
            self.event("data", (
                f"dataset 'train' has {lanes} partition(s) for {world_size} workers: {world_size - lanes} worker(s) get no rows "
                f"and wait for the others; give it more files or row groups (raytrain data), or raise --data-partitions"
            ))  # fmt: skip
        elif lanes % world_size:
            self.event("data", (
                f"dataset 'train': {lanes} partitions over {world_size} workers leave some with one partition more, "
                "and the busiest sets the pace; a worker count that divides --data-partitions keeps them even"
            ))  # fmt: skip

    def epoch_end(self, row: dict, epochs: int) -> None:
        self.metrics({**row, "epoch_end": True})
        parts = [f"epoch {row['epoch']}/{epochs}", f"loss {row['loss']:.4f}"]
        parts += [f"{key} {value:.4f}" for key, value in row.items() if key.startswith("val_")]
        parts += [f"lr {row['lr']:.2e}", f"{row['samples_per_s']:,.0f} samples/s"]
        self.event("epoch", "  ".join(parts), epoch=row["epoch"])

    def finish(self, trainer: StepRunner, position: Position) -> None:
        if not self.enabled:
            return
        with rundir.storage_errors(self.run_dir / ckpt.MODEL_FILE, "write the final model"):
            tmp = self.run_dir / f".{ckpt.MODEL_FILE}.tmp"
            ckpt.save_torch(ckpt.model_state(trainer.model), tmp)
            tmp.replace(self.run_dir / ckpt.MODEL_FILE)
        self._progress(position, status="finished")
        self.event("done", f"finished {position.epoch} epochs, {position.step} steps", step=position.step)

    def interrupted(self, position: Position) -> None:
        """Stopped on request after a checkpoint at this step: no final model, resumable."""
        if self.enabled:
            self._progress(position, status="interrupted")
            self.event("interrupted", f"stopped at step {position.step} with a checkpoint there", step=position.step)

    def _progress(self, position: Position, status: str) -> None:
        steady = position.steady_samples / position.steady_time_s if position.steady_time_s else None
        record = {**dataclasses.asdict(position), "steady_samples_per_s": steady, "status": status, "time": time.time()}
        rundir.write_json(self.run_dir / "progress.json", record)


def sci(value: float) -> str:
    """2.0e-3, not 2.0e-03."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def describe_plan(trainer: StepRunner, cfg: TrainConfig) -> str:
    """`global 64 = 2 workers × 32 per worker × 1 accumulation step; lr 2.0e-3 = 1.0e-3 × 2 (linear rule, ...)`."""
    plan = trainer.batch_plan
    factor = trainer.peak_lr / cfg.lr
    rule = {"linear": "linear rule", "sqrt": "square-root rule", "none": "no scaling"}[cfg.lr_scaling]
    warmup = f"warmup {cfg.warmup_epochs:g} epoch{'s' if cfg.warmup_epochs != 1 else ''}"
    if cfg.warmup_epochs and cfg.warmup_start_factor is not None:
        warmup += f" from {sci(trainer.schedule.warmup_start_lr)}"
    schedule = "own lr_factor" if overrides(trainer.pipeline, "lr_factor") else cfg.schedule
    if cfg.schedule == "step" and schedule == "step":
        schedule += f" ×{cfg.lr_gamma:g} at epochs {', '.join(f'{m:g}' for m in cfg.lr_milestones or [])}"
    optimizer = "own optimizer" if overrides(trainer.pipeline, "build_optimizer") else cfg.optimizer
    return (
        f"{plan.describe()}; lr {sci(trainer.peak_lr)} = {sci(cfg.lr)} × {factor:.3g} "
        f"({rule}, reference batch {cfg.reference_batch_size}); {warmup}; {schedule}; {optimizer}; {trainer.runtime.backend}"
    )


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


def _throughput(trainer: StepRunner, position: Position) -> float:
    now = time.perf_counter()
    rate = (position.samples_seen - trainer.last_log_samples) / max(1e-9, now - trainer.last_log_time)
    trainer.last_log_time, trainer.last_log_samples = now, position.samples_seen
    return rate


def _append_if_new(sizes: list[int], size: int) -> list[int]:
    return sizes if sizes and sizes[-1] == size else [*sizes, size]


def _truncate_metrics(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    kept = [row for row in rundir.read_jsonl(path) if row.get("step", 0) <= last_step]
    rundir.write_atomic(path, "".join(rundir.dumps(row) + "\n" for row in kept))
