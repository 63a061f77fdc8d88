"""A map-style torch Dataset into Ray Data: `ray.data.from_torch` vs raytrain's parallel read
over index ranges (`raytrain.data.torch_dataset.from_torch_dataset`: `ray.data.range` + a map_batches that
fetches each task's indices).

The dataset has `--rows` samples of (`--features` float32, label), each `__getitem__` costing
`--item-us` microseconds of real work (a small matmul). Both paths are read to the end into
numpy columns, `--rounds` times, alternating; printed: rows/s and the ratio. Usage:

    python benchmarks/torch_input.py [--rows 20000] [--features 64] [--item-us 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Work(torch.utils.data.Dataset):
    def __init__(self, rows: int, features: int, item_us: float):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(rows, features)).astype(np.float32)
        self.y = rng.integers(0, 10, rows)
        self.matrix = torch.randn(features, features)
        self.repeats = max(1, int(item_us / 5))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        x = torch.from_numpy(self.x[index])
        for _ in range(self.repeats):  # the per-sample work a decode or transform would do
            x = torch.tanh(self.matrix @ x)
        return x, int(self.y[index])


def via_from_torch(dataset):
    import ray.data

    def to_columns(batch):
        items = batch["item"]
        return {"0": np.stack([np.asarray(item[0]) for item in items]), "1": np.asarray([item[1] for item in items])}

    return ray.data.from_torch(dataset).map_batches(to_columns, batch_format="numpy")


def via_index_ranges(dataset):
    from raytrain.data.torch_dataset import from_torch_dataset

    return from_torch_dataset(dataset, "train")


def read_all(ds) -> int:
    return sum(len(batch["1"]) for batch in ds.iter_batches(batch_size=4096, batch_format="numpy"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--item-us", type=float, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    dataset = Work(args.rows, args.features, args.item_us)
    rates: dict[str, list[float]] = {"from_torch": [], "index ranges": []}
    for round_index in range(args.rounds):
        for name, make in (("from_torch", via_from_torch), ("index ranges", via_index_ranges))[
            :: 1 if round_index % 2 == 0 else -1
        ]:
            started = time.perf_counter()
            rows = read_all(make(dataset))
            seconds = time.perf_counter() - started
            assert rows == args.rows
            rates[name].append(rows / seconds)
            print(
                f"round {round_index + 1}: {name}: {rows:,} rows in {seconds:.1f} s = {rows / seconds:,.0f} rows/s",
                flush=True,
            )
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(
        f"median rows/s: from_torch {medians['from_torch']:,.0f}, index ranges {medians['index ranges']:,.0f} "
        f"(×{medians['index ranges'] / medians['from_torch']:.2f}) on {ray.cluster_resources().get('CPU', 0):g} CPUs"
    )


if __name__ == "__main__":
    main()
