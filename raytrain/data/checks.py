"""Checked rows: the columns of every batch a run reads are numeric, of one shape per row,
the first batch's columns, and finite; a unit read through Ray Data yields exactly the rows
its metadata counts. Every problem is a DataError naming the dataset, the file or row and
the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from raytrain.errors import DataError, find_user_error, innermost_error

# How many of Ray Data's output blocks a reading rank keeps in flight ahead of training.
PREFETCH_BLOCKS = 2
# Without --shuffle-window-rows, a dataset estimated (from metadata and a first batch) at
# no more than this is held in memory; a larger one is streamed.
IN_MEMORY_LIMIT_BYTES = 1 << 30
# The shuffle window of an automatically streamed dataset: about this many bytes of rows
# across the job, never fewer than MIN_WINDOW_ROWS rows.
AUTO_WINDOW_BYTES = 256 << 20
MIN_WINDOW_ROWS = 4096


@dataclass(frozen=True)
class Schema:
    """Column names, dtypes and per-row shapes, from a first batch read on the driver."""

    columns: tuple[tuple[str, str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, batch: dict[str, np.ndarray]) -> "Schema":
        return cls(tuple((name, str(values.dtype), tuple(values.shape[1:])) for name, values in batch.items()))

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.columns]

    def row_bytes(self) -> int:
        return max(1, sum(np.dtype(dtype).itemsize * int(np.prod(shape)) for _, dtype, shape in self.columns))


def check_columns(batch: dict, name: str, where: str, schema: Schema | None = None) -> dict[str, np.ndarray]:
    """The batch as numpy columns, checked: numeric, one shape per row, the schema's columns.
    Raises DataError naming the dataset, `where` (a file, a row) and the fix."""
    columns = {}
    for column, values in batch.items():
        values = np.asarray(values)
        if values.dtype == object and len(values) and isinstance(values[0], (tuple, list)):
            raise DataError(
                f"dataset {name!r}, column {column!r} ({where}) holds tuples ({_preview(values)}): ray.data.from_torch "
                "gives one 'item' column of (input, target) samples. Return the torch Dataset itself from "
                "build_datasets — raytrain makes each field a column, '0', '1', ... (or the keys of dict samples) — or "
                "split it in map_batches"
            )
        if values.dtype == object or not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise DataError(
                f"dataset {name!r}, column {column!r} ({where}): dtype {values.dtype} is not numeric "
                f"({_preview(values)}); convert it in the pipeline (e.g. map_batches) to numbers of one shape per row"
            )
        columns[column] = values
    if schema is None:
        return columns
    if sorted(columns) != sorted(schema.names):
        raise DataError(
            f"dataset {name!r} ({where}): columns {sorted(columns)} differ from the first batch's "
            f"{sorted(schema.names)}; every batch must have the same columns"
        )
    for column, _, shape in schema.columns:
        if tuple(columns[column].shape[1:]) != shape:
            raise DataError(
                f"dataset {name!r}, column {column!r} ({where}): rows of shape {tuple(columns[column].shape[1:])} "
                f"where the first batch had {shape}; every row must have one shape"
            )
    return columns


def non_finite(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Rows holding NaN or inf in any float column."""
    n = num_rows(batch)
    bad = np.zeros(n, dtype=bool)
    for values in batch.values():
        if np.issubdtype(values.dtype, np.floating):
            bad |= ~np.isfinite(values.reshape(n, -1)).all(axis=1)
    return bad


def nan_error(name: str, where: str, batch: dict[str, np.ndarray], bad: np.ndarray) -> DataError:
    index = int(np.flatnonzero(bad)[0])
    column = next(
        c for c, v in batch.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v[index]).all()
    )
    return DataError(
        f"dataset {name!r}: row {index} of {where} holds NaN or inf in column {column!r} ({int(bad.sum())} such "
        "row(s) there); clean the data, or pass --skip-nan-rows to drop such rows (they are counted and reported); "
        "then --resume continues from the last checkpoint"
    )


# -- reading units ------------------------------------------------------------------------------


@dataclass
class Unit:
    """One unit's rows as read and checked; `valid` is False for rows skipped for NaN/inf."""

    columns: dict[str, np.ndarray]
    valid: np.ndarray | None = None  # None: every row valid


def check_units(
    units, ids: Sequence[int], name: str, schema: Schema, *, skip_nan_rows: bool
) -> Iterator[tuple[int, Unit]]:
    """Read units `ids` of a `raytrain.data.shards.Units` in that order with Ray Data and yield
    each one complete and checked. Rows are assigned to units by the row counts known from
    metadata; a unit whose preprocessing yields another number of rows is an error."""
    ids = [i for i in ids if units.rows[i]]
    if not ids:
        return
    expected = [units.rows[i] for i in ids]
    pending: list[dict[str, np.ndarray]] = []
    have, position = 0, 0  # rows gathered for unit ids[position]
    try:
        batches = units.dataset(ids).iter_batches(
            batch_size=None, batch_format="numpy", prefetch_batches=PREFETCH_BLOCKS
        )
        for raw in batches:
            batch = check_columns(raw, name, f"{units.labels[ids[min(position, len(ids) - 1)]]}", schema)
            while num_rows(batch):
                if position == len(ids):
                    raise _count_error(units, ids, name, expected, extra=True)
                take = min(expected[position] - have, num_rows(batch))
                pending.append({c: v[:take] for c, v in batch.items()})
                batch = {c: v[take:] for c, v in batch.items()}
                have += take
                while position < len(ids) and have == expected[position]:
                    yield ids[position], _finish_unit(pending, units.labels[ids[position]], name, skip_nan_rows)
                    pending, have, position = [], 0, position + 1
    except DataError as error:
        raise with_file_cause(units, name, error) from None
    except Exception as exc:  # reading or preprocessing failed inside Ray Data (a bad file, the pipeline's map fn)
        raise read_error(units, ids[position:] or ids[-1:], name, exc) from None
    if position < len(ids):
        raise _count_error(units, ids[position:], name, expected[position:], got=have)


