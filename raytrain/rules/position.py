"""Where training is (`Position`: what a run continues from), and what it measured of itself on
the way (`Telemetry`: what progress.json and the summary show). A checkpoint keeps both, each
under its own key; one written before they were split holds all of it under "position",
which is still read."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from raytrain.rundir.records import Progress


@dataclass
class EpochLoss:
    """The synced training loss of epoch `epoch` so far: kept in every checkpoint, so the
    epoch's mean covers all of it after a restart mid-epoch, and copied to a replica that heals
    mid-epoch (per-step mode), so whoever writes the epoch's row has it all."""

    epoch: int = -1
    total: float = 0.0  # sample-weighted sum
    count: int = 0  # samples

    def add(self, loss: float, count: int) -> None:
        self.total += loss * count
        self.count += count

    def mean(self) -> float:
        return self.total / self.count if self.count else float("nan")

    @classmethod
    def of(cls, value: Any) -> "EpochLoss":
        """From a checkpoint: a record, or the `[epoch, sum, samples]` list of earlier versions."""
        if isinstance(value, dict):
            return cls(int(value.get("epoch", -1)), float(value.get("total", 0.0)), int(value.get("count", 0)))
        epoch, total, count = (list(value or []) + [-1.0, 0.0, 0.0][len(value or []) :])[:3]
        return cls(int(epoch), float(total), int(count))


@dataclass
class Position:
    """Where training is: stored in every checkpoint, enough to continue exactly."""

    epoch: int = 0  # epoch being trained, 0-based
    epoch_offset: int = 0  # rows of this epoch's order already trained on
    step: int = 0  # optimizer steps taken since the run began
    samples_seen: int = 0  # training samples since the run began
    world_sizes: list[int] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # what the training set was (its layout): resume needs the same
    epoch_loss: EpochLoss = field(default_factory=EpochLoss)

    @classmethod
    def restored(cls, state: dict[str, Any] | None) -> "Position":
        """The position of a checkpoint's state; the start of training without one."""
        stored = dict((state or {}).get("position") or {})
        names = {f.name for f in dataclasses.fields(cls)}
        position = cls(**{k: v for k, v in stored.items() if k in names and k != "epoch_loss"})
        position.epoch_loss = EpochLoss.of(stored.get("epoch_loss"))
        return position

    def trains_with(self, world_size: int) -> None:
        """The run trains with `world_size` workers from here: added to `world_sizes` when it
        differs from the last."""
        if not self.world_sizes or self.world_sizes[-1] != world_size:
            self.world_sizes = [*self.world_sizes, world_size]

    def epoch_loss_so_far(self) -> EpochLoss:
        """The epoch's synced training loss so far (none when the record is another epoch's)."""
        return self.epoch_loss if self.epoch_loss.epoch == self.epoch else EpochLoss(self.epoch)


@dataclass
class Telemetry:
    """What a run measures of itself: the steady throughput, the phase times, the checkpoints'
    cost, the cost view and the last loss. Nothing a resume needs; kept in every checkpoint so
    that the figures cover the whole run."""

    steady_steps: int = 0  # steps timed for the steady throughput (past --timing-warmup-steps)
    steady_samples: int = 0
    steady_time_s: float = 0.0
    phase_time_s: dict[str, float] = field(default_factory=dict)  # steady steps only, this rank
    checkpoint_wait_s: float = 0.0  # the loop's time in checkpoint reports (its files are written meanwhile)
    checkpoints: int = 0
    validation_s: float = 0.0  # the loop's time in validation passes (goodput's account of it)
    # the cost view (raytrain.rules.flops): FLOPs of one training sample, forward and backward, as
    # rank 0 counted them on its first micro-batch of the attempt, and the device they ran on
    flops_per_sample: float = 0.0
    device_name: str = ""
    last_loss: float | None = None  # the mean training loss over all ranks of the last sync's window
    # --compile: the graphs each rank's Dynamo built in this attempt, and its seconds compiling
    compile_graphs: list[int] | None = None
    compile_s: list[float] | None = None

    def add_steady(self, samples: int, seconds: float) -> None:
        """A timed step (past --timing-warmup-steps) adds to the steady throughput."""
        self.steady_steps += 1
        self.steady_samples += samples
        self.steady_time_s += seconds

    @classmethod
    def restored(cls, state: dict[str, Any] | None) -> "Telemetry":
        """A checkpoint's telemetry (an earlier version's is inside its position)."""
        stored = (state or {}).get("telemetry") or (state or {}).get("position") or {}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in names})


def progress(position: Position, telemetry: Telemetry, status: str) -> Progress:
    """progress.json: the position, the telemetry, the steady throughput and `status`."""
    steady = telemetry.steady_samples / telemetry.steady_time_s if telemetry.steady_time_s else None
    epoch_loss = position.epoch_loss
    values = {**dataclasses.asdict(position), **dataclasses.asdict(telemetry)}
    values["epoch_loss"] = [float(epoch_loss.epoch), epoch_loss.total, float(epoch_loss.count)]
    return Progress.from_json({**values, "steady_samples_per_s": steady, "status": status, "time": time.time()})
