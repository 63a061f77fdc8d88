"""Pipelines used by the CPU Ray tests. Importable on Ray workers (tests/ is on their PYTHONPATH).

They record what each rank trained on into files, so tests can check invariants from
the outside: ids per step per rank, weights after a step, a crash on the first attempt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import raytrain
from pipelines.digits.pipeline import DigitsPipeline
from raytrain.rules.steps import split_range


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _paced(step_sleep_s: float, pace_until: str | None) -> bool:
    return bool(step_sleep_s) and not (pace_until and os.path.exists(pace_until))


def _table_dataset(columns: dict[str, np.ndarray]):
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    return ray.data.from_arrow(
        pa.table({k: (ArrowTensorArray.from_numpy(v) if v.ndim > 1 else v) for k, v in columns.items()})
    )


class RecordingPipeline(raytrain.Pipeline):
    """A linear model on `num_rows` random rows with an `id` column; records ids per step.

    `crash_at_step`: on the first attempt only (a marker file in `out_dir`), rank 0's
    process exits once the run reaches that global step, to exercise failure recovery.
    `step_sleep_s` paces every training step, until the file `pace_until` exists (when given):
    a test keeps the run going while it waits for something, then lets it finish at full speed.
    `probe_weights`: each rank writes its parameters' checksum at the start of step 1, after the
    first optimizer step (`weights-rank{r}.json`).
    """

    def __init__(
        self,
        out_dir: str,
        num_rows: int = 200,
        crash_at_step: int | None = None,
        step_sleep_s: float = 0.0,
        fail_at_step: int | None = None,
        pace_until: str | None = None,
        probe_weights: bool = False,
    ):
        self.out_dir = out_dir
        self.probe_weights = probe_weights
        self.num_rows = num_rows
        self.crash_at_step = crash_at_step
        self.step_sleep_s = step_sleep_s
        self.pace_until = pace_until
        self.fail_at_step = fail_at_step  # every rank's compute_loss raises there: the pipeline's error

    def build_model(self, cfg):
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def build_datasets(self, cfg):
        rng = np.random.default_rng(7)
        features = rng.normal(size=(self.num_rows, 8)).astype(np.float32)
        labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
        ids = np.arange(self.num_rows, dtype=np.int64)
        return {"train": _table_dataset({"x": features, "y": labels, "id": ids})}

    def compute_loss(self, model, batch):
        ctx = raytrain.context()
        if model.training:
            if ctx.step == self.fail_at_step:
                raise ValueError(f"a bug in compute_loss at step {ctx.step}")
            self._record(ctx, batch)
            if getattr(self, "probe_weights", False) and ctx.step == 1:
                write_weights_checksum(self.out_dir, model, ctx)
            if self._paced():
                import time

                time.sleep(self.step_sleep_s)
        logits = model(batch["x"])
        return F.cross_entropy(logits, batch["y"])

    def _paced(self) -> bool:
        return _paced(self.step_sleep_s, getattr(self, "pace_until", None))

    def _record(self, ctx, batch):
        out = Path(self.out_dir)
        if not hasattr(self, "_attempt"):  # a fresh copy of the pipeline per worker process
            self._attempt = "second" if (out / "crashed").exists() else "first"
        if (
            self.crash_at_step is not None
            and ctx.step == self.crash_at_step
            and ctx.world_rank == 0
            and self._attempt == "first"
        ):
            (out / "crashed").write_text(repr(__import__("time").time()))
            os._exit(1)  # the worker process dies, as on a crash or an OOM kill
        row = {
            "attempt": self._attempt,
            "rank": ctx.world_rank,
            "world_size": ctx.world_size,
            "epoch": ctx.epoch,
            "step": ctx.step,
            "lr": ctx.lr,
            "time": __import__("time").time(),
            "ids": batch["id"].tolist(),
        }
        with open(out / f"ids-rank{ctx.world_rank}.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")


def write_weights_checksum(out_dir: str, model, ctx) -> None:
    """This rank's parameters' sum, sum of squares and first 20 values, once per run
    (`weights-rank{r}.json`): ranks that hold the same weights write the same file."""
    inner = getattr(model, "module", model)
    flat = torch.cat([p.detach().flatten().double() for p in inner.parameters()])
    path = Path(out_dir) / f"weights-rank{ctx.world_rank}.json"
    if not path.exists():
        path.write_text(
            json.dumps({"sum": float(flat.sum()), "sq": float((flat**2).sum()), "head": flat[:20].tolist()})
        )


class StallingPipeline(RecordingPipeline):
    """Rank `stall_rank` stops making progress (sleeps) at global step `stall_at_step`."""

    def __init__(self, out_dir: str, stall_rank: int = 1, stall_at_step: int = 3, num_rows: int = 200):
        super().__init__(out_dir, num_rows=num_rows)
        self.stall_rank, self.stall_at_step = stall_rank, stall_at_step

    def compute_loss(self, model, batch):
        ctx = raytrain.context()
        if model.training and ctx.world_rank == self.stall_rank and ctx.step == self.stall_at_step:
            import time

            (Path(self.out_dir) / "stalled_at").write_text(repr(time.time()))
            time.sleep(3600)
        return super().compute_loss(model, batch)


class SlowDigitsPipeline(DigitsPipeline):
    """digits with a pause per training forward, so a run lasts long enough to resize it
    (until the file `pace_until` exists, when given)."""

    def __init__(self, step_sleep_s: float = 0.25, pace_until: str | None = None):
        self.step_sleep_s = step_sleep_s
        self.pace_until = pace_until

    def compute_loss(self, model, batch):
        if model.training and _paced(self.step_sleep_s, self.pace_until):
            import time

            time.sleep(self.step_sleep_s)
        return super().compute_loss(model, batch)


@dataclass
class PacedDigitsArgs:
    """PacedDigitsPipeline's options from the command line (`--pipeline-arg KEY=VALUE`)."""

    step_sleep_s: float = 0.25
    pace_until: str = ""


