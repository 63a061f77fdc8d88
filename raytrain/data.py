"""The data layer: rows from Ray Data, batches cut by the pure plan in `raytrain.plan`.

Every rank reads the same (unsplit) dataset into a column table and takes, for each
optimizer step, its slice of the epoch's global order. The order depends on
(seed, epoch) only and the position in it is a single offset, so:

- every row is trained on exactly once per epoch, the tail included (no padding,
  nothing dropped);
- all ranks run the same number of steps (they compute it from the same numbers);
- an interrupted epoch continues from the stored offset at any worker count.

The cost is memory: each worker holds the training table (for `digits`, 0.5 MB).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class DataError(ValueError):
    """A dataset that cannot be trained on, naming the dataset and column."""


@dataclass
class Table:
    """Columns of equal length, as numpy arrays."""

    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def batch(self, rows: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        non_blocking = device.type == "cuda"
        return {name: torch.from_numpy(np.ascontiguousarray(col[rows])).to(device, non_blocking=non_blocking) for name, col in self.columns.items()}


def read_table(iterator, name: str, read_batch_size: int = 4096) -> Table:
    """Read every row of a Ray Data dataset (or its iterator) into a Table."""
    parts: dict[str, list[np.ndarray]] = {}
    for batch in iterator.iter_batches(batch_size=read_batch_size, batch_format="numpy"):
        if parts and set(batch) != set(parts):
            raise DataError(f"dataset {name!r}: columns changed between blocks ({sorted(parts)} vs {sorted(batch)})")
        for column, values in batch.items():
            parts.setdefault(column, []).append(np.asarray(values))
    if not parts:
        raise DataError(f"dataset {name!r} is empty: it yielded no rows; check the pipeline's build_datasets")
    columns = {}
    for column, chunks in parts.items():
        values = np.concatenate(chunks)
        if values.dtype == object:
            raise DataError(
                f"dataset {name!r}, column {column!r}: values of mixed or ragged shape ({chunks[0][:1]!r}...); "
                "every row must have the same shape and a numeric dtype"
            )
        columns[column] = values
    return Table(columns)
