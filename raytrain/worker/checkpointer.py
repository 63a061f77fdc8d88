"""The one owner of a worker's checkpoints: when to save, what a checkpoint holds, how it is
staged, published and pruned, and where an attempt continues from.

- When (`due`, and the loop's epoch ends, the step budget's last step and a stop request,
  which always save): every --checkpoint-every-steps steps.
- What: the training state (`raytrain.worker.state.TrainingState`: model, optimizer, scaler,
  RNG, position) and the rules the run had at that step (`contents`).
- How and where, for both fault-tolerance modes: every writing rank writes its part into a
  staging directory (`Store.local_dir`), in the background; the checkpoint becomes visible
  once complete (`raytrain.rundir.publish.Publish`: renamed into place, or uploaded with its
  marker last). With a restarting worker group, Ray Train registers it (rank 0 hands Ray the
  publish step as its upload function: Ray lists, and prunes, only complete checkpoints).
  Per-step, the quorum's rank 0 writes all of it and publishes and prunes it by itself: Ray's
  report is a barrier over every worker, which a lost replica would hold up.
- Restore: `raytrain.rundir.checkpoints.resume_choice` says which; the furthest that loads on
  every rank is loaded (`raytrain.worker.step.StepRunner.restore`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from raytrain.rundir import checkpoints as ckpt
from raytrain.rundir.files import storage_errors
from raytrain.rundir.publish import Publish
from raytrain.rundir.storage import Store
from raytrain.worker.saving import Save

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.rules.position import Position
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker.runtime import Runtime
    from raytrain.worker.step import StepRunner

# How long rank 0 waits at the end of a run for Ray's upload step to publish its last checkpoint.
PUBLISH_WAIT_S = 60.0


class Checkpointer:
    """A worker's checkpoints (see the module's docstring)."""

    def __init__(self, cfg: "TrainConfig", runtime: "Runtime", store: Store, *, via_ray: bool) -> None:
        self.every, self.keep, self.asynchronous = (
            cfg.checkpoint_every_steps,
            cfg.num_checkpoints_to_keep,
            cfg.checkpoint_async,
        )
        self.runtime, self.store = runtime, Store.of(store)
        self.via_ray = via_ray  # Ray Train registers and prunes (a restarting group); else the writer does
        self._save: Save | None = None  # this rank's checkpoint being written
        self._publish: Publish | None = None  # ... and being published

    def due(self, step: int, last: bool) -> bool:
        """Whether the step at `step` is checkpointed for the cadence (--checkpoint-every-steps);
        the last step of an epoch or of the budget is checkpointed by the loop anyway."""
        return bool(self.every) and step % self.every == 0 and not last

    def restore(self, runner: "StepRunner", files: "RunWriter") -> dict[str, Any] | None:
        """Continue from the furthest checkpoint of the run that loads on every rank; its train
        state (None: a fresh start)."""
        return runner.restore(ckpt.resume_choice(self.store, also=self.runtime.latest_checkpoint()), files)

    @staticmethod
    def contents(runner: "StepRunner", position: "Position") -> dict[str, Any]:
        """The rules the run had at `position`, beside its training state."""
        return {
            "scheduler": {
                "samples_seen": position.samples_seen,
                "peak_lr": runner.peak_lr,
                "schedule": runner.cfg.schedule,
                "rate_multipliers": runner.rate_multipliers,
            },
            "batch_plan": dataclasses.asdict(runner.batch_plan),
            "lr": runner.lr_at(position.samples_seen),
        }

    def save(self, runner: "StepRunner", position: "Position", metrics: dict[str, Any]) -> None:
        """Report `metrics` with a checkpoint of the step at `position` (with a restarting
        group, a barrier on every rank); the files are written while training goes on, and
        the time the loop waited is counted."""
        runner.heartbeat.mark(position.step, "report")
        started, runtime = time.perf_counter(), self.runtime
        self.finish()  # one in flight at a time: bounded host memory and local disk
        name = runtime.all_gather_object(ckpt.checkpoint_name(position.step) if runtime.is_rank0 else None)[0]
        if runtime.is_rank0 or self.via_ray:  # per-step: the quorum's rank 0 writes all of it
            distributed, staging = runtime.distributed_checkpoints, ckpt.staging_dir(self.store) / name
            with storage_errors(staging, "write the checkpoint"):
                state = runner.training_state(position)
                save = self._save = state.save(
                    staging, runtime, self.contents(runner, position), distributed=distributed
                )
                if not self.asynchronous:
                    save.wait()

            def wait_written() -> None:
                with storage_errors(staging, "write the checkpoint"):
                    save.wait()

            coordinator = runtime.is_rank0 or not distributed
            publish = self._publish = Publish(
                staging, self.store / name, wait_written, rank=runtime.world_rank if distributed else None,
                coordinator=coordinator, step=position.step,
            )  # fmt: skip
            if not self.via_ray:
                publish.start(then=self.prune)
            elif coordinator:
                runtime.report(metrics, name, staging, publish, self.asynchronous)
            else:
                publish.start()
                runtime.report(metrics, asynchronous=self.asynchronous)
        if not self.asynchronous:
            self.finish()
        runner.telemetry.checkpoint_wait_s += time.perf_counter() - started
        runner.telemetry.checkpoints += 1

    def prune(self) -> None:
        """The oldest checkpoints beyond --num-checkpoints-to-keep go (Ray Train's are Ray's to prune)."""
        for old in ckpt.checkpoint_dirs(self.store)[: -self.keep]:
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
            # Ray's upload step renames rank 0's: wait for that, briefly, so the run's end sees it
            ray_runs_it = self.via_ray and publish.coordinator and self.runtime.distributed and self.store.renames
            publish.wait(min(PUBLISH_WAIT_S, timeout_s or PUBLISH_WAIT_S) if ray_runs_it else timeout_s)
