"""An epoch of one attempt (`raytrain.worker.loop.Training`): its steps, what follows each
step (the sync, the metrics row, the checkpoint), and the epoch's end (validation, its row,
the reported checkpoint).

One way through an epoch, `train_epoch`, whatever the fault tolerance: the recovery object's
policy of the step (`Recovery.start_step`, `Recovery.commit`: `raytrain.faults.restart`) is
every rank, always, for a worker group that restarts on a failure, and the quorum of live
replicas for per-step fault tolerance.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from raytrain.data.draws import Draws
from raytrain.data.stream import Stream, StreamEpoch
from raytrain.data.table import Table
from raytrain.instruments.phases import SteadyClock
from raytrain.instruments.window import TrainingDiverged, divergence_message, sync
from raytrain.rules import steps
from raytrain.rules.budget import Budget, evaluation_due
from raytrain.rules.position import Position
from raytrain.rundir import checkpoints
from raytrain.rundir.records import EPOCH_LOSS, Kind, MetricsRow
from raytrain.worker import prefetch
from raytrain.worker.step import plan_line

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker.checkpointer import Checkpointer
    from raytrain.worker.runtime import Runtime
    from raytrain.worker.step import StepRunner

Data = Table | Stream | Draws  # a dataset on a worker
DIVERGED_CHECKPOINT_WAIT_S = 60.0  # how long a diverged (or disagreeing) rank waits for the checkpoint being written


class EpochResult(NamedTuple):
    loss: float  # the epoch's mean training loss over all ranks (so far, when the step budget ended it)
    samples_per_s: float
    stopped: bool  # the run was asked to stop: a checkpoint at the current step has been reported
    finished_elsewhere: bool = False  # per-step: a replacement found the others done with the run


class Epochs:
    """An attempt's epochs: the one loop over an epoch's steps, what follows each step, and the
    epoch's end. `raytrain.worker.loop.Training` holds what they use."""

    cfg: "TrainConfig"
    recovery: Any  # raytrain.faults.restart.Recovery
    runtime: "Runtime"
    files: "RunWriter"
    runner: "StepRunner"
    checkpointer: "Checkpointer"
    train_data: Data
    val_data: Data | None
    position: Position
    announced: bool
    steady_clock: SteadyClock | None

    def train_epoch(self) -> EpochResult:
        """Train the rest of the current epoch: to its end, to the step budget (--max-steps), or to
        the step where the run was asked to stop. Each step: the quorum (the recovery's policy: a
        restarting group's is every rank, always; per-step, the live replicas, a joining one
        healed first, position included); on a new quorum the batch plan and rate follow its size
        and the rows from the current offset are split over its members; forward and backward;
        then the step is applied only if every member commits it. An uncommitted step is taken
        again from the same offset, so a committed step is the only one that counts its rows:
        every row once per epoch."""
        cfg, recovery, position, source = self.cfg, self.recovery, self.position, self.train_data
        start, samples_before, budget = time.perf_counter(), position.samples_seen, Budget.of(cfg)
        self.runner.model.train()
        data = plain = split = None
        taken, stop = 0, False
        while position.epoch_offset < len(source) and not budget.steps_done(position.step):
            quorum = recovery.start_step(position.step, self.runner.window)
            self.files.enabled = recovery.runtime.is_rank0
            if recovery.healed:  # the position (and the epoch's loss so far) came from a live peer
                start, samples_before = time.perf_counter(), position.samples_seen
            if not self.announced and recovery.first_quorum(self, quorum):  # a replacement too late to join
                return EpochResult(math.nan, math.nan, stopped=False, finished_elsewhere=True)
            if quorum != split:
                recovery.faults.follow(quorum)
                self.follow_quorum(quorum.size)
                split, data = quorum, None
            if data is None:  # a new split, or the rows of an uncommitted step to read again
                data = plain = source.epoch(cfg.seed, position.epoch, position.epoch_offset, quorum.rank, quorum.size)
                if prefetch.wanted(cfg.prefetch, recovery.runtime.device):
                    data = prefetch.Prefetched(plain, recovery.runtime.device)
            step = steps.next_step(len(source), self.runner.batch_plan.global_batch_size, position.epoch_offset, taken)
            last = step.end >= len(source) or budget.steps_done(position.step + 1)
            if not self.take_step(data, step, last):  # a member failed inside the step: nothing of it is applied
                data = None
                continue
            taken += 1
            stop = self.after_step(last)
            if stop and not last:
                return EpochResult(math.nan, math.nan, stopped=True)
        if position.epoch_offset >= len(source):
            self.note_skipped_rows(plain)
        if self.steady_clock is not None:  # the epoch's last step ended at a sync (its row)
            self.steady_clock.settle(self.runner.measures.telemetry)
        samples_per_s = (position.samples_seen - samples_before) / max(1e-9, time.perf_counter() - start)
        return EpochResult(position.epoch_loss_so_far().mean(), samples_per_s, stop)

    def take_step(self, data: Any, step: steps.Step, last: bool) -> bool:
        """One optimizer step over this rank's rows of `step`, applied only if every member of the
        quorum commits it (`Recovery.commit`); returns whether it was. Then the position after it
        and, with prefetching data and unless `last`, the next step's batch staged inside this
        step's time. Steps past --timing-warmup-steps are timed."""
        runner, position = self.runner, self.position
        runner.update_context(position)
        steady = step.index >= self.cfg.timing_warmup_steps
        if self.steady_clock is None:
            self.steady_clock = SteadyClock(self.runtime.device)
        tick = self.steady_clock.start() if steady else None
        phase = runner.measures.phases(position.step, timed=steady)
        if self.cfg.compile:  # a step of a new shape compiles again: per-step gives it a first step's grace
            self.recovery.step_rows(step.size)
        runner.gradients(data, step, phase)
        if not self.recovery.commit(runner):
            return False
        runner.apply_gradients(position, phase)
        if not last and isinstance(data, prefetch.Prefetched):
            plan, rows = runner.batch_plan, len(self.train_data)
            data.stage(steps.next_step(rows, plan.global_batch_size, step.end, step.index + 1), plan.accumulation_steps)
        advance(position, step)
        runner.measures.own.steps += 1
        if steady:
            self.steady_clock.stop(tick, step.size, runner.measures.telemetry)
        return True

    def follow_quorum(self, size: int) -> None:
        """The runner for a quorum of `size` (its batch plan and rate), and one event line when the
        size differs from the one the run last trained with (the position says it, the same on
        every member, a healed one included)."""
        position = self.position
        if size != self.runner.batch_plan.world_size:
            self.runner = self.runner.for_quorum(size, len(self.train_data))
        previous = position.world_sizes[-1] if position.world_sizes else size
        if size != previous:
            runner, lr = self.runner, self.runner.rate.at(position.samples_seen)
            line = self.recovery.quorum_line(previous, size, position, plan_line(runner), lr)
            self.files.event(Kind.QUORUM, line, world_size=size, previous_world_size=previous, step=position.step)
        position.trains_with(size)

    def after_step(self, last: bool) -> bool:
        """After a step: rank 0's live row; at the logging cadence the sync (loss, stop request)
        and a metrics row (with a bounded validation pass every --eval-every-steps); a checkpoint
        when one is due (`Checkpointer.due`), or when the run is asked to stop mid-epoch. `last`:
        the epoch's last step, or the step budget's, whose row and checkpoint the caller writes.
        Returns whether the run was asked to stop. Per-step, each replica reads the stop request
        itself rather than trusting the sync to carry it."""
        cfg, runner, position, files, stop = self.cfg, self.runner, self.position, self.files, False
        faults = self.recovery.faults
        if runner.measures.memory is not None and not runner.measures.memory_said:
            runner.measures.say_memory(runner.runtime, files, note=runner.prepared.strategy.memory_note)
        if files.live_due():  # about once a second, where rank 0 is in the epoch (the driver's progress bar)
            files.live(
                epoch=position.epoch + 1,
                step=position.step,
                samples_seen=position.samples_seen,
                epoch_rows=len(self.train_data),
                global_batch_size=runner.batch_plan.global_batch_size,
                world_size=runner.runtime.world_size,
                loss=runner.window.mean_loss(),
            )
        checkpoint_now = self.checkpointer.due(position.step, last)
        evaluate_now = self.val_data is not None and evaluation_due(position.step, cfg.eval_every_steps, last)
        if position.step % cfg.log_every_steps == 0 or last or checkpoint_now or evaluate_now:
            # Every checkpoint follows a sync: weights are saved only after their loss was seen finite.
            asked = files.stop_requested(anyone=self.recovery.each_reads_stop)
            loss, count, stop = self.sync_ranks(stop_requested=asked, driver_gone=files.driver_gone())
            stop = stop or asked
            if count:
                position.epoch_loss = position.epoch_loss_so_far()
                position.epoch_loss.add(loss, count)
                runner.measures.synced(loss)
            if not last:
                rate = runner.measures.lap(position.samples_seen)
                validation = self.validate(between_steps=True) if evaluate_now else {}
                row = self.metrics_row(loss=loss, samples_per_s=rate, extra={**validation, **faults.row_figures()})
                files.metrics(row)
                if evaluate_now:
                    files.evaluation(row)
            checkpoint_now = checkpoint_now or (stop and not last)
        if faults.replicas_due(self.recovery, position.step, checkpoint_now or last):
            # Before the checkpoint (the epoch's or the run's last, its caller's): a published one's
            # replicas agreed. Here, at the sync, where every replica is (per-step, inside the step).
            self.compare_replicas()
        if checkpoint_now:
            row = self.metrics_row(loss=float("nan"), samples_per_s=0.0)
            self.checkpointer.save(self, row.to_json())
        return stop

    def sync_ranks(self, stop_requested: bool = False, driver_gone: str | None = None) -> tuple[float, int, bool]:
        """The sync (`raytrain.instruments.window.sync`): the mean loss since the last one, the samples
        it covers and whether to stop; every rank's compile figures noted. A NaN/inf loss on any
        rank ends the run here (TrainingDiverged), before its weights are saved."""
        runner, position = self.runner, self.position
        measures, faults = runner.measures, self.recovery.faults
        loss, count, stop, diverged, times, hosts, compiled = sync(
            runner.runtime, measures.heartbeat, runner.window, position.step, stop_requested, measures.own,
            faults.my_host, measures.compiled(), driver_gone,
        )  # fmt: skip
        if diverged:
            last_good = self.last_good_checkpoint()
            raise TrainingDiverged(
                divergence_message(
                    diverged,
                    stopped_at=position.step,
                    lr=runner.cfg.lr,
                    peak_lr=runner.rate.peak_lr,
                    precision=runner.cfg.precision,
                    last_good=str(last_good) if last_good else None,
                )
            )
        if self.steady_clock is not None:  # the sync waited for the steps' kernels: their times are in
            self.steady_clock.settle(runner.measures.telemetry)
        faults.after_sync(self.recovery, self.files, times, hosts, position.step)
        measures.note_compiled(compiled, self.files, position.step)
        return loss, count, stop

    def last_good_checkpoint(self) -> Any:
        """The run's last complete checkpoint (None: none yet), once the one being written in the
        background is finished, so that a run ending here (diverged, its replicas disagreeing) names
        it. That one was saved after a finite loss and agreeing replicas."""
        with contextlib.suppress(Exception):
            self.checkpointer.finish(timeout_s=DIVERGED_CHECKPOINT_WAIT_S)
        return checkpoints.latest_complete(self.checkpointer.store)

    def compare_replicas(self) -> None:
        """The replicas' fingerprints compared (`raytrain.instruments.watch.Watch.compare`); on a
        mismatch the run goes back to the last checkpoint, whose replicas agreed."""
        runner = self.runner
        self.recovery.faults.compare(
            self.recovery, self.files, runner.model, runner.optimizer, self.position.step, self.last_good_checkpoint
        )

    def end_epoch(self, epoch: EpochResult) -> None:
        """Validate, write the epoch's row and report it with a checkpoint."""
        position = self.position
        val_metrics = self.validate()
        position.epoch, position.epoch_offset = position.epoch + 1, 0
        row = self.closing_row(epoch, val_metrics)
        self.files.epoch_end(row, self.cfg.epochs)
        self.checkpointer.save(self, row.to_json())

    def end_at_step_budget(self, epoch: EpochResult) -> None:
        """The step budget (--max-steps) ran out inside an epoch: validate, write the run's last row
        and report it with a checkpoint at this step."""
        row = self.closing_row(epoch, self.validate())
        self.files.metrics(row)
        self.files.evaluation(row, final=True)
        self.checkpointer.save(self, row.to_json())

    def closing_row(self, epoch: EpochResult, val_metrics: dict) -> MetricsRow:
        """The row that closes an epoch (or the run, inside one): its `loss` is the last window's, as
        every row's is; `epoch_loss` is the epoch's mean (so far)."""
        last_loss = self.runner.measures.telemetry.last_loss
        last = math.nan if last_loss is None else last_loss
        return self.metrics_row(
            loss=last,
            samples_per_s=epoch.samples_per_s,
            extra={EPOCH_LOSS: epoch.loss, **val_metrics},
        )

    def metrics_row(self, *, loss: float, samples_per_s: float, extra: dict | None = None) -> MetricsRow:
        """A row of metrics.jsonl at the attempt's position."""
        runner, position = self.runner, self.position
        return MetricsRow(
            epoch=position.epoch if position.epoch_offset == 0 else position.epoch + 1,
            step=position.step,
            samples_seen=position.samples_seen,
            world_size=runner.runtime.world_size,
            global_batch_size=runner.batch_plan.global_batch_size,
            lr=runner.rate.at(position.samples_seen),
            loss=loss,
            samples_per_s=samples_per_s,
            time_s=time.time(),
            extra=dict(extra or {}),
        )

    def validate(self, between_steps: bool = False) -> dict[str, float]:
        """A validation pass (none without a validation set); its time is counted and, between two
        steps, left out of the training throughput."""
        if self.val_data is None:
            return {}
        measures = self.runner.measures
        measures.heartbeat.mark(self.position.step, "eval")
        tick = time.perf_counter()
        metrics = self.runner.evaluate(self.val_data)
        measures.validated(time.perf_counter() - tick, between_steps)
        return metrics

    def note_skipped_rows(self, data: Any) -> None:
        """Rows of the stream skipped this epoch for NaN/inf (--skip-nan-rows), over all ranks
        (`Recovery.sum_at_epoch_end`: not shared per-step, where no collective runs outside a step)."""
        if self.cfg.skip_nan_rows and isinstance(data, StreamEpoch):  # a collective: every rank, at the epoch's end
            total = self.recovery.sum_at_epoch_end([float(data.skipped_rows)])
            skipped = int(total[0]) if total is not None else 0
            if skipped:
                self.files.event(
                    Kind.DATA,
                    f"epoch {self.position.epoch + 1}: skipped {skipped:,} row(s) holding NaN or inf (--skip-nan-rows)",
                )


def advance(position: Position, step: steps.Step) -> None:
    """The position after `step`."""
    position.step += 1
    position.samples_seen += step.size
    position.epoch_offset = step.end