def _finish_unit(pending: list[dict[str, np.ndarray]], label: str, name: str, skip_nan_rows: bool) -> Unit:
    columns = concat(pending)
    bad = non_finite(columns)
    if not bad.any():
        return Unit(columns)
    if not skip_nan_rows:
        raise nan_error(name, label, columns, bad)
    return Unit(columns, valid=~bad)


def _count_error(units, ids, name, expected, *, got: int = 0, extra: bool = False) -> DataError:
    if extra:
        what = f"its preprocessing yielded more rows than the {sum(expected):,} its metadata counts"
    else:
        short, ended = sum(expected) - got, units.labels[ids[0]]
        what = (
            f"its preprocessing yielded {short:,} row(s) fewer than its metadata counts (the stream ended in {ended})"
        )
    return DataError(
        f"dataset {name!r}: {what}; streamed and sharded reading needs preprocessing that keeps every row "
        "(map_batches returning one row per input row). Drop rows when writing the data, or hold it in memory "
        "with --shuffle-window-rows 0"
    )


def load_table(units, name: str, schema: Schema, skip_nan_rows: bool) -> dict[str, Any]:
    """Read and check every unit once (run in a Ray task by the driver): the columns of an
    in-memory dataset, and how many rows were skipped for NaN/inf."""
    kept, dropped = [], 0
    for _, unit in check_units(units, list(range(len(units.rows))), name, schema, skip_nan_rows=skip_nan_rows):
        if unit.valid is not None:
            dropped += int((~unit.valid).sum())
            unit.columns = {c: v[unit.valid] for c, v in unit.columns.items()}
        if num_rows(unit.columns):
            kept.append(unit.columns)
    if not kept:
        raise DataError(f"dataset {name!r}: every row holds NaN or inf; nothing is left to train on")
    return {"columns": concat(kept), "dropped_rows": dropped}


def read_error(units, ids: Sequence[int], name: str, exc: BaseException) -> DataError:
    """A failed read of units `ids` (the first the failure can be in): a DataError raised in Ray
    Data's tasks (a torch sample's check) as it was; else the file behind it, named with what is
    wrong and the fix (`raytrain.data.files`); else the error Ray Data gave."""
    from raytrain.data.files import explain_read_error

    fault = data_error_in(exc)
    if fault is not None:
        return fault
    return explain_read_error(units, ids, name) or DataError(
        f"dataset {name!r} cannot be read: {innermost_error(exc)} (while reading {units.labels[ids[0]]} or the units "
        "after it); check those files, or the pipeline's own steps over them (map_batches)"
    )


_DATA_ERROR = f"{DataError.__module__}.{DataError.__name__}: "


def data_error_in(exc: BaseException) -> DataError | None:
    """The DataError a pipeline's step raised in Ray Data's tasks, inside `exc`: the exception
    itself, or only its text when Ray's wrappers (UserCodeException) kept no more."""
    fault, text = find_user_error(exc), innermost_error(exc)
    if isinstance(fault, DataError):
        return fault
    return DataError(text[len(_DATA_ERROR) :]) if text.startswith(_DATA_ERROR) else None


def with_file_cause(units, name: str, error: DataError) -> DataError:
    """A check that failed on rows of a dataset of files, when one file's columns differ from the
    others': that first, as the likely cause — Ray Data reads every file with the columns of
    all, so a column missing from one shows up as nulls (NaN) or an extra column."""
    from raytrain.data.files import odd_columns

    cause = odd_columns(units, name)
    return error if cause is None else DataError(f"{cause}. (Seen as: {error})")


# -- helpers ------------------------------------------------------------------------------------


def auto_window_rows(row_bytes: int) -> int:
    """Rows in a shuffle window of about AUTO_WINDOW_BYTES."""
    return max(MIN_WINDOW_ROWS, int(AUTO_WINDOW_BYTES // max(1, row_bytes)))


def concat(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(batches) == 1:
        return batches[0]
    return {c: np.concatenate([b[c] for b in batches]) for c in batches[0]}


def to_device(columns: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    cuda = device.type == "cuda"
    return {
        name: torch.from_numpy(np.ascontiguousarray(col)).to(device, non_blocking=cuda) for name, col in columns.items()
    }


def num_rows(batch: dict[str, np.ndarray]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _preview(values: np.ndarray) -> str:
    return f"{values[:1]!r}..."[:120]
