"""An epoch on one worker: its steps, what follows each step (the sync, the metrics row, the
checkpoint), and the epoch's end (validation, its row, the reported checkpoint).

Two ways through an epoch: `train_epoch` (every rank takes every step; a failure restarts
the worker group from the last checkpoint) and `train_epoch_per_step` (per-step fault
tolerance: the live replicas take each step together, `raytrain.worker.replicas`).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from raytrain.data.draws import Draws, DrawsEpoch
from raytrain.data.stream import Stream, StreamEpoch
from raytrain.data.table import Table, TableEpoch
from raytrain.rules import steps
from raytrain.rules.budget import Budget, evaluation_due, evaluation_rows
from raytrain.rules.position import Position
from raytrain.rundir import checkpoints
from raytrain.rundir.records import EPOCH_LOSS, Kind, MetricsRow
from raytrain.rundir.writer import RunWriter
from raytrain.text import sci
from raytrain.worker import prefetch
from raytrain.worker.replicas import ReplicaRuntime
from raytrain.worker.step import StepRunner, update_context
from raytrain.worker.window import EpochLoss, TrainingDiverged, divergence_message, sync

Data = Table | Stream | Draws  # a dataset on a worker
DIVERGED_CHECKPOINT_WAIT_S = 60.0  # how long a diverged rank waits for the checkpoint being written


class EpochResult(NamedTuple):
    loss: float  # the epoch's mean training loss over all ranks (so far, when the step budget ended it)
    samples_per_s: float
    stopped: bool  # the run was asked to stop: a checkpoint at the current step has been reported
    finished_elsewhere: bool = False  # per-step: a replacement found the others done with the run


def train_epoch(
    runner: StepRunner, source: Data, position: Position, files: RunWriter, val_data: Data | None = None
) -> EpochResult:
    """Train the rest of the current epoch: to its end, to the step budget (--max-steps), or to
    the step where the run was asked to stop."""
    cfg, start, samples_before = runner.cfg, time.perf_counter(), position.samples_seen
    rank, world = runner.runtime.world_rank, runner.runtime.world_size
    data = plain = source.epoch(cfg.seed, position.epoch, position.epoch_offset, rank, world)
    if prefetch.wanted(cfg.prefetch, runner.runtime.device):
        data = prefetch.Prefetched(plain, runner.runtime.device)
    epoch_steps = steps.epoch_steps(len(source), runner.batch_plan.global_batch_size, position.epoch_offset)
    budget = Budget.of(cfg)
    runner.model.train()
    epoch_loss, stop = epoch_loss_so_far(position), False
    for index, step in enumerate(epoch_steps):
        final = step is epoch_steps[-1] or budget.steps_done(position.step + 1)
        take_step(runner, data, step, position, ahead=None if final else epoch_steps[index + 1])
        last = step is epoch_steps[-1] or budget.steps_done(position.step)
        stop = after_step(runner, position, files, len(source), last, epoch_loss, val_data=val_data)
        if stop and not last:
            return EpochResult(math.nan, math.nan, stopped=True)
        if last:
            break
    if position.epoch_offset >= len(source):
        note_skipped_rows(runner, plain, position, files)
    samples_per_s = (position.samples_seen - samples_before) / max(1e-9, time.perf_counter() - start)
    return EpochResult(epoch_loss.mean(), samples_per_s, stop)


def epoch_loss_so_far(position: Position) -> EpochLoss:
    """The epoch's synced training loss so far, from the position (a restart mid-epoch keeps the
    part of the epoch trained before it)."""
    epoch, total, count = position.epoch_loss[:3]
    return EpochLoss(total, int(count)) if epoch == position.epoch else EpochLoss()


def train_epoch_per_step(
    runner: StepRunner,
    source: Data,
    position: Position,
    files: RunWriter,
    replicas: ReplicaRuntime,
    on_first_quorum: Callable[[], None] | None = None,
    val_data: Data | None = None,
) -> tuple[EpochResult, StepRunner]:
    """Train the rest of the current epoch one step at a time over the quorum of live replicas.

    Each step: the quorum (a joining replica heals here, position included); on a new quorum
    the batch plan and rate follow its size and the rows from the current offset are split
    over its members; forward and backward; then the step is applied only if every member
    commits it. An uncommitted step is taken again from the same offset, so a committed step
    is the only one that counts its rows: every row once per epoch. Returns the epoch's
    result and the runner of the last quorum."""
    cfg, start, samples_before = runner.cfg, time.perf_counter(), position.samples_seen
    runner.model.train()
    data, split, taken, stop = None, None, 0, False
    while position.epoch_offset < len(source) and not Budget.of(cfg).steps_done(position.step):
        quorum = replicas.start_step(position.step)
        files.enabled = replicas.is_rank0
        if replicas.healed:  # the position (and the epoch's loss so far) came from a live peer
            start, samples_before = time.perf_counter(), position.samples_seen
        if position.epoch_loss[0] != position.epoch:
            position.epoch_loss = [float(position.epoch), 0.0, 0.0]
        if on_first_quorum is not None:
            # Alone in its first quorum after the others wrote the end: a replacement too late to join.
            if quorum.size == 1 < replicas.replica_count and files.rundir.finished(Budget.of(cfg)):
                return EpochResult(math.nan, math.nan, stopped=False, finished_elsewhere=True), runner
            if not replicas.healed:  # a replacement says nothing of its own: the quorum's line does
                on_first_quorum()
            on_first_quorum = None
        if quorum != split:
            runner = follow_quorum(runner, quorum.size, position, files, len(source))
            split, data = quorum, None
        if data is None:  # a new split, or the rows of an uncommitted step to read again
            data = source.epoch(cfg.seed, position.epoch, position.epoch_offset, quorum.rank, quorum.size)
        step = steps.next_step(len(source), runner.batch_plan.global_batch_size, position.epoch_offset, index=taken)
        update_context(runner, position)
        tick, steady = time.perf_counter(), step.index >= cfg.timing_warmup_steps
        phase, window = runner.phases(position, timed=steady), runner.window.snapshot()
        runner.gradients(data, step, position, phase)
        if not replicas.commit():  # a member failed inside the step: nothing of it is applied
            runner.optimizer.zero_grad(set_to_none=True)
            runner.window.restore(window)
            data = None
            continue
        runner.apply_gradients(position, phase)
        advance(position, step, steady, time.perf_counter() - tick)
        taken += 1
        last = position.epoch_offset >= len(source) or Budget.of(cfg).steps_done(position.step)
        epoch_loss = EpochLoss(position.epoch_loss[1], int(position.epoch_loss[2]))
        stop = after_step(
            runner, position, files, len(source), last, epoch_loss, every_replica_looks=True, val_data=val_data
        )
        position.epoch_loss[1:] = [epoch_loss.total, float(epoch_loss.count)]
        if stop and not last:
            return EpochResult(math.nan, math.nan, stopped=True), runner
    samples_per_s = (position.samples_seen - samples_before) / max(1e-9, time.perf_counter() - start)
    total, count = position.epoch_loss[1], position.epoch_loss[2]
    return EpochResult(total / count if count else math.nan, samples_per_s, stop), runner


def follow_quorum(
    runner: StepRunner, size: int, position: Position, files: RunWriter, num_train_rows: int
) -> StepRunner:
    """The runner for a quorum of `size` replicas (its batch plan and rate), and one event line
    when the size differs from the one the run last trained with (the position says it, the
    same on every member, a healed one included)."""
    if size != runner.batch_plan.world_size:
        runner = runner.for_quorum(size, num_train_rows)
    previous = position.world_sizes[-1] if position.world_sizes else size
    if size != previous:
        line = quorum_line(runner, position, previous)
        files.event(Kind.QUORUM, line, world_size=size, previous_world_size=previous, step=position.step)
    position.world_sizes = append_if_new(position.world_sizes, size)
    return runner


def quorum_line(runner: StepRunner, position: Position, previous: int) -> str:
    """`Quorum 3 → 2 replicas at step 40 (epoch 1, 1,280 samples into it): <plan>; lr now …`."""
    now = runner.runtime.world_size
    why = "a replica was lost; the survivors go on" if now < previous else "a replica rejoined, healed from a live peer"
    return (
        f"Quorum {previous} → {now} replicas at step {position.step} (epoch {position.epoch + 1}, "
        f"{position.epoch_offset:,} samples into it; {why}): {runner.describe_plan()}; "
        f"lr now {sci(runner.lr_at(position.samples_seen))}"
    )


def append_if_new(sizes: list[int], size: int) -> list[int]:
    return sizes if sizes and sizes[-1] == size else [*sizes, size]


def advance(position: Position, step: steps.Step, steady: bool, seconds: float) -> None:
    """The position after `step` (a timed step adds to the steady throughput)."""
    position.step += 1
    position.samples_seen += step.size
    position.epoch_offset = step.end
    if steady:
        position.steady_steps += 1
        position.steady_samples += step.size
        position.steady_time_s += seconds


def take_step(
    runner: StepRunner,
    data: TableEpoch | StreamEpoch | DrawsEpoch | prefetch.Prefetched,
    step: steps.Step,
    position: Position,
    ahead: steps.Step | None = None,
) -> None:
    """One optimizer step, and the position after it; steps past --timing-warmup-steps are timed.
    With prefetching data, the batch of `ahead` (the next step) is staged once this step's work
    is queued, inside the step's time."""
    tick = time.perf_counter()
    update_context(runner, position)
    steady = step.index >= runner.cfg.timing_warmup_steps
    runner.optimizer_step(data, step, position, timed=steady)
    if ahead is not None and isinstance(data, prefetch.Prefetched):
        data.stage(ahead, runner.batch_plan.accumulation_steps)
    advance(position, step, steady, time.perf_counter() - tick)


