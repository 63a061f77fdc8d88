"""The per-worker training function: restore → build → loop → report.

Ray Train calls `train_loop_per_worker` once per attempt: at the start, after every
failure and after every resize. Resume is the only way in: a fresh run is "no
checkpoint". The batch plan and the learning rate are re-derived from the rules
(`raytrain.rules`) at every attempt, for the world size this attempt has.

`Training` owns one attempt: its recovery object (`raytrain.faults.restart`: the
fault-tolerance mode, and the runtime), run files, data, position, the step machinery
(`raytrain.worker.step`) and the checkpoints (`raytrain.worker.checkpointer`). Its one loop
runs epochs (`raytrain.worker.epoch`), whatever the mode.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.sources import Source, cost_notes, data_digest, open_source
from raytrain.errors import NOT_RETRIED, find_error, find_user_error
from raytrain.instruments.phases import SteadyClock
from raytrain.parallel.device import device_failure
from raytrain.pipeline import Pipeline, overrides
from raytrain.rules import resume
from raytrain.rules.attempt import Attempt
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.budget import Budget
from raytrain.rules.position import Position, progress
from raytrain.rules.stall import diagnose
from raytrain.rundir.heartbeats import Heartbeat, read_heartbeats
from raytrain.rundir.records import HEARTBEATS, Kind
from raytrain.rundir.storage import Store
from raytrain.rundir.writer import RunWriter
from raytrain.worker.checkpointer import Checkpointer
from raytrain.worker.epoch import Data, Epochs
from raytrain.worker.optim import describe_optimizer
from raytrain.worker.runtime import Runtime
from raytrain.worker.state import unwrap
from raytrain.worker.step import StepRunner, plan_line


@dataclass(frozen=True)
class WorkerPayload:
    """What the driver hands every worker (Ray Train's `train_loop_config`, under `PAYLOAD`)."""

    config: TrainConfig
    pipeline: Pipeline
    run_dir: Store  # a local directory or an object store's prefix
    sources: dict[str, Source]  # "train", optional "val"
    # The fault-tolerance mode's worker half (`raytrain.faults`): its recovery class, called
    # (cfg, run_dir, invocation=...) where the worker starts, as Ray passes `backend_cls`.
    recovery: Callable[..., Any]
    invocation: str = ""  # this run of the driver: an attempt that restores its own checkpoint follows a failure


PAYLOAD = "raytrain"
# When a run ends on the user's error, how long a rank waits for its checkpoint being written.
FINISH_ON_ERROR_S = 60.0


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    payload: WorkerPayload = loop_config[PAYLOAD]
    cfg, run_dir = payload.config, Store.of(payload.run_dir)
    recovery = payload.recovery(cfg, run_dir, invocation=payload.invocation)
    runtime = recovery.runtime
    files = RunWriter(run_dir, enabled=runtime.is_rank0, driver=payload.invocation)
    heartbeat = Heartbeat(run_dir.local_dir / HEARTBEATS, runtime.world_rank, enabled=runtime.world_size > 1)
    checkpointer = Checkpointer(cfg, recovery, run_dir, invocation=payload.invocation)
    try:
        files.driver.check()  # an attempt its ended driver's controller restarted: before it writes a file
        if recovery.open(files, Budget.of(cfg)):
            Training.begin(cfg, payload.pipeline, recovery, files, heartbeat, payload.sources, checkpointer).run()
    except Exception as exc:
        # A device's failure outside a step's phases (an assert shows at the host's next wait on
        # the GPU: the loss sync, a checkpoint's copy), as the user's too.
        failure = None if find_user_error(exc) else device_failure(exc, runtime.world_rank, "training", runtime.device)
        if failure is not None:
            raise failure from exc
        if runtime.world_size > 1 and looks_like_timeout(exc):
            raise StallError(explain_stall(cfg, runtime, heartbeat, run_dir, exc)) from exc
        if find_error(exc, NOT_RETRIED) is not None:
            # The run ends here (never retried): the checkpoint being written holds a good step
            # (it passed its replica check), so let it complete, and --resume loses nothing more.
            with contextlib.suppress(Exception):
                checkpointer.finish(timeout_s=FINISH_ON_ERROR_S)
        raise
    finally:
        heartbeat.stop()
        files.close()
        recovery.close()


@dataclass
class Training(Epochs):
    """One attempt of this worker: what it trains with and where it is. `run` is its one loop
    over epochs (`Epochs.train_epoch` over each one's steps); how a failure is recovered from
    is the recovery object's (`raytrain.faults.restart`)."""

    cfg: TrainConfig
    recovery: Any  # the mode's worker half (`raytrain.faults.restart.Recovery` or a subclass)
    files: RunWriter
    runner: StepRunner  # the model, optimizer and rules of the current quorum
    checkpointer: Checkpointer
    train_data: Data
    val_data: Data | None
    position: Position
    saved: dict[str, Any] | None = None  # the checkpoint's train state (None: a fresh start)
    attempt: Attempt | None = None
    announced: bool = False
    steady_clock: SteadyClock | None = None  # times the steady steps (on a GPU, by CUDA events)

    @property
    def runtime(self) -> Runtime:
        return self.recovery.runtime

    @classmethod
    def begin(
        cls,
        cfg: TrainConfig,
        pipeline: Pipeline,
        recovery: Any,
        files: RunWriter,
        heartbeat: Heartbeat,
        sources: dict[str, Source],
        checkpointer: Checkpointer,
    ) -> "Training":
        """Build for this attempt's workers (per-step: replicas), then restore: the furthest
        checkpoint that loads; then ready to step (`Recovery.after_restore`)."""
        runtime, workers = recovery.runtime, recovery.replica_count
        heartbeat.mark(0, "data")
        train_data = open_source("train", sources["train"], runtime.get_object, cfg.skip_nan_rows)
        val = sources.get("val")
        val_data = open_source("val", val, runtime.get_object, cfg.skip_nan_rows) if val is not None else None
        runner = StepRunner.build(pipeline, cfg, runtime, heartbeat, batch_plan_for(cfg, workers), len(train_data))
        training = cls(cfg, recovery, files, runner, checkpointer, train_data, val_data, Position())
        training.saved = saved = checkpointer.restore(training)
        training.position = position = Position.restored(saved)
        now = data_digest(train_data)
        resume.check_same_data(position.data, now, position.step, mid_epoch=bool(position.epoch_offset))
        position.data = now
        training.attempt = Attempt.of(saved is not None, position.world_sizes, workers)
        recovery.after_restore(training)
        return training

    def run(self) -> None:
        """Epochs to the budget's end — the last epoch, or the last step of --max-steps, mid-epoch
        if need be — or to a stop request; then the final model, or the mark of a stop."""
        budget, position = Budget.of(self.cfg), self.position
        while not budget.done(position.epoch, position.step):
            epoch = self.train_epoch()
            if epoch.finished_elsewhere:
                return
            if position.epoch_offset < len(self.train_data):  # inside the epoch
                if budget.steps_done(position.step):  # the step budget's end: validated and checkpointed here
                    self.end_at_step_budget(epoch)
                break  # or asked to stop: checkpointed at this step
            self.end_epoch(epoch)
            if epoch.stopped:
                break
        if not budget.done(position.epoch, position.step):
            self.files.interrupted(progress(position, self.runner.measures.telemetry, "interrupted"))
        else:
            weights = self.runner.training_state(position).weights()  # a collective under fsdp: every rank gathers
            self.files.finish(weights, progress(position, self.runner.measures.telemetry, "finished"))
        self.checkpointer.finish()  # the last checkpoint's files, written in the background

    def announce(self) -> None:
        """Rank 0 says what this attempt is (with the plan and rate it trains with, against the
        checkpoint's rate), and what the data costs the run."""
        files, runner, position, saved = self.files, self.runner, self.position, self.saved
        self.announced = True
        lr_before = saved.get("lr", math.nan) if saved else math.nan
        world_size = runner.runtime.world_size
        lr_now = runner.rate.at(position.samples_seen)
        event = self.attempt.event(position, world_size, plan_line(runner), lr_now, lr_before)
        files.start_attempt(event, position.step)
        for note in cost_notes(self.train_data, world_size):
            files.event(Kind.DATA, note)
        note = hooks.optimizer_note(unwrap(runner.model), runner.optimizer)
        if note:
            files.event(Kind.NOTE, note)
        if overrides(runner.pipeline, "build_optimizer"):  # config.yaml says what the pipeline's optimizer is
            details = {"build_optimizer": describe_optimizer(runner.optimizer)}
            files.update_config(resume.recorded_config(files.rundir.config(), ["build_optimizer"], details))


class StallError(RuntimeError):
    """A collective timed out; the message names the stalled rank(s) and where each rank was."""


def explain_stall(cfg: TrainConfig, runtime: Runtime, heartbeat: Heartbeat, run_dir: Store, exc: Exception) -> str:
    heartbeat.write()
    records = read_heartbeats(run_dir.local_dir / HEARTBEATS, runtime.world_size, since=heartbeat.attempt_start)
    cause = str(exc).splitlines()[0] if str(exc) else ""
    return (
        f"A collective timed out on rank {runtime.world_rank} after --collective-timeout-s "
        f"{cfg.collective_timeout_s:g}; "
        f"{diagnose(records, runtime.world_size, time.time())}\n  cause: {type(exc).__name__}: {cause}"
    )


def looks_like_timeout(exc: BaseException) -> bool:
    """A collective that gave up waiting (gloo's and NCCL's say so in words only: torch 2.13
    has no timeout type)."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "timeout" in text or "timed out" in text
