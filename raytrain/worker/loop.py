"""The per-worker training function: restore → build → loop → report.

Ray Train calls `train_loop_per_worker` once per attempt: at the start, after every
failure and after every resize. Resume is the only way in: a fresh run is "no
checkpoint". The batch plan and the learning rate are re-derived from the rules
(`raytrain.rules`) at every attempt, for the world size this attempt has.

A step's mechanics are `raytrain.worker.step`, an epoch's `raytrain.worker.epoch`, what a
checkpoint holds `raytrain.worker.state`, and per-step fault tolerance's replica
`raytrain.worker.replicas`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.draws import Draws
from raytrain.data.sources import Source, data_digest, open_source
from raytrain.data.stream import Stream
from raytrain.data.table import Table
from raytrain.errors import find_user_error
from raytrain.pipeline import Pipeline, overrides
from raytrain.rules import resume
from raytrain.rules.attempt import Attempt
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.budget import Budget
from raytrain.rules.position import Position
from raytrain.rundir.checkpoints import node_dir, resume_choice
from raytrain.rundir.records import HEARTBEATS, Kind
from raytrain.rundir.storage import Store
from raytrain.rundir.writer import RunWriter
from raytrain.worker.epoch import (
    EpochResult,
    append_if_new,
    end_at_step_budget,
    end_epoch,
    train_epoch,
    train_epoch_per_step,
)
from raytrain.worker.heartbeat import Heartbeat, diagnose, looks_like_timeout, read_heartbeats
from raytrain.worker.optim import describe_optimizer
from raytrain.worker.replicas import JOIN_TIMEOUT_S, ReplicaRuntime
from raytrain.worker.runtime import Runtime
from raytrain.worker.state import unwrap
from raytrain.worker.step import StepRunner


@dataclass(frozen=True)
class WorkerPayload:
    """What the driver hands every worker (Ray Train's `train_loop_config`, under `PAYLOAD`)."""

    config: TrainConfig
    pipeline: Pipeline
    run_dir: Store  # a local directory or an object store's prefix
    sources: dict[str, Source]  # "train", optional "val"


PAYLOAD = "raytrain"
# When a run ends on the user's error, how long a rank waits for its checkpoint being written.
FINISH_ON_ERROR_S = 60.0


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    payload: WorkerPayload = loop_config[PAYLOAD]
    cfg, run_dir = payload.config, Store.of(payload.run_dir)
    per_step = cfg.fault_tolerance == "per-step"
    runtime = ReplicaRuntime(cfg.collective_timeout_s, cfg.num_checkpoints_to_keep, run_dir) if per_step else Runtime()
    files = RunWriter(run_dir, enabled=runtime.is_rank0)
    heartbeat = Heartbeat(heartbeat_dir(run_dir), runtime.world_rank, enabled=runtime.world_size > 1)
    if not per_step:  # a replacement replica must not clear what the live quorum is writing
        files.clear_staging()
    try:
        (run_replica if per_step else run_attempt)(cfg, payload.pipeline, runtime, files, heartbeat, payload.sources)
    except Exception as exc:
        if runtime.world_size > 1 and looks_like_timeout(exc):
            raise StallError(explain_stall(cfg, runtime, heartbeat, run_dir, exc)) from exc
        if find_user_error(exc) is not None:
            # The run ends here (the user's to fix, never retried): the checkpoint being written
            # holds a good step, so let it complete, and --resume loses nothing more.
            with contextlib.suppress(Exception):
                runtime.finish_checkpoints(timeout_s=FINISH_ON_ERROR_S)
        raise
    finally:
        heartbeat.stop()
        files.close()
        if per_step:
            runtime.shutdown()


def heartbeat_dir(run_dir: Store) -> Path:
    """Where the ranks' heartbeats go: the run directory on a shared file system (a timed-out
    rank reads every rank's); on an object store, each node's own directory (node-local: a
    timed-out rank sees only the ranks of its node)."""
    return run_dir.path / HEARTBEATS if run_dir.local else node_dir(run_dir) / HEARTBEATS


class Begun(NamedTuple):
    """An attempt restored and built."""

    saved: dict[str, Any] | None  # the checkpoint's state (None: a fresh start)
    position: Position
    attempt: Attempt
    train_data: Table | Stream | Draws
    val_data: Table | Stream | Draws | None
    runner: StepRunner


def begin(
    cfg: TrainConfig,
    pipeline: Pipeline,
    runtime: Runtime,
    files: RunWriter,
    heartbeat: Heartbeat,
    sources: dict[str, Source],
    workers: int,
) -> Begun:
    """Build for `workers` workers, then restore: the furthest checkpoint that loads."""
    heartbeat.mark(0, "data")
    train_data = open_source("train", sources["train"], runtime.get_object, cfg.skip_nan_rows)
    val_data = open_source("val", sources["val"], runtime.get_object, cfg.skip_nan_rows) if "val" in sources else None
    plan = batch_plan_for(cfg, workers)
    runner = StepRunner.build(pipeline, cfg, runtime, heartbeat, files.store, plan, len(train_data))
    saved = runner.restore(resume_choice(files.store, also=runtime.latest_checkpoint()), files)
    position = Position.restored(saved)
    attempt = Attempt.of(saved is not None, position.world_sizes, workers)
    now = data_digest(train_data)
    resume.check_same_data(position.data, now, position.step, mid_epoch=bool(position.epoch_offset))
    position.data = now
    return Begun(saved, position, attempt, train_data, val_data, runner)


def run_attempt(
    cfg: TrainConfig,
    pipeline: Pipeline,
    runtime: Runtime,
    files: RunWriter,
    heartbeat: Heartbeat,
    sources: dict[str, Source],
) -> None:
    """One attempt of a run that restarts its worker group on a failure."""
    # restore, build
    saved, position, attempt, train_data, val_data, runner = begin(
        cfg, pipeline, runtime, files, heartbeat, sources, runtime.world_size
    )
    announce(files, attempt, runner, position, saved, train_data)
    position.world_sizes = append_if_new(position.world_sizes, runtime.world_size)

    # loop, report
    def one_epoch(runner: StepRunner) -> tuple[EpochResult, StepRunner]:
        return train_epoch(runner, train_data, position, files, val_data), runner

    run_epochs(runner, len(train_data), val_data, position, files, one_epoch)


def run_replica(
    cfg: TrainConfig,
    pipeline: Pipeline,
    runtime: ReplicaRuntime,
    files: RunWriter,
    heartbeat: Heartbeat,
    sources: dict[str, Source],
) -> None:
    """One replica of a per-step run (raytrain.worker.replicas): restore, build, then steps over
    the quorum of live replicas; a replacement heals from a live peer at its first step."""
    # restore, build, join
    if files.rundir.finished(Budget.of(cfg)):
        return  # a replacement that came up after the others finished the run: nothing to join
    if runtime.starts_with_group:  # heartbeating while it restores: the first quorum waits for it
        runtime.start_manager()
    saved, position, attempt, train_data, val_data, runner = begin(
        cfg, pipeline, runtime, files, heartbeat, sources, runtime.replica_count
    )
    state = runner.training_state(position)
    model = runtime.join(runner.model, state.live, state.load_live)
    runner = dataclasses.replace(runner, model=model)
    not_waited = runtime.wait_for_group()  # every replica restored and heartbeating, or why not

    def first_quorum() -> None:  # a replacement says nothing of its own: the quorum's line does
        announce(files, attempt, runner, position, saved, train_data)
        if runtime.starts_with_group and runtime.quorum.size < runtime.replica_count:
            files.event(Kind.QUORUM, partial_start_line(runtime, not_waited), world_size=runtime.quorum.size)

    # loop, report: the attempt is announced at its first quorum
    pending = [first_quorum]

    def one_epoch(runner: StepRunner) -> tuple[EpochResult, StepRunner]:
        first = pending.pop() if pending else None
        return train_epoch_per_step(
            runner, train_data, position, files, runtime, on_first_quorum=first, val_data=val_data
        )

    run_epochs(runner, len(train_data), val_data, position, files, one_epoch)


def partial_start_line(runtime: ReplicaRuntime, not_waited: str | None) -> str:
    """Why replicas that started together do not all take the first step."""
    why = (
        f"the others could not wait for them ({not_waited})"
        if not_waited
        else f"they were not ready within the lighthouse's {JOIN_TIMEOUT_S:g} s join wait"
    )
    return (
        f"Training starts with {runtime.quorum.size} of {runtime.replica_count} replicas: {why}; "
        "the others join when ready, healed from a live peer"
    )


def run_epochs(
    runner: StepRunner,
    num_train_rows: int,
    val_data: Table | Stream | Draws | None,
    position: Position,
    files: RunWriter,
    train_one: Callable[[StepRunner], tuple[EpochResult, StepRunner]],
) -> None:
    """Epochs to the budget's end — the last epoch, or the last step of --max-steps, mid-epoch if
    need be (`train_one(runner)` trains the rest of an epoch, or up to that step: its result and
    the runner to go on with) — or to a stop request; then the final model, or the mark of a stop."""
    budget = Budget.of(runner.cfg)
    while not budget.done(position.epoch, position.step):
        epoch, runner = train_one(runner)
        if epoch.finished_elsewhere:
            return
        if position.epoch_offset < num_train_rows:  # inside the epoch
            if budget.steps_done(position.step):  # the step budget's end: validated and checkpointed here
                end_at_step_budget(runner, val_data, position, files, epoch)
            break  # or asked to stop: checkpointed at this step
        end_epoch(runner, val_data, position, files, epoch)
        if epoch.stopped:
            break
    if not budget.done(position.epoch, position.step):
        files.interrupted(position.progress("interrupted"))
    else:
        weights = runner.training_state(position).weights()  # a collective under fsdp: every rank gathers
        files.finish(weights, position.progress("finished"))
    runner.runtime.finish_checkpoints()  # the last checkpoint's files, written in the background


def announce(
    files: RunWriter,
    attempt: Attempt,
    runner: StepRunner,
    position: Position,
    saved: dict | None,
    train_data: Table | Stream | Draws,
) -> None:
    """Rank 0 says what this attempt is (with the plan and rate it trains with, against the
    checkpoint's rate), and what the data costs the run."""
    lr_before = saved.get("lr", math.nan) if saved else math.nan
    world_size = runner.runtime.world_size
    lr_now = runner.lr_at(position.samples_seen)
    files.start_attempt(attempt.event(position, world_size, runner.describe_plan(), lr_now, lr_before), position.step)
    for note in data_notes(train_data, world_size):
        files.event(Kind.DATA, note)
    note = hooks.optimizer_note(unwrap(runner.model), runner.optimizer)
    if note:
        files.event(Kind.NOTE, note)
    if overrides(runner.pipeline, "build_optimizer"):  # config.yaml says what the pipeline's optimizer is
        details = {"build_optimizer": describe_optimizer(runner.optimizer)}
        files.update_config(resume.recorded_config(files.rundir.config(), ["build_optimizer"], details))


def data_notes(data: Table | Stream | Draws, world_size: int) -> list[str]:
    """What the data costs the run: rows skipped in memory, and stream partitions that cannot
    keep every worker equally busy."""
    notes = []
    if isinstance(data, Table) and data.dropped_rows:
        notes.append(
            f"dataset 'train': skipped {data.dropped_rows:,} row(s) holding NaN or inf (--skip-nan-rows); "
            f"{len(data):,} left"
        )
    if not isinstance(data, Stream) or world_size == 1:
        return notes
    lanes = data.layout.lanes
    if lanes < world_size:
        notes.append(
            f"dataset 'train' has {lanes} partition(s) for {world_size} workers: {world_size - lanes} worker(s) get "
            "no rows and wait for the others; give it more files or row groups (raytrain data), or raise "
            "--data-partitions"
        )
    elif lanes % world_size:
        notes.append(
            f"dataset 'train': {lanes} partitions over {world_size} workers leave some with one partition more, "
            "and the busiest sets the pace; a worker count that divides --data-partitions keeps them even"
        )
    return notes


class StallError(RuntimeError):
    """A collective timed out; the message names the stalled rank(s) and where each rank was."""


def explain_stall(cfg: TrainConfig, runtime: Runtime, heartbeat: Heartbeat, run_dir: Store, exc: Exception) -> str:
    heartbeat.write()
    records = read_heartbeats(heartbeat_dir(run_dir), runtime.world_size, since=heartbeat.attempt_start)
    cause = str(exc).splitlines()[0] if str(exc) else ""
    return (
        f"A collective timed out on rank {runtime.world_rank} after --collective-timeout-s "
        f"{cfg.collective_timeout_s:g}; "
        f"{diagnose(records, runtime.world_size, time.time())}\n  cause: {type(exc).__name__}: {cause}"
    )