class PacedDigitsPipeline(SlowDigitsPipeline):
    """SlowDigitsPipeline for `raytrain train rt_test_pipelines:PacedDigitsPipeline
    --pipeline-arg step_sleep_s=S --pipeline-arg pace_until=FILE`: each worker reads its options
    from the run's config when it builds its model."""

    Args = PacedDigitsArgs

    def __init__(self):
        super().__init__()

    def build_model(self, cfg):
        args = self.args(cfg)
        self.step_sleep_s, self.pace_until = args.step_sleep_s, args.pace_until or None
        return super().build_model(cfg)


def count_preprocessed(out_dir: str):
    """A map_batches step that appends how many rows it preprocessed (from any process)."""

    def step(batch: dict) -> dict:
        with open(Path(out_dir) / "preprocessed.txt", "a") as handle:
            handle.write(f"{len(batch['id'])}\n")
        return {
            "x": np.asarray(batch["x"], dtype=np.float32),
            "y": np.asarray(batch["y"], dtype=np.int64),
            "id": np.asarray(batch["id"]),
        }

    return step


def preprocessed_rows(out_dir) -> int:
    path = Path(out_dir) / "preprocessed.txt"
    return sum(int(line) for line in path.read_text().split()) if path.exists() else 0


def write_id_parquet(
    directory: Path, num_rows: int, num_files: int, nan_at_id: int | None = None, row_group_rows: int | None = None
) -> Path:
    """`num_rows` rows (id, x: 8 floats, y) in `num_files` Parquet files of near-equal size
    (each one row group, or row groups of `row_group_rows`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    features = rng.normal(size=(num_rows, 8)).astype(np.float32)
    if nan_at_id is not None:
        features[nan_at_id, 3] = np.nan
    labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
    for index, (lo, hi) in enumerate(split_range(num_rows, num_files)):
        table = pa.table(
            {"id": np.arange(lo, hi), "y": labels[lo:hi], **{f"f{j}": features[lo:hi, j] for j in range(8)}}
        )
        pq.write_table(table, directory / f"part-{index:03d}.parquet", row_group_size=row_group_rows)
    return directory


@dataclass
class ShardedArgs:
    out: str = ""  # where the ids and counts are recorded
    path: str | None = None  # a Parquet directory (default: from_items)


class ShardedRecordingPipeline(RecordingPipeline):
    """RecordingPipeline over a multi-file Parquet directory (`path`) or, without one, over
    `from_items` in `num_blocks` blocks; its map_batches counts the rows it preprocesses."""

    Args = ShardedArgs

    def __init__(
        self,
        out_dir: str = "",
        path: str | None = None,
        num_rows: int = 1003,
        num_blocks: int = 6,
        crash_at_step: int | None = None,
    ):
        super().__init__(out_dir, num_rows=num_rows, crash_at_step=crash_at_step)
        self.path, self.num_blocks = path, num_blocks

    def build_datasets(self, cfg):
        import ray.data

        # From the command line: --pipeline-arg out=DIR --pipeline-arg path=DIR
        args = self.args(cfg) if cfg is not None else ShardedArgs()
        self.out_dir, self.path = args.out or self.out_dir, args.path or self.path

        if self.path:

            def pack(batch: dict) -> dict:
                return {"id": batch["id"], "y": batch["y"], "x": np.stack([batch[f"f{j}"] for j in range(8)], axis=1)}

            ds = ray.data.read_parquet(self.path).map_batches(pack, batch_format="numpy")
        else:
            rng = np.random.default_rng(7)
            rows = [{"id": i, "x": rng.normal(size=8).astype(np.float32), "y": i % 3} for i in range(self.num_rows)]
            ds = ray.data.from_items(rows, override_num_blocks=self.num_blocks)
        return {"train": ds.map_batches(count_preprocessed(self.out_dir), batch_format="numpy")}


class TiedPipeline(RecordingPipeline):
    """The input and the output projection share one weight (tied), and shard_modules returns
    them as two units: under --strategy fsdp, shard_modules' error."""

    def build_model(self, cfg):
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 3)
        )
        model[2].weight = model[0].weight
        return model

    def shard_modules(self, model):
        return [model[0], model[2]]


