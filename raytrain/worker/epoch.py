"""One attempt of a worker (`Training`): what it trains with and where it is, built and restored
(`Training.begin`), and its one loop over epochs (`Training.run`): each epoch's steps, what
follows each step (the sync, the metrics row, the checkpoint), and the epoch's end (validation,
its row, the reported checkpoint).

One way through an epoch, `train_epoch`, whatever the fault tolerance: the recovery object's
policy of the step (`Recovery.start_step`, `Recovery.commit`: `raytrain.faults.restart`) is
every rank, always, for a worker group that restarts on a failure, and the quorum of live
replicas for per-step fault tolerance.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.draws import Draws
from raytrain.data.sources import Source, cost_notes, data_digest, open_source
from raytrain.data.stream import Stream, StreamEpoch
from raytrain.data.table import Table
from raytrain.instruments.notice import BOARD as notices
from raytrain.instruments.phases import SteadyClock
from raytrain.instruments.window import TrainingDiverged, divergence_message, sync
from raytrain.pipeline import Pipeline, overrides
from raytrain.rules import resume, steps
from raytrain.rules.attempt import Attempt
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.budget import Budget, evaluation_due
from raytrain.rules.position import Position, progress
from raytrain.rundir.records import EPOCH_LOSS, Kind, MetricsRow
from raytrain.rundir.writer import RunWriter
from raytrain.worker import prefetch
from raytrain.worker.checkpointer import Checkpointer
from raytrain.worker.optim import describe_optimizer
from raytrain.worker.state import unwrap
from raytrain.worker.step import StepRunner, plan_line

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.rundir.heartbeats import Heartbeat
    from raytrain.worker.runtime import Runtime

Data = Table | Stream | Draws  # a dataset on a worker


class EpochResult(NamedTuple):
    loss: float  # the epoch's mean training loss over all ranks (so far, when the step budget ended it)
    samples_per_s: float
    stopped: bool  # the run was asked to stop: a checkpoint at the current step has been reported
    finished_elsewhere: bool = False  # per-step: a replacement found the others done with the run


@dataclass
class Training:
    """One attempt of this worker: what it trains with and where it is. `run` is its one loop
    over epochs (`train_epoch` over each one's steps); how a failure is recovered from is the
    recovery object's (`raytrain.faults.restart`)."""

    cfg: TrainConfig
    recovery: Any  # the mode's worker half (`raytrain.faults.restart.Recovery` or a subclass)
    files: RunWriter
    runner: StepRunner  # the model, optimizer and rules of the current quorum
    checkpointer: Checkpointer  # holds the position too, which it restores and saves
    train_data: Data
    val_data: Data | None
    position: Position
    saved: dict[str, Any] | None = None  # the checkpoint's train state (None: a fresh start)
    attempt: Attempt | None = None
    announced: bool = False
    steady_clock: SteadyClock | None = None  # times the steady steps (on a GPU, by CUDA events)

    @property
    def runtime(self) -> "Runtime":
        return self.recovery.runtime

    @classmethod
    def begin(
        cls,
        cfg: TrainConfig,
        pipeline: Pipeline,
        recovery: Any,
        files: RunWriter,
        heartbeat: "Heartbeat",
        sources: dict[str, Source],
        checkpointer: Checkpointer,
    ) -> "Training":
        """Build for this attempt's workers (per-step: replicas), then restore: the furthest
        checkpoint that loads (`Checkpointer.restore`); then ready to step (`Recovery.after_restore`),
        the attempt said at once where every worker starts with the others."""
        runtime, workers = recovery.runtime, recovery.replica_count
        heartbeat.mark(0, "data")
        train_data = open_source("train", sources["train"], runtime.get_object, cfg.skip_nan_rows)
        val = sources.get("val")
        val_data = open_source("val", val, runtime.get_object, cfg.skip_nan_rows) if val is not None else None
        runner = StepRunner.build(pipeline, cfg, runtime, heartbeat, batch_plan_for(cfg, workers), len(train_data))
        saved = checkpointer.restore(runner)
        position, now = checkpointer.position, data_digest(train_data)
        resume.check_same_data(position.data, now, position.step, mid_epoch=bool(position.epoch_offset))
        position.data = now
        attempt = Attempt.of(saved is not None, position.world_sizes, workers)
        runner.model = recovery.after_restore(runner.training_state(position))
        training = cls(cfg, recovery, files, runner, checkpointer, train_data, val_data, position, saved, attempt)
        if recovery.announces_at_restore:
            training.announce()
            position.trains_with(runtime.world_size)
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

    def announce(self, healed: bool = False, after: str = "", size: int = 0) -> None:
        """Rank 0 says what this attempt is (with the plan and rate it trains with, against the
        checkpoint's rate) and what the data costs the run, then `after` (a quorum line, of
        `size` workers). A replica `healed` into a live quorum says nothing: the quorum's line does."""
        files, runner, position, saved = self.files, self.runner, self.position, self.saved
        self.announced = True
        if healed:
            return
        lr_before = saved.get("lr", math.nan) if saved else math.nan
        world_size = self.runtime.world_size
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
        if after:
            files.event(Kind.QUORUM, after, world_size=size)

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
            if not self.announced:  # this worker's first quorum (per-step)
                after = recovery.first_quorum(quorum, self.files, budget)
                if after is None:  # a replacement too late to join
                    return EpochResult(math.nan, math.nan, stopped=False, finished_elsewhere=True)
                self.announce(recovery.healed, after, quorum.size)
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
        every member, a healed one included): per-step's (`PerStep.quorum_line`); a restarting
        group trains at its restored size from the start (`Recovery.announces_at_restore`)."""
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
        faults, measures = self.recovery.faults, runner.measures
        if measures.memory:  # measured after the attempt's first step, not said yet
            measures.say_memory(self.runtime, files, note=runner.prepared.strategy.memory_note)
        if files.live_due():  # about once a second, where rank 0 is in the epoch (the driver's progress bar)
            files.live(
                epoch=position.epoch + 1,
                step=position.step,
                samples_seen=position.samples_seen,
                epoch_rows=len(self.train_data),
                global_batch_size=runner.batch_plan.global_batch_size,
                world_size=self.runtime.world_size,
                loss=runner.window.mean_loss(),
            )
        checkpoint_now = self.checkpointer.due(position.step, last)
        evaluate_now = self.val_data is not None and evaluation_due(position.step, cfg.eval_every_steps, last)
        if position.step % cfg.log_every_steps == 0 or last or checkpoint_now or evaluate_now:
            # Every checkpoint follows a sync: weights are saved only after their loss was seen finite.
            asked = files.stop_requested(anyone=self.recovery.each_reads_stop)
            loss, count, stop, leaving = self.sync_ranks(stop_requested=asked, driver_gone=files.driver_gone())
            stop = stop or asked
            if count:
                position.epoch_loss = position.epoch_loss_so_far()
                position.epoch_loss.add(loss, count)
                measures.synced(loss)
            if not last:
                rate = measures.lap(position.samples_seen)
                validation = self.validate(between_steps=True) if evaluate_now else {}
                row = self.metrics_row(loss=loss, samples_per_s=rate, extra={**validation, **faults.row_figures()})
                files.metrics(row)
                if evaluate_now:
                    files.evaluation(row)
            checkpoint_now = checkpoint_now or (stop and not last)
            # A preemption notice: at an epoch's last step its end comes first, and the next sync
            # carries the notice again. A deadline too short for a save skips one due here too.
            if leaving and not last:
                saves = faults.on_notice(files, leaving, position.step, self.checkpointer.slowest_save_s)
                checkpoint_now = saves if self.recovery.eviction.checkpoints_first else checkpoint_now
        if faults.replicas_due(position.step, checkpoint_now or last):
            # Before the checkpoint (the epoch's or the run's last, its caller's): a published one's
            # replicas agreed. Here, at the sync, where every replica is (per-step, inside the step).
            # On a mismatch the run goes back to the last checkpoint, whose replicas agreed.
            faults.compare(files, runner.model, runner.optimizer, position.step, self.checkpointer.last_good)
        if checkpoint_now:
            row = self.metrics_row(loss=float("nan"), samples_per_s=0.0)
            self.checkpointer.save(runner, row.to_json())
        if faults.leaving:
            if checkpoint_now:
                self.checkpointer.finish()  # written and published before the ranks with a notice leave
            faults.leave()
        return stop

    def sync_ranks(
        self, stop_requested: bool = False, driver_gone: str | None = None
    ) -> tuple[float, int, bool, dict[int, Any]]:
        """The sync (`raytrain.instruments.window.sync`): the mean loss since the last one, the samples
        it covers, whether to stop and the ranks with a preemption notice (`raytrain.instruments.notice`);
        every rank's compile figures noted. A NaN/inf loss on any rank ends the run here
        (TrainingDiverged), before its weights are saved."""
        runner, position = self.runner, self.position
        measures, faults = runner.measures, self.recovery.faults
        loss, count, stop, diverged, times, hosts, compiled, leaving = sync(
            runner.runtime, measures.heartbeat, runner.window, position.step, stop_requested, measures.own,
            faults.my_host, measures.compiled(), driver_gone, notices.notice,
        )  # fmt: skip
        if diverged:
            last_good = self.checkpointer.last_good()
            raise TrainingDiverged(
                divergence_message(
                    diverged,
                    stopped_at=position.step,
                    lr=self.cfg.lr,
                    peak_lr=runner.rate.peak_lr,
                    precision=self.cfg.precision,
                    last_good=str(last_good) if last_good else None,
                )
            )
        if self.steady_clock is not None:  # the sync waited for the steps' kernels: their times are in
            self.steady_clock.settle(measures.telemetry)
        faults.after_sync(self.files, times, hosts, position.step)
        measures.note_compiled(compiled, self.files, position.step)
        return loss, count, stop, leaving

    def end_epoch(self, epoch: EpochResult) -> None:
        """Validate, write the epoch's row and report it with a checkpoint."""
        position = self.position
        val_metrics = self.validate()
        position.epoch, position.epoch_offset = position.epoch + 1, 0
        row = self.closing_row(epoch, val_metrics)
        self.files.epoch_end(row, self.cfg.epochs)
        self.checkpointer.save(self.runner, row.to_json())

    def end_at_step_budget(self, epoch: EpochResult) -> None:
        """The step budget (--max-steps) ran out inside an epoch: validate, write the run's last row
        and report it with a checkpoint at this step."""
        row = self.closing_row(epoch, self.validate())
        self.files.metrics(row)
        self.files.evaluation(row, final=True)
        self.checkpointer.save(self.runner, row.to_json())

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
            world_size=self.runtime.world_size,
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
    position.samples_seen += step.end - step.start  # its size, without a property's call every step
    position.epoch_offset = step.end
