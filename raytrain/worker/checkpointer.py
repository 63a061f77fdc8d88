"""The one owner of a worker's checkpoints: when to save, what a checkpoint holds, how it is
staged, published and pruned, and where an attempt continues from.

- When (`due`, and the loop's epoch ends, the step budget's last step and a stop request,
  which always save): every --checkpoint-every-steps steps, or, with --checkpoint-every auto,
  every `raytrain.rules.interval.AutoInterval` steps: Daly's interval from the loop's measured
  stall per save, the step time and the failure rate (the prior --mtbf-hours, updated by the
  failures this run recovers from), re-derived after every save and every failure and said
  when it changes. Every rank holds rank 0's figures (gathered at each save), so that every
  rank checkpoints at the same steps.
- What: the training state (`raytrain.worker.state.TrainingState`: model, optimizer, scaler,
  RNG, position) and the rules the run had at that step (`contents`).
- How and where, for both fault-tolerance modes: every writing rank writes its part into a
  staging directory (`Store.local_dir`), in the background; the checkpoint becomes visible
  once complete (`raytrain.rundir.publish.Publish`: renamed into place, or uploaded with its
  marker last). Who writes and how it is published is the recovery object's
  (`raytrain.faults.restart`): with a restarting worker group, Ray Train registers it (rank 0
  hands Ray the publish step as its upload function: Ray lists, and prunes, only complete
  checkpoints); per-step, the quorum's rank 0 writes all of it and publishes and prunes it by
  itself: Ray's report is a barrier over every worker, which a lost replica would hold up.
- Restore: `raytrain.rundir.checkpoints.resume_choice` says which; the furthest that loads on
  every rank is loaded (`Checkpointer.restore`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any

from raytrain.errors import CheckpointError, pipeline_code
from raytrain.rules import resume
from raytrain.rules.interval import AutoInterval, IntervalChange
from raytrain.rules.position import Position
from raytrain.rundir import checkpoints as ckpt
from raytrain.rundir.faults import storage_errors
from raytrain.rundir.publish import Publish
from raytrain.rundir.records import Kind
from raytrain.rundir.storage import Store
from raytrain.worker.state import take

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker.runtime import Runtime
    from raytrain.worker.state import Save
    from raytrain.worker.step import StepRunner

DIVERGED_CHECKPOINT_WAIT_S = 60.0  # how long a diverged (or disagreeing) rank waits for the checkpoint being written
# How many times a restore lists the run again when the checkpoint it was loading was pruned
# meanwhile (each time a newer one had been published: a writer saves at most every step).
RELISTS = 5


class Checkpointer:
    """A worker's checkpoints (see the module's docstring)."""

    def __init__(
        self, cfg: "TrainConfig", recovery: Any, store: Store, files: "RunWriter", *, invocation: str = ""
    ) -> None:
        """`recovery`: the mode's worker half (who writes, how published); `files`: the run's files."""
        self.cfg, self.invocation, self.files = cfg, invocation, files  # invocation: this driver's run of the job
        self.position = Position()  # where the attempt is: a restore sets it, every checkpoint holds it
        self.auto: AutoInterval | None = None  # --checkpoint-every auto, once restored
        self.saved_step, self.tick = 0, None  # the last checkpoint's step; when the last step ended
        self.say = None  # rank 0's event line (the run files, once restored)
        self.recovery, self.store = recovery, Store.of(store)
        self._save: Save | None = None  # this rank's checkpoint being written
        self._publish: Publish | None = None  # ... and being published
        self.slowest_save_s: float | None = None  # the slowest save's wait so far (None: none yet)

    @property
    def runtime(self) -> "Runtime":
        return self.recovery.runtime

    def due(self, step: int, last: bool) -> bool:
        """Whether the step at `step` is checkpointed for the cadence (--checkpoint-every-steps, or
        auto's interval); the last step of an epoch or of the budget is checkpointed by the loop anyway."""
        if self.auto is not None:
            now = time.perf_counter()
            if self.tick is not None:  # the time since the last step ended: this step's (auto's step time)
                self.auto.on_steps(1, now - self.tick)
            self.tick = now
            return self.auto.due(step - self.saved_step) and not last
        every = self.cfg.checkpoint_every_steps
        return bool(every) and step % every == 0 and not last

    def restore(self, runner: "StepRunner") -> dict[str, Any] | None:
        """Continue from the furthest checkpoint of the run (`raytrain.rundir.checkpoints.resume_choice`)
        that loads on every rank into `runner` and the position; returns its train state (None: a
        fresh start). One a rank cannot load is passed over on every rank, and said once. One
        pruned while it was being loaded (a per-step run's quorum writes on while a replacement
        restores) is no fault of the checkpoint: the run is listed again, up to RELISTS times."""
        files = self.files
        for _ in range(RELISTS):
            choice = ckpt.resume_choice(self.store, also=self.runtime.latest_checkpoint(self.store))
            saved, pruned = self._load_first(choice, runner)
            if not pruned:
                break
        else:
            raise CheckpointError(
                f"the checkpoints of {self.store} were pruned faster than this worker could load one "
                f"({RELISTS} tries): keep more with --num-checkpoints-to-keep, or save less often"
            )
        if choice.skipped_line():
            files.event(Kind.SKIPPED, choice.skipped_line(), checkpoints=choice.names)
        if saved is None and choice.passed_over:
            raise resume.unusable(files.store, choice.passed_over)
        take(self.position, Position.restored(saved))
        if self.cfg.checkpoint_every == "auto":
            self.say = lambda change: files.event(Kind.NOTE, change.line, interval_steps=change.after)
            self.auto_restored(saved)
        return saved

    def _load_first(self, choice: ckpt.ResumeChoice, runner: "StepRunner") -> tuple[dict[str, Any] | None, bool]:
        """Load the first of `choice`'s checkpoints that loads on every rank of the group: its train
        state (None: none did), and whether the group stopped at one pruned since the listing."""
        runtime, distributed = self.runtime, self.recovery.distributed_checkpoints
        optimizer = functools.partial(_in_build_optimizer, runner.pipeline)
        for directory, train_state in choice.usable:
            state = runner.training_state(Position.restored(train_state))
            unusable = pruned = 0.0
            try:
                state.load(directory, runtime, self.cfg.seed, distributed=distributed, load_optimizer=optimizer)
            except CheckpointError as error:
                if ckpt.gone(directory):
                    pruned = 1.0
                else:
                    choice.pass_over(directory, str(error))
                    unusable = 1.0
            if distributed:  # every rank continues from the same one
                unusable, pruned = runtime.group_sum([unusable, pruned])
            if pruned:
                return None, True
            if not unusable:
                runner.measures.restore(train_state, state.position.samples_seen, state.position.step)
                return train_state, False
            if not choice.names or choice.names[-1] != directory.name:  # failed on another rank
                choice.pass_over(directory, f"checkpoint {directory.name} failed to load on another rank")
        return None, False

    def auto_restored(self, saved: dict[str, Any] | None) -> None:
        """auto's interval as the checkpoint left it; an attempt of this same invocation that
        continues from it follows a failure (or a shrink), which the failure rate counts."""
        kept = (saved or {}).get("auto_interval") or {}
        sizes = ((saved or {}).get("position") or {}).get("world_sizes") or []
        self.auto = self.auto_from(kept.get("interval"))
        self.saved_step = int(((saved or {}).get("position") or {}).get("step", 0))
        grew = bool(sizes) and self.runtime.world_size > sizes[-1]
        if saved is None:
            self.tell(IntervalChange(0, self.auto.held, "start", self.auto.describe()))
        elif kept.get("invocation") == self.invocation and self.invocation and not grew:
            self.tell(self.auto.on_failure())

    def auto_from(self, state: dict[str, Any] | None) -> AutoInterval:
        """auto's interval from `state` (a checkpoint's, or rank 0's), with this run's options."""
        cfg = self.cfg
        return self.recovery.auto_interval(
            state,
            mtbf_hours=cfg.mtbf_hours,
            nodes=self.runtime.nodes,
            min_steps=cfg.checkpoint_min_steps,
            max_steps=cfg.checkpoint_max_steps,
        )

    def tell(self, change: IntervalChange | None) -> None:
        if change is not None and self.say is not None:
            self.say(change)

    def contents(self, runner: "StepRunner") -> dict[str, Any]:
        """The rules the run had at the attempt's position (`runner`'s), beside its training state."""
        position = self.position
        auto = {"auto_interval": {"invocation": self.invocation, "interval": self.auto.state()}} if self.auto else {}
        return {
            **auto,
            "scheduler": {
                "samples_seen": position.samples_seen,
                "peak_lr": runner.rate.peak_lr,
                "schedule": self.cfg.schedule,
                "rate_multipliers": runner.rate.multipliers,
            },
            "batch_plan": dataclasses.asdict(runner.batch_plan),
            "lr": runner.rate.at(position.samples_seen),
        }

    def save(self, runner: "StepRunner", metrics: dict[str, Any]) -> None:
        """Report `metrics` with a checkpoint of the attempt's step, trained by `runner` (with a
        restarting group, a barrier on every rank); the files are written while training goes on,
        and the time the loop waited is counted."""
        position = self.position
        runner.measures.heartbeat.mark(position.step, "report")
        started, runtime = time.perf_counter(), self.runtime
        self.finish()  # one in flight at a time: bounded host memory and local disk
        name = runtime.all_gather_object(ckpt.checkpoint_name(position.step) if runtime.is_rank0 else None)[0]
        recovery = self.recovery
        if recovery.writes_checkpoints:
            distributed, staging = recovery.distributed_checkpoints, ckpt.staging_dir(self.store) / name
            with storage_errors(staging, "write the checkpoint"):
                state = runner.training_state(position)
                save = self._save = state.save(staging, runtime, self.contents(runner), distributed=distributed)
                if not self.cfg.checkpoint_async:
                    save.wait()

            def wait_written() -> None:
                with storage_errors(staging, "write the checkpoint"):
                    save.wait()

            publish = self._publish = Publish(
                staging, self.store / name, wait_written, rank=runtime.world_rank if distributed else None,
                coordinator=runtime.is_rank0 or not distributed, step=position.step, fence=self.files.driver.check,
            )  # fmt: skip
            recovery.publish(publish, metrics, name, staging, self.cfg.checkpoint_async, self.prune)
        if not self.cfg.checkpoint_async:
            self.finish()
        stall_s = time.perf_counter() - started
        runner.measures.checkpointed(stall_s)
        self.slowest_save_s = max(stall_s, self.slowest_save_s or 0.0)
        if self.auto is not None:
            self.after_save(position.step, stall_s)

    def after_save(self, step: int, stall_s: float) -> None:
        """auto's interval re-derived from rank 0's stall and step time, which every rank then
        holds (one small gather per save): the ranks' own timings differ, their checkpoints must not."""
        change = self.auto.on_save(stall_s) if self.runtime.is_rank0 else None
        state = self.runtime.all_gather_object(self.auto.state() if self.runtime.is_rank0 else None)[0]
        if not self.runtime.is_rank0:
            self.auto = self.auto_from(state)
        self.saved_step, self.tick = step, time.perf_counter()
        self.tell(change)

    def prune(self) -> None:
        """The oldest checkpoints beyond --num-checkpoints-to-keep go (Ray Train's are Ray's to prune)."""
        for old in ckpt.checkpoint_dirs(self.store)[: -self.cfg.num_checkpoints_to_keep]:
            ckpt.remove(old)

    def finish(self, timeout_s: float | None = None) -> None:
        """Wait for this rank's checkpoint being written and published (rank 0: until it is
        visible), surfacing a write or a publish that failed."""
        save, self._save = self._save, None
        publish, self._publish = self._publish, None
        if save is not None:
            with storage_errors(save.directory, "write the checkpoint"):
                save.wait(timeout_s)
        if publish is not None:
            publish.wait(self.recovery.publish_wait_s(publish, self.store, timeout_s))

    def last_good(self) -> Any:
        """The run's last complete checkpoint (None: none yet), once the one being written in the
        background is finished, so that a run ending here (diverged, its replicas disagreeing) names
        it. That one was saved after a finite loss and agreeing replicas."""
        with contextlib.suppress(Exception):
            self.finish(timeout_s=DIVERGED_CHECKPOINT_WAIT_S)
        return ckpt.latest_complete(self.store)


def _in_build_optimizer(pipeline: Any, load: Any) -> None:
    """The optimizer's state loaded as the pipeline's build_optimizer's: a state its optimizer
    refuses is the pipeline's error (exit 2, not retried)."""
    with pipeline_code(pipeline, "build_optimizer"):
        load()