def after_step(
    runner: StepRunner,
    position: Position,
    files: RunWriter,
    epoch_rows: int,
    last: bool,
    epoch_loss: EpochLoss,
    every_replica_looks: bool = False,
    val_data: Data | None = None,
) -> bool:
    """After a step: rank 0's live row; at the logging cadence the sync (loss, stop request)
    and a metrics row (with a bounded validation pass every --eval-every-steps); a checkpoint
    when one is due, or when the run is asked to stop mid-epoch. `last`: the epoch's last step,
    or the step budget's, whose row and checkpoint the caller writes. Returns whether it was
    asked to stop. `every_replica_looks` (per-step mode): each replica reads the stop request
    itself rather than trusting the sync to carry it."""
    cfg, stop = runner.cfg, False
    if runner.memory is not None and not runner.memory_said:
        say_memory(runner, files)
    report_live(files, runner, position, epoch_rows)
    checkpoint_now = bool(cfg.checkpoint_every_steps) and position.step % cfg.checkpoint_every_steps == 0 and not last
    evaluate_now = val_data is not None and evaluation_due(position.step, cfg.eval_every_steps, last)
    if position.step % cfg.log_every_steps == 0 or last or checkpoint_now or evaluate_now:
        # Every checkpoint follows a sync: weights are saved only after their loss was seen finite.
        asked = files.stop_requested(anyone=every_replica_looks)
        loss, count, stop = sync_ranks(runner, position, stop_requested=asked)
        stop = stop or asked
        if count:
            epoch_loss.add(loss, count)
            position.epoch_loss = [float(position.epoch), epoch_loss.total, float(epoch_loss.count)]
            position.last_loss = loss
        if not last:
            rate = runner.throughput.lap(position.samples_seen)
            validation = evaluate_during(runner, val_data, position) if evaluate_now else {}
            row = runner.metrics_row(position, loss=loss, samples_per_s=rate, extra=validation)
            files.metrics(row)
            if evaluate_now:
                files.evaluation(row)
        if stop and not last:
            report_checkpoint(runner, position)
            return True
    if checkpoint_now:
        report_checkpoint(runner, position)
    return stop