class DivergingPipeline(RecordingPipeline):
    """The loss turns NaN from global step `nan_at_step` on rank `nan_rank`."""

    def __init__(self, out_dir: str, nan_at_step: int = 20, nan_rank: int = 1, num_rows: int = 400):
        super().__init__(out_dir, num_rows=num_rows)
        self.nan_at_step, self.nan_rank = nan_at_step, nan_rank

    def compute_loss(self, model, batch):
        loss = super().compute_loss(model, batch)
        ctx = raytrain.context()
        if model.training and ctx.step >= self.nan_at_step and ctx.world_rank == self.nan_rank:
            return loss * float("nan")
        return loss


class BrokenPipeline(RecordingPipeline):
    """User code that fails the same way on every attempt: `where` is build_model, a label out
    of range in compute_loss, or a compute_loss that returns a vector."""

    def __init__(self, out_dir: str, where: str = "build_model"):
        super().__init__(out_dir, num_rows=64)
        self.where = where

    def build_model(self, cfg):
        if self.where == "build_model":
            self._note_attempt()
            return self.make_layers(cfg)
        return super().build_model(cfg)

    def make_layers(self, cfg):
        raise KeyError("hidden_size")  # the user's own bug

    def compute_loss(self, model, batch):
        self._note_attempt()
        logits = model(batch["x"])
        if self.where == "label":
            return F.cross_entropy(logits, batch["y"] + 10)  # labels beyond the 3 classes
        if self.where == "vector":
            return F.cross_entropy(logits, batch["y"], reduction="none")
        return F.cross_entropy(logits, batch["y"])

    def _note_attempt(self):
        marker = Path(self.out_dir) / f"attempt-{os.getpid()}"
        marker.touch()


class NegativeRatePipeline(BrokenPipeline):
    """A schedule of its own that goes below zero after warmup (gradient ascent if taken)."""

    def lr_factor(self, progress):
        self._note_attempt()
        return 1.0 - 2.0 * progress


