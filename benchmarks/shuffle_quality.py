"""Shuffle quality of the streamed order on data stored sorted by label.

A dataset of 10 classes is stored sorted by label in `--units` units (files or row groups of
`--unit-rows` rows each: one label per unit, or two at a class boundary). For batches of
`--batch` rows, the figure is the mean total-variation distance between a batch's label mix
and the whole dataset's: 0 is perfectly mixed, 0.9 is one label per batch. Compared:

- full: a uniform permutation of all rows (what the in-memory path does);
- window: the previous streamed design, the stored order cut into consecutive windows of
  `window` rows, each permuted, visited in stored order;
- lanes: raytrain's streamed order (`raytrain.rules.order`): units in a new order each epoch, dealt
  to `--partitions` lanes, shuffled within blocks, lanes interleaved.

Pure numpy, no Ray; prints a Markdown table. Usage:

    python benchmarks/shuffle_quality.py [--units 40] [--unit-rows 250] [--windows 250,1000,4000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytrain.rules import order

CLASSES = 10


def batches(labels: np.ndarray, ids_per_step: list[np.ndarray]) -> list[np.ndarray]:
    return [labels[ids] for ids in ids_per_step]


def ranges(n: int, batch: int) -> list[np.ndarray]:
    return [np.arange(lo, min(n, lo + batch)) for lo in range(0, n, batch)]


def measure(units: int, unit_rows: int, window: int, partitions: int, batch: int, epochs: int) -> dict[str, float]:
    n = units * unit_rows
    labels = np.repeat(np.arange(CLASSES), -(-n // CLASSES))[:n]
    out = {"full": [], "window": [], "lanes": []}
    layout = order.StreamLayout(unit_rows=(unit_rows,) * units, window_rows=window, partitions=partitions)
    for epoch in range(epochs):
        permutation = np.random.default_rng([0, epoch]).permutation(n)
        out["full"].append(order.label_mix_distance([labels[permutation[r]] for r in ranges(n, batch)], CLASSES))
        windowed = np.concatenate(
            [
                start + np.random.default_rng([0, epoch, start]).permutation(min(window, n - start))
                for start in range(0, n, window)
            ]
        )
        out["window"].append(order.label_mix_distance([labels[windowed[r]] for r in ranges(n, batch)], CLASSES))
        out["lanes"].append(
            order.label_mix_distance(batches(labels, order.epoch_step_ids(layout, 0, epoch, batch)), CLASSES)
        )
    return {name: float(np.mean(values)) for name, values in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=40)
    parser.add_argument("--unit-rows", type=int, default=250)
    parser.add_argument("--windows", default="250,1000,4000")
    parser.add_argument("--partitions", default="24,8,1")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{args.units} units × {args.unit_rows} rows sorted by label ({CLASSES} classes), batches of {args.batch}, "
        f"mean over {args.epochs} epochs; 0 = perfectly mixed, {1 - 1 / CLASSES:.1f} = one label per batch\n"
    )
    print("| window rows | partitions | full shuffle | previous window | raytrain lanes |")
    print("|---:|---:|---:|---:|---:|")
    for window in (int(w) for w in args.windows.split(",")):
        for partitions in (int(p) for p in args.partitions.split(",")):
            q = measure(args.units, args.unit_rows, window, partitions, args.batch, args.epochs)
            print(f"| {window:,} | {partitions} | {q['full']:.3f} | {q['window']:.3f} | {q['lanes']:.3f} |")


if __name__ == "__main__":
    main()