def say_memory(runner: StepRunner, files: RunWriter) -> None:
    """Once per attempt, after its first step (a collective): the bytes each worker holds of the
    parameters, their gradients and the optimizer's state, and each process's peak RSS."""
    import psutil

    runner.memory_said = True
    mine = {**(runner.memory or {}), "peak_rss": _peak_rss_bytes(psutil.Process())}
    every = runner.runtime.all_gather_object(mine)
    sharded = runner.prepared is not None and runner.prepared.sharded
    held = ", ".join(
        f"{_mib(mine[k])} {label}"
        for k, label in (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"))
    )
    rss = ", ".join(_mib(rank["peak_rss"]) for rank in every)
    files.event(
        Kind.MEMORY,
        f"memory per worker after the first step: {held}{' (its shards)' if sharded else ''}; peak RSS by rank: {rss}",
        **{key: [rank.get(key, 0) for rank in every] for key in mine},
    )


def _peak_rss_bytes(process) -> int:
    import resource

    return max(process.memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def sync_ranks(runner: StepRunner, position: Position, stop_requested: bool = False) -> tuple[float, int, bool]:
    """The sync (`raytrain.worker.window.sync`): the mean loss since the last one, the samples
    it covers and whether to stop. A NaN/inf loss on any rank ends the run here
    (TrainingDiverged), before its weights are saved."""
    loss, count, stop, diverged = sync(runner.runtime, runner.heartbeat, runner.window, position.step, stop_requested)
    if diverged:
        # The last good checkpoint may still be being written in the background: finish it first, so that the
        # message names it (the run ends here either way).
        with contextlib.suppress(Exception):
            runner.runtime.finish_checkpoints(timeout_s=DIVERGED_CHECKPOINT_WAIT_S)
        last_good = checkpoints.latest_complete(runner.run_dir) if runner.run_dir else None
        raise TrainingDiverged(
            divergence_message(
                diverged,
                stopped_at=position.step,
                lr=runner.cfg.lr,
                peak_lr=runner.peak_lr,
                precision=runner.cfg.precision,
                last_good=str(last_good) if last_good else None,
            )
        )
    return loss, count, stop


def end_epoch(
    runner: StepRunner, val_data: Data | None, position: Position, files: RunWriter, epoch: EpochResult
) -> None:
    """Validate, write the epoch's row and report it with a checkpoint."""
    val_metrics = validate(runner, val_data, position)
    position.epoch, position.epoch_offset = position.epoch + 1, 0
    row = closing_row(runner, position, epoch, val_metrics)
    files.epoch_end(row, runner.cfg.epochs)
    report_with_checkpoint(runner, position, row.to_json())


def end_at_step_budget(
    runner: StepRunner, val_data: Data | None, position: Position, files: RunWriter, epoch: EpochResult
) -> None:
    """The step budget (--max-steps) ran out inside an epoch: validate, write the run's last row
    and report it with a checkpoint at this step."""
    row = closing_row(runner, position, epoch, validate(runner, val_data, position))
    files.metrics(row)
    files.evaluation(row, final=True)
    report_with_checkpoint(runner, position, row.to_json())


def closing_row(runner: StepRunner, position: Position, epoch: EpochResult, val_metrics: dict) -> MetricsRow:
    """The row that closes an epoch (or the run, inside one): its `loss` is the last window's, as
    every row's is; `epoch_loss` is the epoch's mean (so far)."""
    last = math.nan if position.last_loss is None else position.last_loss
    return runner.metrics_row(
        position, loss=last, samples_per_s=epoch.samples_per_s, extra={EPOCH_LOSS: epoch.loss, **val_metrics}
    )


def validate(runner: StepRunner, val_data: Data | None, position: Position) -> dict[str, float]:
    """A validation pass (none without a validation set)."""
    runner.heartbeat.mark(position.step, "eval")
    return evaluate(runner, val_data) if val_data is not None else {}


def evaluate_during(runner: StepRunner, val_data: Data, position: Position) -> dict[str, float]:
    """A validation pass between two steps; its time is left out of the training throughput."""
    tick = time.perf_counter()
    metrics = validate(runner, val_data, position)
    runner.throughput.since_time += time.perf_counter() - tick
    return metrics


def report_checkpoint(runner: StepRunner, position: Position) -> None:
    """A mid-epoch checkpoint at the current step (a barrier on every rank)."""
    row = runner.metrics_row(position, loss=float("nan"), samples_per_s=0.0)
    report_with_checkpoint(runner, position, row.to_json())


def report_with_checkpoint(runner: StepRunner, position: Position, metrics: dict) -> None:
    """Report `metrics` (a barrier on every rank) with a checkpoint of the step at `position`,
    whose files are written while training goes on; the time the loop waited is counted."""
    runner.heartbeat.mark(position.step, "report")
    started = time.perf_counter()

    def write(directory: Path, distributed: bool):
        return runner.save_checkpoint(position, directory, distributed=distributed)

    runner.runtime.report(metrics, position.step, write, runner.run_dir, runner.cfg.checkpoint_async)
    position.checkpoint_wait_s += time.perf_counter() - started
    position.checkpoints += 1


def report_live(files: RunWriter, runner: StepRunner, position: Position, epoch_rows: int) -> None:
    """About once a second, where rank 0 is in the epoch (for the driver's progress bar)."""
    if files.live_due():
        files.live(
            epoch=position.epoch + 1,
            step=position.step,
            samples_seen=position.samples_seen,
            epoch_rows=epoch_rows,
            global_batch_size=runner.batch_plan.global_batch_size,
            world_size=runner.runtime.world_size,
            loss=runner.window.mean_loss(),
        )


def note_skipped_rows(runner: StepRunner, data: TableEpoch | StreamEpoch, position: Position, files: RunWriter) -> None:
    """Rows of the stream skipped this epoch for NaN/inf (--skip-nan-rows), over all ranks."""
    if runner.cfg.skip_nan_rows and isinstance(data, StreamEpoch):  # a collective: every rank, at the epoch's end
        skipped = int(runner.runtime.all_reduce_sum([float(data.skipped_rows)])[0])
        if skipped:
            files.event(
                Kind.DATA,
                f"epoch {position.epoch + 1}: skipped {skipped:,} row(s) holding NaN or inf (--skip-nan-rows)",
            )


@torch.no_grad()
def evaluate(runner: StepRunner, source: Data) -> dict[str, float]:
    """Validation loss and metrics, averaged over all validation samples of all ranks (over the
    same --eval-batches global batches every pass, when given)."""
    runtime = runner.runtime
    runner.model.eval()
    batch_size = max(
        1, runner.batch_plan.per_worker_max if not runner.cfg.micro_batch_size else runner.cfg.micro_batch_size
    )
    sums: dict[str, float] = {}
    count = 0
    # A rank without validation rows evaluates one row with weight 0 (n == 0), so every
    # rank learns the metric names and joins the reduction below.
    rank, world = runtime.evaluation_share()
    limit = evaluation_rows(runner.cfg)
    batches = source.eval_batches(rank, world, batch_size, runtime.device, limit=limit, seed=runner.cfg.seed)
    if runner.prepared is not None and runner.prepared.sharded and world > 1:
        batches = _in_step(batches, runtime)
    for n, batch in batches:
        loss, metrics = runner.compute_loss(batch)
        for name, value in {"loss": loss, **metrics}.items():
            sums[name] = sums.get(name, 0.0) + float(value) * n
        count += n
    names = sorted(sums)
    values = [sums[name] for name in names] + [float(count)]
    totals = runtime.all_reduce_sum(values) if world > 1 else values
    runner.model.train()
    return {f"val_{name}": total / totals[-1] for name, total in zip(names, totals[:-1])}


def _in_step(batches, runtime):
    """The batches of a rank, and weight-0 repeats of its last one until every rank is done:
    under fsdp a forward pass is a collective (each block's parameters are gathered from all
    ranks), so every rank runs as many as the rank with the most validation rows."""
    last = None
    iterator = iter(batches)
    while True:
        item = next(iterator, None)
        if runtime.all_reduce_sum([0.0 if item is None else 1.0])[0] == 0:
            return
        if item is not None:
            last = item
            yield item
        else:
            yield 0, last[1]
