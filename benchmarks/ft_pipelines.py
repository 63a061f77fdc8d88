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
    the time. At `kill_step` each replica of `kill_replicas` exits, on its first process only
    (a marker `killed-replica<R>` each; several die in the same step, as on a lost node); at
    `hang_step` the replica `hang_replica` hangs instead (it sleeps in the step and still
    heartbeats, as on a stuck kernel)."""

    def __init__(
        self,
        out_dir: str,
        kill_step: int | None = None,
        kill_replicas: tuple[int, ...] = (1,),
        step_sleep_s: float = 0.0,
        hang_step: int | None = None,
        hang_replica: int = 1,
    ):
        super().__init__()
        self.out_dir, self.kill_step, self.kill_replicas = out_dir, kill_step, tuple(kill_replicas)
        self.step_sleep_s, self.hang_step, self.hang_replica = step_sleep_s, hang_step, hang_replica

    def compute_loss(self, model, batch):
        if model.training:
            import ray.train

            ctx, replica, out = raytrain.context(), ray.train.get_context().get_world_rank(), Path(self.out_dir)
            self._fault(ctx.step, replica, out)
            with open(out / f"steps-replica{replica}.jsonl", "a") as handle:
                handle.write(
                    json.dumps(
                        {"pid": os.getpid(), "step": ctx.step, "world_size": ctx.world_size, "time": time.time()}
                    )
                    + "\n"
                )
            time.sleep(self.step_sleep_s)  # the compute of a larger model
        return super().compute_loss(model, batch)

    def _fault(self, step: int, replica: int, out: Path) -> None:
        for kind, at, replicas in (
            ("killed", self.kill_step, self.kill_replicas),
            ("hung", self.hang_step, (self.hang_replica,)),
        ):
            marker = out / f"{kind}-replica{replica}"
            if step == at and replica in replicas and not marker.exists():
                marker.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
                if kind == "killed":
                    os._exit(1)
                time.sleep(3600)
