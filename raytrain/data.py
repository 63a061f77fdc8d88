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

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


class DataError(ValueError):
    """A dataset that cannot be trained on, naming the dataset and column."""


@dataclass
class Table:
    """Columns of equal length, as numpy arrays."""

    columns: dict[str, np.ndarray]
    dropped_rows: int = 0  # rows skipped for NaN/inf (with skip_nan_rows)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def batch(self, rows: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        non_blocking = device.type == "cuda"
        return {name: torch.from_numpy(np.ascontiguousarray(col[rows])).to(device, non_blocking=non_blocking) for name, col in self.columns.items()}


def read_table(iterator, name: str, *, skip_nan_rows: bool = False, read_batch_size: int = 4096) -> Table:
    """Read every row of a Ray Data dataset (or its iterator) into a checked Table.

    Raises DataError naming the dataset, column and row for: no rows, columns that
    change between blocks, non-numeric or ragged values, NaN/inf values (unless
    `skip_nan_rows`: those rows are dropped and counted in `Table.dropped_rows`).
    """
    parts: dict[str, list[np.ndarray]] = {}
    try:
        for batch in iterator.iter_batches(batch_size=read_batch_size, batch_format="numpy"):
            if parts and set(batch) != set(parts):
                raise DataError(f"dataset {name!r}: columns changed between blocks ({sorted(parts)} vs {sorted(batch)})")
            for column, values in batch.items():
                parts.setdefault(column, []).append(np.asarray(values))
    except DataError:
        raise
    except Exception as exc:  # reading or preprocessing failed inside Ray Data (bad file, user map fn)
        raise DataError(f"dataset {name!r} cannot be read: {_first_error_line(exc)}") from None
    if not parts:
        raise DataError(f"dataset {name!r} is empty: it yielded no rows; check the pipeline's build_datasets and its input files")
    columns = {}
    for column, chunks in parts.items():
        try:
            values = np.concatenate(chunks)
        except ValueError:
            shapes = sorted({c.shape[1:] for c in chunks})
            raise DataError(f"dataset {name!r}, column {column!r}: rows of different shapes {shapes}; every row must have one shape") from None
        if values.dtype == object or not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise DataError(
                f"dataset {name!r}, column {column!r}: dtype {values.dtype} is not numeric ({values[:1]!r}...); "
                "convert it in the pipeline (e.g. map_batches) to numbers of one shape per row"
            )
        columns[column] = values
    table = Table(columns)
    bad = _non_finite_rows(table)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        column = next(c for c, v in table.columns.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v[first]).all())
        if not skip_nan_rows:
            raise DataError(
                f"dataset {name!r}: {int(bad.sum())} row(s) hold NaN or inf, the first is row {first} in column {column!r}; "
                "clean the data, or pass --skip-nan-rows to drop such rows (they are counted and reported)"
            )
        keep = ~bad
        table = Table({c: v[keep] for c, v in table.columns.items()}, dropped_rows=int(bad.sum()))
        if len(table) == 0:
            raise DataError(f"dataset {name!r}: every row holds NaN or inf; nothing is left to train on")
    return table


def _non_finite_rows(table: Table) -> np.ndarray:
    bad = np.zeros(len(table), dtype=bool)
    for values in table.columns.values():
        if np.issubdtype(values.dtype, np.floating):
            bad |= ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    return bad


def fingerprint(table: Table) -> str:
    """A digest of the table's rows in order: ranks compare it to be sure they read the same rows."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(table.columns):
        values = np.ascontiguousarray(table.columns[name])
        digest.update(name.encode())
        digest.update(str(values.dtype).encode() + str(values.shape).encode())
        digest.update(values.tobytes())
    return digest.hexdigest()


def _first_error_line(exc: Exception) -> str:
    """The innermost `Type: message` line of a (possibly Ray-wrapped) exception."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    typed = [line for line in lines if ":" in line and line.split(":", 1)[0].replace(".", "").replace("_", "").isalnum() and line.split(":", 1)[0].endswith(("Error", "Exception", "Invalid"))]
    return (typed[-1] if typed else (lines[-1] if lines else type(exc).__name__))[:500]
