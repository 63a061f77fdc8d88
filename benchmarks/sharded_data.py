"""The sharded data plane, measured: reads per epoch, time to the first step, memory.

The data are Parquet files of `--unit-rows`-row row groups (id, label, 32 float32 features);
the pipeline (`CountingParquet`) reads them with `ray.data.read_parquet`, packs the features
in `map_batches` and counts, from whatever process runs it, every row it preprocesses. Three
studies, each a set of fresh `raytrain train` processes on an embedded Ray:

- reads: rows preprocessed per epoch / rows, at 1, 2 and 3 workers (target <= 1.1);
- startup: seconds from the command to rank 0's first step, at 1×, 10× and 100× `--rows`
  (target: ratio <= 1.2), streamed (`--shuffle-window-rows`) and with the default choice;
- memory: peak RSS of each training worker while streaming, and its private part (RSS minus
  the shared object-store pages it has mapped), at 1× and 10× the rows.

Usage:

    python benchmarks/sharded_data.py reads   [--rows 100000] [--workers 1,2,3] [--epochs 3]
    python benchmarks/sharded_data.py startup [--rows 20000] [--scales 1,10,100] [--rounds 2]
    python benchmarks/sharded_data.py memory  [--rows 200000] [--scales 1,10] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import raytrain  # noqa: E402

FEATURES = 32


def write_data(directory: Path, rows: int, unit_rows: int, groups_per_file: int = 16) -> Path:
    """`rows` rows in files of `groups_per_file` row groups of `unit_rows` rows (skipped if present)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = directory / "_rows"
    if done.exists() and int(done.read_text()) == rows:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.parquet"):
        old.unlink()
    rng = np.random.default_rng(0)
    per_file = unit_rows * groups_per_file
    for index, start in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - start)
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        columns = {"id": np.arange(start, start + n), "label": (x[:, 0] > 0).astype(np.int64)}
        columns.update({f"f{j}": x[:, j] for j in range(FEATURES)})
        pq.write_table(pa.table(columns), directory / f"part-{index:05d}.parquet", row_group_size=unit_rows)
    done.write_text(str(rows))
    return directory


@dataclass
class CountingParquetArgs:
    path: str
    out: str


class CountingParquet(raytrain.Pipeline):
    """--pipeline-arg path=DIR --pipeline-arg out=DIR: an MLP on the Parquet files; counts the rows
    its map_batches preprocesses, notes rank 0's first step and each worker's peak RSS."""

    Args = CountingParquetArgs
    default_config = {"epochs": 1, "global_batch_size": 256, "lr": 1e-3}

    def __init__(self):
        self.out = None
        self.first_marked = False
        self.steps = 0
        self.peak_private_mib = 0.0

    def build_datasets(self, cfg):
        import ray.data

        path, out = cfg.pipeline_args["path"], cfg.pipeline_args["out"]
        self.out = out

        def pack(batch: dict) -> dict:
            with open(Path(out) / f"rows-{os.getpid()}.txt", "a") as handle:
                handle.write(f"{len(batch['id'])}\n")
            features = np.stack([batch[f"f{j}"] for j in range(FEATURES)], axis=1).astype(np.float32)
            return {"x": features, "y": np.asarray(batch["label"], dtype=np.int64)}

        return {"train": ray.data.read_parquet(path).map_batches(pack, batch_format="numpy")}

    def build_model(self, cfg):
        import torch

        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def compute_loss(self, model, batch):
        import torch.nn.functional as F

        ctx = raytrain.context()
        if model.training:
            if not self.first_marked and ctx.world_rank == 0:
                self.first_marked = True
                Path(self.out, "first_step").write_text(repr(time.time()))
            self.steps += 1
            if self.steps % 20 == 1:
                # RSS counts the object-store pages this process has mapped (shared, bounded by
                # the store); the private part (RSS - shared) is what the worker itself holds.
                info = psutil.Process().memory_info()
                self.peak_private_mib = max(self.peak_private_mib, (info.rss - info.shared) / 2**20)
                peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                Path(self.out, f"rss-rank{ctx.world_rank}.txt").write_text(f"{peak_mib:.1f}\n")
                Path(self.out, f"private-rank{ctx.world_rank}.txt").write_text(f"{self.peak_private_mib:.1f}\n")
        return F.cross_entropy(model(batch["x"]), batch["y"])

    @property
    def name(self) -> str:
        return "counting-parquet"


def train(
    data: Path, workers: int, epochs: int, extra: list[str], until_first_step: bool = False
) -> tuple[Path, float]:
    """One `raytrain train` process; returns its out directory and start time. With
    `until_first_step`, the run is stopped (SIGTERM) once rank 0 has begun its first step."""
    out = Path(tempfile.mkdtemp(prefix="sharded-bench-"))
    command = [
        str(Path(sys.executable).with_name("raytrain")),
        "train",
        "benchmarks.sharded_data:CountingParquet",
        "--pipeline-arg",
        f"path={data}",
        "--pipeline-arg",
        f"out={out}",
        "--workers",
        str(workers),
        "--epochs",
        str(epochs),
        "--storage",
        str(out / "runs"),
        "--progress",
        "off",
        *extra,
    ]
    started = time.time()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if until_first_step:
        while process.poll() is None and not (out / "first_step").exists():
            time.sleep(0.2)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=3600)
    if process.returncode not in (0, 143):
        raise RuntimeError(f"raytrain train failed ({process.returncode}):\n{stdout[-1500:]}\n{stderr[-3000:]}")
    return out, started


