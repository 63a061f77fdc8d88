"""The position of training: what every checkpoint stores and progress.json shows."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from raytrain.rundir.records import Progress


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
    checkpoint_wait_s: float = 0.0  # the loop's time in checkpoint reports (its files are written meanwhile)
    checkpoints: int = 0
    data: dict[str, Any] = field(default_factory=dict)  # what the training set was (its layout): resume needs the same
    # the cost view (raytrain.rules.flops): FLOPs of one training sample, forward and backward, as
    # rank 0 counted them on its first micro-batch of the attempt, and the device they ran on
    flops_per_sample: float = 0.0
    device_name: str = ""
    # the epoch's synced training loss (sum, samples): kept in every checkpoint, so the epoch's
    # mean covers all of it after a restart mid-epoch, and copied to a replica that heals
    # mid-epoch (per-step mode), so whoever writes the epoch's row has it all
    epoch_loss: list[float] = field(default_factory=lambda: [-1.0, 0.0, 0.0])  # [epoch, sum, samples]
    last_loss: float | None = None  # the mean training loss over all ranks of the last sync's window

    @classmethod
    def restored(cls, state: dict[str, Any] | None) -> "Position":
        """The position of a checkpoint's state; the start of training without one."""
        return cls(**state["position"]) if state else cls()

    def progress(self, status: str) -> Progress:
        """progress.json for this position: all of it, its steady throughput and `status`."""
        steady = self.steady_samples / self.steady_time_s if self.steady_time_s else None
        return Progress.from_json(
            {**dataclasses.asdict(self), "steady_samples_per_s": steady, "status": status, "time": time.time()}
        )
