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


class PoissonFailures(raytrain.Pipeline):
    """A small MLP on `num_rows` synthetic rows (one long epoch: only the interval decides when
    to save), paced to `step_sleep_s` a step, whose rank 0 process dies after an exponential
    time of training with mean `mtbf_s`: failures at a known rate. The n-th death's time is
    drawn from (seed, n), so every contender of a comparison meets the same failure process."""

    def __init__(self, out_dir: str, mtbf_s: float, seed: int = 0, num_rows: int = 400_000, step_sleep_s: float = 0.02):
        self.out_dir, self.mtbf_s, self.seed = out_dir, mtbf_s, seed
        self.num_rows, self.step_sleep_s = num_rows, step_sleep_s

    def build_model(self, cfg):
        import torch

        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def build_datasets(self, cfg):
        import numpy as np
        import pyarrow as pa
        import ray.data
        from ray.data.extensions import ArrowTensorArray

        x = np.random.default_rng(0).normal(size=(self.num_rows, 16)).astype(np.float32)
        y = x.sum(axis=1, keepdims=True).astype(np.float32)
        table = pa.table({"x": ArrowTensorArray.from_numpy(x), "y": ArrowTensorArray.from_numpy(y)})
        return {"train": ray.data.from_arrow(table)}

    def compute_loss(self, model, batch):
        import ray.train
        import torch.nn.functional as F

        if model.training:
            if ray.train.get_context().get_world_rank() == 0:
                self._maybe_die(Path(self.out_dir))
            time.sleep(self.step_sleep_s)  # the compute of a larger model
        return F.mse_loss(model(batch["x"]), batch["y"])

    def _maybe_die(self, out: Path) -> None:
        if not hasattr(self, "_dies_at"):  # this process's first step: when it dies
            import numpy as np

            self._deaths = len(list(out.glob("died-*")))
            lifetime = np.random.default_rng([self.seed, self._deaths]).exponential(self.mtbf_s)
            self._dies_at = time.time() + lifetime
        if time.time() >= self._dies_at:
            (out / f"died-{self._deaths}").write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os._exit(1)