def preprocessed(out: Path) -> int:
    return sum(int(line) for path in out.glob("rows-*.txt") for line in path.read_text().split())


def study_reads(args) -> dict:
    data = write_data(Path(args.data_dir) / f"rows-{args.rows}", args.rows, args.unit_rows)
    results = {}
    for workers in (int(w) for w in args.workers.split(",")):
        out, _ = train(data, workers, args.epochs, ["--shuffle-window-rows", str(args.window)])
        passes = preprocessed(out) / (args.epochs * args.rows)
        results[workers] = passes
        print(
            f"reads: {workers} worker(s): {preprocessed(out):,} rows preprocessed over {args.epochs} epochs of "
            f"{args.rows:,} "
            f"rows = {passes:.3f} passes per epoch",
            flush=True,
        )
    return {"rows": args.rows, "epochs": args.epochs, "passes_per_epoch": results}


def study_startup(args) -> dict:
    results: dict[str, dict[int, list[float]]] = {"streamed": {}, "default": {}}
    scales = [int(s) for s in args.scales.split(",")]
    for scale in scales:
        write_data(Path(args.data_dir) / f"rows-{args.rows * scale}", args.rows * scale, args.unit_rows)
    for round_index in range(args.rounds):
        for mode, extra in (("streamed", ["--shuffle-window-rows", str(args.window)]), ("default", [])):
            for scale in scales if round_index % 2 == 0 else scales[::-1]:
                data = Path(args.data_dir) / f"rows-{args.rows * scale}"
                out, started = train(data, args.workers_one, 1, extra + ["--epochs", "1"], until_first_step=True)
                seconds = float((out / "first_step").read_text()) - started
                results[mode].setdefault(scale, []).append(seconds)
                print(
                    f"startup: round {round_index + 1}, {mode}, {args.rows * scale:,} rows: first step after "
                    f"{seconds:.1f} s",
                    flush=True,
                )
    medians = {mode: {scale: statistics.median(v) for scale, v in runs.items()} for mode, runs in results.items()}
    ratios = {mode: {scale: m[scale] / m[scales[0]] for scale in scales} for mode, m in medians.items()}
    for mode in medians:
        print(
            f"startup ({mode}): "
            + ", ".join(f"{args.rows * s:,} rows {medians[mode][s]:.1f} s (×{ratios[mode][s]:.2f})" for s in scales)
        )
    return {"rows": args.rows, "runs": results, "median_s": medians, "ratio_to_1x": ratios}


def study_memory(args) -> dict:
    results = {}
    for scale in (int(s) for s in args.scales.split(",")):
        rows = args.rows * scale
        data = write_data(Path(args.data_dir) / f"rows-{rows}", rows, args.unit_rows)
        out, _ = train(data, args.workers_one, 1, ["--shuffle-window-rows", str(args.window)])
        peaks = {p.stem: float(p.read_text()) for p in sorted(out.glob("rss-rank*.txt"))}
        private = {p.stem: float(p.read_text()) for p in sorted(out.glob("private-rank*.txt"))}
        dataset_mib = rows * (FEATURES * 4 + 8) / 2**20
        results[rows] = {"peak_rss_mib": peaks, "peak_private_mib": private, "dataset_mib": dataset_mib}
        print(
            f"memory: {rows:,} rows (~{dataset_mib:,.0f} MiB as arrays), {args.workers_one} workers: peak RSS "
            + ", ".join(f"{k} {v:,.0f} MiB" for k, v in peaks.items())
            + "; peak private (RSS - shared) "
            + ", ".join(f"{k} {v:,.0f} MiB" for k, v in private.items()),
            flush=True,
        )
    return {"window": args.window, "unit_rows": args.unit_rows, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=["reads", "startup", "memory"])
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--unit-rows", type=int, default=1024, help="rows per Parquet row group")
    parser.add_argument("--window", type=int, default=8192, help="--shuffle-window-rows for the streamed runs")
    parser.add_argument("--workers", default="1,2,3", help="reads: worker counts")
    parser.add_argument("--workers-one", type=int, default=2, help="startup, memory: the worker count")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--scales", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "raytrain-sharded-bench"))
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    defaults = {"reads": (100_000, None), "startup": (20_000, "1,10,100"), "memory": (200_000, "1,10")}[args.study]
    args.rows = args.rows or defaults[0]
    args.scales = args.scales or defaults[1]
    figures = {"reads": study_reads, "startup": study_startup, "memory": study_memory}[args.study](args)
    figures.update({"date": time.strftime("%Y-%m-%d"), "load_average_at_end": list(os.getloadavg())})
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
