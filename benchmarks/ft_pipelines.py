"""The pipeline benchmarks/fault_tolerance.py trains (importable by Ray workers)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import raytrain
from pipelines.digits.pipeline import DigitsPipeline


class KilledDigits(DigitsPipeline):
    """Digits that records, per training step, the process, its replica (Ray Train rank) and
    the time; the replica `kill_replica` exits at `kill_step` on its first process only."""

    def __init__(self, out_dir: str, kill_step: int | None = None, kill_replica: int = 1, step_sleep_s: float = 0.0):
        super().__init__()
        self.out_dir, self.kill_step, self.kill_replica, self.step_sleep_s = (
            out_dir,
            kill_step,
            kill_replica,
            step_sleep_s,
        )

    def compute_loss(self, model, batch):
        if model.training:
            import ray.train

            ctx, replica, out = raytrain.context(), ray.train.get_context().get_world_rank(), Path(self.out_dir)
            if (
                self.kill_step is not None
                and ctx.step == self.kill_step
                and replica == self.kill_replica
                and not (out / "killed").exists()
            ):
                (out / "killed").write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
                os._exit(1)
            with open(out / f"steps-replica{replica}.jsonl", "a") as handle:
                handle.write(
                    json.dumps(
                        {"pid": os.getpid(), "step": ctx.step, "world_size": ctx.world_size, "time": time.time()}
                    )
                    + "\n"
                )
            time.sleep(self.step_sleep_s)  # the compute of a larger model
        return super().compute_loss(model, batch)