class DroppingTransformPipeline(BrokenPipeline):
    """An augmentation that loses half of every batch (those samples would never train)."""

    def transform_batch(self, batch, ctx):
        self._note_attempt()
        return {key: value[: len(value) // 2] for key, value in batch.items()}


class OtherShapePipeline(RecordingPipeline):
    """RecordingPipeline with a wider hidden layer: its model cannot load the other's checkpoints."""

    def build_model(self, cfg):
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

    @property
    def name(self) -> str:
        return "RecordingPipeline"


class OptimizerProbePipeline(RecordingPipeline):
    """RecordingPipeline that notes, at its first training step of each attempt, the sum of
    every tensor in the optimizer's state (momentum buffers, Adam/LAMB moments)."""

    def build_optimizer(self, model, cfg):
        self._optimizer = super().build_optimizer(model, cfg)
        return self._optimizer

    def compute_loss(self, model, batch):
        if model.training and not getattr(self, "_probed", False):
            self._probed = True
            ctx = raytrain.context()
            total = sum(
                float(v.double().sum())
                for s in self._optimizer.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.numel() > 1
            )
            with open(Path(self.out_dir) / f"optimizer-state-rank{ctx.world_rank}.jsonl", "a") as handle:
                handle.write(json.dumps({"step": ctx.step, "world_size": ctx.world_size, "state_sum": total}) + "\n")
        return super().compute_loss(model, batch)


class AugmentingPipeline(RecordingPipeline):
    """RecordingPipeline whose transform_batch adds torch noise to x and records its first values."""

    def transform_batch(self, batch, ctx):
        noise = torch.rand(batch["x"].shape)
        if not hasattr(self, "_attempt"):  # once per worker process: rank 1 may see the marker mid-attempt
            self._attempt = "second" if (Path(self.out_dir) / "crashed").exists() else "first"
        with open(Path(self.out_dir) / f"noise-rank{ctx.world_rank}.jsonl", "a") as handle:
            handle.write(
                json.dumps(
                    {
                        "attempt": self._attempt,
                        "epoch": ctx.epoch,
                        "step": ctx.step,
                        "noise": noise.flatten()[:4].tolist(),
                    }
                )
                + "\n"
            )
        return {**batch, "x": batch["x"] + 0.01 * noise}


class IdTorchDataset(torch.utils.data.Dataset):
    """A map-style torch Dataset of (features, label, id) tuples."""

    def __init__(self, num_rows: int):
        rng = np.random.default_rng(3)
        self.x = rng.normal(size=(num_rows, 8)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int64)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return torch.from_numpy(self.x[index]), int(self.y[index]), index


class TorchDatasetPipeline(RecordingPipeline):
    """A torch Dataset returned from build_datasets: its fields arrive as columns '0', '1', '2'."""

    def build_datasets(self, cfg):
        return {"train": IdTorchDataset(self.num_rows)}

    def compute_loss(self, model, batch):
        return super().compute_loss(model, {"x": batch["0"], "y": batch["1"], "id": batch["2"]})


class ReplicaRecordingPipeline(RecordingPipeline):
    """RecordingPipeline for per-step runs: each record names the process, its Ray Train rank
    (its replica) and its place in the step's quorum. Once the run reaches `crash_at_step`,
    every replica in `kill_replica` (one rank or several) exits, on its first process only
    (a marker `killed-replica<R>` each: several die in the same step, as on a lost node); the
    replica `hang_replica` hangs instead once the run reaches `hang_at_step` (a stuck kernel:
    it sleeps in the step and still heartbeats). The replica `slow_replica` takes
    `build_sleep_s` longer to build its model (a slow restore). With `num_blocks`, the rows come
    in that many blocks (the units a streamed run deals to its replicas)."""

    def __init__(
        self,
        out_dir: str,
        num_rows: int = 200,
        crash_at_step: int | None = None,
        step_sleep_s: float = 0.0,
        kill_replica: int | tuple[int, ...] = 1,
        num_blocks: int | None = None,
        hang_at_step: int | None = None,
        hang_replica: int = 1,
        build_sleep_s: float = 0.0,
        slow_replica: int = 1,
        pace_until: str | None = None,
    ):
        super().__init__(out_dir, num_rows, None, step_sleep_s, pace_until=pace_until)
        self.kill_at_step, self.num_blocks = crash_at_step, num_blocks
        self.kill_replicas = (kill_replica,) if isinstance(kill_replica, int) else tuple(kill_replica)
        self.hang_at_step, self.hang_replica = hang_at_step, hang_replica
        self.build_sleep_s, self.slow_replica = build_sleep_s, slow_replica

    def build_model(self, cfg):
        import time

        import ray.train

        try:
            replica = ray.train.get_context().get_world_rank()
        except RuntimeError:  # the driver (a resume checks the checkpoint against the model)
            replica = None
        if self.build_sleep_s and replica == self.slow_replica:
            time.sleep(self.build_sleep_s)
        return super().build_model(cfg)

    def build_datasets(self, cfg):
        if self.num_blocks is None:
            return super().build_datasets(cfg)
        import ray.data

        rng = np.random.default_rng(7)
        rows = [{"id": i, "x": rng.normal(size=8).astype(np.float32), "y": i % 3} for i in range(self.num_rows)]
        return {"train": ray.data.from_items(rows, override_num_blocks=self.num_blocks)}

    def _paced(self) -> bool:
        """Paced until every replica the run kills or hangs has a replacement training: the
        pauses keep the run going until then, and nothing after needs them."""
        victims = (self.kill_replicas if self.kill_at_step is not None else ()) + (
            (self.hang_replica,) if self.hang_at_step is not None else ()
        )
        out = Path(self.out_dir)
        if victims and all((out / f"rejoined-replica{replica}").exists() for replica in victims):
            return False
        return super()._paced()

    def _record(self, ctx, batch):
        import time

        import ray.train

        replica = ray.train.get_context().get_world_rank()
        out = Path(self.out_dir)
        if not getattr(self, "_rejoined", False):  # a replacement's first step: it has rejoined
            for kind in ("killed", "hung"):
                marker = out / f"{kind}-replica{replica}"
                if marker.exists() and json.loads(marker.read_text())["pid"] != os.getpid():
                    (out / f"rejoined-replica{replica}").touch()
                    self._rejoined = True
        marker = out / f"killed-replica{replica}"
        if ctx.step == self.kill_at_step and replica in self.kill_replicas and not marker.exists():
            marker.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os._exit(1)
        marker = out / f"hung-replica{replica}"
        if ctx.step == self.hang_at_step and replica == self.hang_replica and not marker.exists():
            marker.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            time.sleep(3600)
        row = {
            "pid": os.getpid(),
            "replica": replica,
            "rank": ctx.world_rank,
            "world_size": ctx.world_size,
            "epoch": ctx.epoch,
            "step": ctx.step,
            "lr": ctx.lr,
            "time": time.time(),
            "ids": batch["id"].tolist(),
        }
        with open(out / f"ids-replica{replica}.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")


@dataclass
class ReplicaFaultsArgs:
    """ReplicaRecordingPipeline's options from the command line (`--pipeline-arg KEY=VALUE`)."""

    out_dir: str
    num_rows: int = 600
    step_sleep_s: float = 0.3
    kill_at_step: int | None = None
    kill_replicas: str = ""  # ranks, comma-separated
    hang_at_step: int | None = None
    hang_replica: int = 1
    build_sleep_s: float = 0.0
    slow_replica: int = 1


class ReplicaFaultsPipeline(ReplicaRecordingPipeline):
    """ReplicaRecordingPipeline for `raytrain train rt_test_pipelines:ReplicaFaultsPipeline
    --pipeline-arg out_dir=DIR ...`: its options come from the run's config, read when the
    driver builds the datasets and when each worker builds its model."""

    Args = ReplicaFaultsArgs

    def __init__(self):
        super().__init__("")

    def _configure(self, cfg) -> None:
        args = self.args(cfg)
        self.out_dir, self.num_rows, self.step_sleep_s = args.out_dir, args.num_rows, args.step_sleep_s
        self.kill_at_step, self.hang_at_step, self.hang_replica = (
            args.kill_at_step,
            args.hang_at_step,
            args.hang_replica,
        )
        self.kill_replicas = tuple(int(rank) for rank in args.kill_replicas.split(",") if rank)
        self.build_sleep_s, self.slow_replica = args.build_sleep_s, args.slow_replica

    def build_datasets(self, cfg):
        self._configure(cfg)
        return super().build_datasets(cfg)

    def build_model(self, cfg):
        self._configure(cfg)
        return super().build_model(cfg)


class RowsOf:
    """`take` of a sampled dataset over a table: the rows of the drawn items (ids included)."""

    def __init__(self, features: np.ndarray, labels: np.ndarray):
        self.features, self.labels = features, labels

    def __call__(self, items: np.ndarray) -> dict:
        return {"x": self.features[items], "y": self.labels[items], "id": items}


class StepsPipeline(RecordingPipeline):
    """RecordingPipeline for step-based runs: a validation set, its training set walked or
    sampled (`sampled`: a `raytrain.Sampled` of `num_rows` items), its own optimizer (two
    groups) and lr_factor (reading its floor from the run's config through the context), and
    what `raytrain.context()` shows `build_datasets` and `build_optimizer` (plan-*.json)."""

    @dataclass
    class Args:
        floor: float = 0.1
        """The rate's floor, as a fraction of the peak."""

    def __init__(self, out_dir: str, num_rows: int = 64, sampled: bool = False, crash_at_step: int | None = None):
        super().__init__(out_dir, num_rows=num_rows, crash_at_step=crash_at_step)
        self.sampled = sampled

    def build_datasets(self, cfg):
        self._plan("datasets")
        rng = np.random.default_rng(7)
        features = rng.normal(size=(self.num_rows, 8)).astype(np.float32)
        labels = (features[:, 0] > 0).astype(np.int64)
        val = {"x": features[:40] + 0.5, "y": labels[:40], "id": np.arange(40, dtype=np.int64)}
        if self.sampled:
            train = raytrain.Sampled(self.num_rows, RowsOf(features, labels))
        else:
            train = _table_dataset({"x": features, "y": labels, "id": np.arange(self.num_rows, dtype=np.int64)})
        return {"train": train, "val": _table_dataset(val)}

    def build_optimizer(self, model, cfg):
        self._plan("optimizer")
        weights = [p for p in model.parameters() if p.ndim > 1]
        others = [p for p in model.parameters() if p.ndim <= 1]
        return torch.optim.AdamW([{"params": weights}, {"params": others, "weight_decay": 0.0}], lr=cfg.lr)

    def lr_factor(self, progress):
        floor = self.args(raytrain.context().config).floor
        return floor + (1 - floor) * (1 - progress)

    def _plan(self, hook: str) -> None:
        ctx = raytrain.context()
        seen = {
            "global_batch_size": ctx.global_batch_size,
            "batch_size_per_worker": ctx.batch_size_per_worker,
            "world_size": ctx.world_size,
            "max_steps": ctx.max_steps,
            "total_steps": ctx.total_steps,
        }
        Path(self.out_dir, f"plan-{hook}-rank{ctx.world_rank}.json").write_text(json.dumps(seen))

    @property
    def name(self) -> str:
        return "steps"


class StragglingPipeline(RecordingPipeline):
    """Every training forward paced at `step_sleep_s`; rank `slow_rank`'s takes `extra_s` more
    from global step `from_step` on: a slow host every step waits for."""

    def __init__(self, out_dir: str, slow_rank: int = 1, from_step: int = 10, extra_s: float = 0.3, **kwargs):
        super().__init__(out_dir, **kwargs)
        self.slow_rank, self.from_step, self.extra_s = slow_rank, from_step, extra_s

    def compute_loss(self, model, batch):
        ctx = raytrain.context()
        if model.training and ctx.world_rank == self.slow_rank and ctx.step >= self.from_step:
            import time

            time.sleep(self.extra_s)
        return super().compute_loss(model, batch)


class CorruptingPipeline(RecordingPipeline):
    """Silent corruption: at global step `at_step` of the first attempt (a marker file in
    `out_dir`), one weight of rank `rank`'s replica gains `delta`, with no gradient; with
    `every_step`, at every step from `at_step` of every attempt (a deterministic fault)."""

    def __init__(
        self, out_dir: str, rank: int = 1, at_step: int = 12, delta: float = 1.0, every_step: bool = False, **kwargs
    ):
        super().__init__(out_dir, **kwargs)
        self.rank, self.at_step, self.delta, self.every_step = rank, at_step, delta, every_step

    def compute_loss(self, model, batch):
        ctx = raytrain.context()
        marker = Path(self.out_dir) / "corrupted"
        due = ctx.step >= self.at_step if self.every_step else ctx.step == self.at_step and not marker.exists()
        if model.training and ctx.world_rank == self.rank and due:
            with torch.no_grad():
                next(getattr(model, "module", model).parameters()).view(-1)[0] += self.delta
            marker.write_text(str(ctx.step))
        return super().compute_loss(model, batch)
