"""Ingest throughput: raytrain's data path against a torch DataLoader over the same rows.

One process, one pass (an epoch) over the same rows in batches of `--batch` rows,
alternating the contenders for `--rounds` rounds; the figures are medians:

- dataloader: `torch.utils.data.DataLoader(TensorDataset(x, y), shuffle=True,
  num_workers=0)` over tensors in memory — the classic template's input path;
- raytrain, in memory: the columns as the workers hold them (`raytrain.data.checks.Table`), a full
  permutation per epoch, batches cut by position;
- raytrain, streamed: `raytrain.data.checks.Stream` over `ray.data.read_parquet` of the same rows
  written as Parquet, shuffled within windows of `--window` rows (what
  `--shuffle-window-rows` does on every worker), with the process's peak extra resident
  memory while it streams — it should stay near a few windows, not the dataset's size;
- ray data: Ray Data's own `iter_torch_batches(local_shuffle_buffer_size=window)` over the
  same Parquet files, for reference.

Rows/s include building the batch tensors; the ratios are against the DataLoader measured
in the same round. Usage:

    python benchmarks/ingest.py --rows 1000000 --features 32 --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from raytrain.data.checks import scan  # noqa: E402
from raytrain.data.stream import Stream  # noqa: E402
from raytrain.data.table import Table  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class PeakRss:
    """The highest resident memory of this process above its level at start, sampled."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s, self.start, self.peak = interval_s, rss_bytes(), 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.done.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes() - self.start)

    def __enter__(self) -> "PeakRss":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss_bytes() - self.start)


def write_parquet(x: np.ndarray, y: np.ndarray, out: Path, files: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    out.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(np.array_split(np.arange(len(y)), files)):
        lo, hi = int(part[0]), int(part[-1]) + 1
        table = pa.table({"x": ArrowTensorArray.from_numpy(x[lo:hi]), "y": y[lo:hi]})
        pq.write_table(table, out / f"part-{index:04d}.parquet", row_group_size=16384)


def run_dataloader(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int) -> int:
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=batch,
        shuffle=True,
        num_workers=0,
        generator=torch.Generator().manual_seed(seed),
    )
    rows = 0
    for xb, _ in loader:
        rows += len(xb)
    return rows


def run_positions(source, num_rows: int, batch: int, seed: int, epoch: int) -> int:
    data = source.epoch(seed, epoch, 0)
    rows = 0
    for lo in range(0, num_rows, batch):
        got = data.batch(lo, min(num_rows, lo + batch), torch.device("cpu"))
        rows += len(got["y"])
    return rows


def run_ray_data(parquet: Path, batch: int, window: int, seed: int) -> int:
    import ray.data

    rows = 0
    ds = ray.data.read_parquet(str(parquet))
    for got in ds.iter_torch_batches(batch_size=batch, local_shuffle_buffer_size=window, local_shuffle_seed=seed):
        rows += len(got["y"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--window", type=int, default=65_536)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import ray
    from ray.data import DataContext

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    context = DataContext.get_current()
    context.enable_progress_bars = False
    context.execution_options.preserve_order = True  # what raytrain's workers use
    torch.set_num_threads(1)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, args.features)).astype(np.float32)
    y = rng.integers(0, 10, size=args.rows).astype(np.int64)
    dataset_bytes = x.nbytes + y.nbytes
    with tempfile.TemporaryDirectory(prefix="rt-ingest-") as tmp:
        parquet = Path(tmp) / "rows"
        write_parquet(x, y, parquet, args.files)
        started = time.perf_counter()
        checked = scan(ray.data.read_parquet(str(parquet)), "train", keep_bytes=0, window_rows=args.window)
        scan_s = time.perf_counter() - started
        stream = Stream(
            ray.data.read_parquet(str(parquet)), "train", checked.num_rows, checked.window_rows, checked.window_digests
        )
        table = Table({"x": x, "y": y})
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        contenders = {
            "dataloader": lambda r: run_dataloader(xt, yt, args.batch, r),
            "raytrain, in memory": lambda r: run_positions(table, args.rows, args.batch, 0, r),
            "raytrain, streamed": lambda r: run_positions(stream, args.rows, args.batch, 0, r),
            "ray data iter_torch_batches": lambda r: run_ray_data(parquet, args.batch, args.window, r),
        }
        results: dict[str, list[float]] = {name: [] for name in contenders}
        peaks: dict[str, list[int]] = {name: [] for name in contenders}
        ratios: dict[str, list[float]] = {name: [] for name in contenders}
        for round_ in range(args.rounds):
            names = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
            rates = {}
            for name in names:
                with PeakRss() as peak:
                    tick = time.perf_counter()
                    rows = contenders[name](round_)
                    seconds = time.perf_counter() - tick
                assert rows == args.rows, (name, rows)
                rates[name] = rows / seconds
                results[name].append(rates[name])
                peaks[name].append(peak.peak)
            for name in contenders:
                ratios[name].append(rates[name] / rates["dataloader"])
            print(f"round {round_ + 1}: " + ", ".join(f"{n} {rates[n]:,.0f}" for n in contenders), flush=True)
    ray.shutdown()

    load = os.getloadavg()
    print(
        f"\n{args.rows:,} rows × {args.features} float32 features + an int64 label ({dataset_bytes / 2**20:,.0f} MiB), "
        f"batch {args.batch}, window {checked.window_rows:,} rows "
        f"({checked.window_rows * dataset_bytes / args.rows / 2**20:,.1f} MiB), "
        f"{args.files} Parquet files; driver-side check pass {scan_s:.1f} s; load average {load[0]:.1f} / "
        f"{load[1]:.1f} / {load[2]:.1f}\n"
    )
    print("| contender | rows/s (median) | vs DataLoader (median of per-round ratios) | peak extra RSS |")
    print("|---|---:|---:|---:|")
    for name in contenders:
        print(
            f"| {name} | {statistics.median(results[name]):,.0f} | {statistics.median(ratios[name]):.2f} | "
            f"{max(peaks[name]) / 2**20:,.0f} MiB |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "rows_per_s": results,
                    "ratios": ratios,
                    "peak_rss": peaks,
                    "scan_s": scan_s,
                    "load": load,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
