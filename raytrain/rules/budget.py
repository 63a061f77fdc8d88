"""How long a run trains, and the cadences counted in steps: a budget of epochs, of optimizer
steps (`--max-steps`), or both (whichever comes first); steps turned into samples for the
schedule; when a bounded validation pass is due.

Steps are what a user counts (nanoGPT's `max_iters`, `max_steps` elsewhere); samples are what
the schedule is keyed to, so that a resize never moves warmup or decay. A step count becomes a
sample count at the run's planned global batch (`planned_global_batch`: `--global-batch-size`,
or the per-worker batch × the largest worker count), walking the epochs as the run does: the
last step of an epoch may be partial, and the count follows it. Pure: nothing here touches Ray
or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.config.optimization import OptimizationSection


def planned_global_batch(cfg: "TrainConfig") -> int:
    """The global batch steps are converted to samples with: fixed with `--global-batch-size`;
    with `--batch-size-per-worker`, that batch × the largest worker count (frozen by the config,
    like the reference batch, so an elastic resize never changes it)."""
    if cfg.global_batch_size is not None:
        return cfg.global_batch_size
    return cfg.batch_size_per_worker * max(1, cfg.max_workers)


def steps_per_epoch(epoch_rows: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch of `epoch_rows` rows (the last one may be partial)."""
    return -(-epoch_rows // global_batch_size)


def samples_after_steps(steps: int, epoch_rows: int, global_batch_size: int) -> int:
    """Samples trained once `steps` optimizer steps of `global_batch_size` are taken from the
    start of the run, epoch after epoch of `epoch_rows` rows (each epoch's last step partial)."""
    per_epoch = steps_per_epoch(epoch_rows, global_batch_size)
    epochs, rest = divmod(steps, per_epoch)
    return epochs * epoch_rows + min(epoch_rows, rest * global_batch_size)


@dataclass(frozen=True)
class Budget:
    """How long the run trains: `epochs` (None: no limit), `max_steps` optimizer steps (None: no
    limit); both: whichever comes first. At least one is set."""

    epochs: int | None
    max_steps: int | None

    @classmethod
    def of(cls, cfg: "OptimizationSection") -> "Budget":
        return cls(cfg.epochs, cfg.max_steps)

    def steps_done(self, step: int) -> bool:
        """Whether `step` optimizer steps use up the step budget."""
        return self.max_steps is not None and step >= self.max_steps

    def done(self, epochs_done: int, step: int) -> bool:
        """Whether a run with `epochs_done` complete epochs and `step` steps has trained all of it."""
        return (self.epochs is not None and epochs_done >= self.epochs) or self.steps_done(step)

    def samples(self, epoch_rows: int, global_batch_size: int) -> int:
        """The run's length in samples (what the schedule spans), at `global_batch_size`."""
        lengths = [self.epochs * epoch_rows] if self.epochs is not None else []
        if self.max_steps is not None:
            lengths.append(samples_after_steps(self.max_steps, epoch_rows, global_batch_size))
        return min(lengths)

    def total_steps(self, epoch_rows: int, global_batch_size: int) -> int:
        """The optimizer steps the run takes in all at `global_batch_size`."""
        totals = [self.max_steps] if self.max_steps is not None else []
        if self.epochs is not None:
            totals.append(self.epochs * steps_per_epoch(epoch_rows, global_batch_size))
        return min(totals)

    def describe(self) -> str:
        """`4 epochs`, `300 steps`, or `300 steps or 4 epochs, whichever comes first`."""
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}" if self.epochs is not None else ""
        steps = f"{self.max_steps:,} step{'s' if self.max_steps != 1 else ''}" if self.max_steps is not None else ""
        if epochs and steps:
            return f"{steps} or {epochs}, whichever comes first"
        return steps or epochs


def evaluation_due(step: int, every_steps: int | None, last_of_epoch: bool) -> bool:
    """Whether a bounded validation pass follows the step to `step` (`--eval-every-steps`): at
    every multiple of the cadence, but not at an epoch's last step, where the epoch's own
    validation runs."""
    return bool(every_steps) and step % every_steps == 0 and not last_of_epoch


def evaluation_rows(cfg: "TrainConfig") -> int | None:
    """Rows of one validation pass: `--eval-batches` global batches (at the planned global
    batch, so every pass covers the same rows whatever the worker count); None: all of them."""
    return None if cfg.eval_batches is None else cfg.eval_batches * planned_global_batch(cfg)
