"""The data layer: rows from Ray Data, batches cut by the pure plan in `raytrain.plan`.

Every rank reads the same (unsplit) rows and takes, for each optimizer step, its slice of
the epoch's global order. The order depends on (seed, epoch) only and the position in it
is a single offset, so:

- every row is trained on exactly once per epoch, the tail included (no padding,
  nothing dropped);
- all ranks run the same number of steps (they compute it from the same numbers);
- an interrupted epoch continues from the stored offset at any worker count.

Two ways to hold the rows (docs/data.md):

- in memory (`Table`): the driver reads and checks the dataset once and puts its columns
  in Ray's object store; every worker maps them and draws a full permutation per epoch;
- streamed (`Stream`), for datasets larger than memory: every worker streams the dataset
  from Ray Data in windows of `window_rows` rows (the next one prefetched) and shuffles
  inside each window; about two windows are held at a time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from raytrain import plan


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
        return _to_device({name: col[rows] for name, col in self.columns.items()}, device)

    def epoch(self, seed: int, epoch: int, start: int) -> "TableEpoch":
        return TableEpoch(self, plan.epoch_order(len(self), seed, epoch))

    def eval_batches(self, start: int, end: int, batch_size: int, device: torch.device) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Rows [start, end) in batches: (row count, batch); (0, one row) for an empty range."""
        if start >= end:
            yield 0, self.batch(np.arange(0, 1), device)
        for lo in range(start, end, batch_size):
            hi = min(end, lo + batch_size)
            yield hi - lo, self.batch(np.arange(lo, hi), device)


# Without --shuffle-window-rows, a dataset whose checked rows take at most this much
# memory is held by every worker; a larger one is streamed.
IN_MEMORY_LIMIT_BYTES = 1 << 30
# The window of an automatically streamed dataset: about this many bytes of rows, and
# never fewer than MIN_WINDOW_ROWS rows.
AUTO_WINDOW_BYTES = 64 << 20
MIN_WINDOW_ROWS = 1024


@dataclass
class Scan:
    """What one checked pass over a dataset found (on the driver, before training)."""

    name: str
    num_rows: int = 0
    num_bytes: int = 0
    dropped_rows: int = 0  # rows with NaN/inf skipped (skip_nan_rows)
    table: Table | None = None  # the rows, when they were kept (in-memory datasets)
    window_rows: int = 0
    window_digests: list[str] = field(default_factory=list)  # one per window of the stream


def read_table(iterator, name: str, *, skip_nan_rows: bool = False, read_batch_size: int = 4096) -> Table:
    """Read every row of a Ray Data dataset (or its iterator) into a checked Table (see `scan`)."""
    return scan(iterator, name, skip_nan_rows=skip_nan_rows, read_batch_size=read_batch_size).table


def scan(
    iterator,
    name: str,
    *,
    skip_nan_rows: bool = False,
    keep_bytes: float = float("inf"),
    window_rows: int | None = 0,
    read_batch_size: int = 4096,
) -> Scan:
    """One streaming pass over a dataset that checks every batch and counts its rows.

    Keeps the rows as a Table while they take at most `keep_bytes`. Beyond that, with
    `window_rows` (None: chosen from the row size; 0: no windows), it digests every window of
    that many rows as a `Stream` cuts them, so that workers can verify they read what was
    checked.

    Raises DataError naming the dataset, column and row for: no rows, columns that change
    between blocks, non-numeric or ragged values, NaN/inf values (unless `skip_nan_rows`:
    those rows are dropped and counted in `dropped_rows`).
    """
    result = Scan(name)
    kept: list[dict[str, np.ndarray]] | None = []  # checked batches, while they fit keep_bytes
    shapes: dict[str, tuple] = {}
    first_bad: tuple[int, str] | None = None
    windows = _Windows(result)
    seen = 0  # rows read, NaN rows included (row numbers in messages count them)
    try:
        for raw in iterator.iter_batches(batch_size=read_batch_size, batch_format="numpy"):
            batch = _check_batch(raw, name, shapes)
            n = len(next(iter(batch.values()))) if batch else 0
            if not n:
                continue
            bad = _non_finite(batch)
            if bad.any():
                if first_bad is None:
                    index = int(np.flatnonzero(bad)[0])
                    column = next(c for c, v in batch.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v[index]).all())
                    first_bad = (seen + index, column)
                result.dropped_rows += int(bad.sum())
                batch = {c: v[~bad] for c, v in batch.items()}
            seen += n
            rows = len(next(iter(batch.values())))
            if not rows:
                continue
            size = sum(v.nbytes for v in batch.values())
            if not result.window_rows and window_rows != 0:
                result.window_rows = window_rows or auto_window_rows(size / rows)
            result.num_rows += rows
            result.num_bytes += size
            if kept is not None and result.num_bytes <= keep_bytes:
                kept.append(batch)
                continue
            # Too big to hold: streamed, so only checked, counted and digested from here on
            # (an in-memory dataset needs no digests: every rank maps the same object).
            if kept is not None and result.window_rows:
                for earlier in kept:
                    windows.add(earlier)
            kept = None
            if result.window_rows:
                windows.add(batch)
    except DataError:
        raise
    except Exception as exc:  # reading or preprocessing failed inside Ray Data (bad file, user map fn)
        raise DataError(f"dataset {name!r} cannot be read: {_first_error_line(exc)}") from None
    if seen == 0:
        raise DataError(f"dataset {name!r} is empty: it yielded no rows; check the pipeline's build_datasets and its input files")
    if first_bad is not None and not skip_nan_rows:
        row, column = first_bad
        raise DataError(
            f"dataset {name!r}: {result.dropped_rows} row(s) hold NaN or inf, the first is row {row} in column {column!r}; "
            "clean the data, or pass --skip-nan-rows to drop such rows (they are counted and reported)"
        )
    if result.num_rows == 0:
        raise DataError(f"dataset {name!r}: every row holds NaN or inf; nothing is left to train on")
    windows.finish()
    if kept is not None:
        result.table = Table(_concat(kept), dropped_rows=result.dropped_rows)
    return result


def auto_window_rows(row_bytes: float) -> int:
    """Rows in a shuffle window of about AUTO_WINDOW_BYTES."""
    return max(MIN_WINDOW_ROWS, int(AUTO_WINDOW_BYTES // max(1.0, row_bytes)))


def _check_batch(batch: dict, name: str, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """The batch as numpy columns, checked against the batches before it (`shapes`, updated)."""
    if shapes and set(batch) != set(shapes):
        raise DataError(f"dataset {name!r}: columns changed between blocks ({sorted(shapes)} vs {sorted(batch)})")
    columns = {}
    for column, values in batch.items():
        values = np.asarray(values)
        if values.dtype == object or not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise DataError(
                f"dataset {name!r}, column {column!r}: dtype {values.dtype} is not numeric ({values[:1]!r}...); "
                "convert it in the pipeline (e.g. map_batches) to numbers of one shape per row"
            )
        known = shapes.setdefault(column, values.shape[1:])
        if known != values.shape[1:]:
            raise DataError(
                f"dataset {name!r}, column {column!r}: rows of different shapes {sorted({known, values.shape[1:]})}; "
                "every row must have one shape"
            )
        columns[column] = values
    return columns


def _non_finite(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Rows holding NaN or inf in any float column."""
    n = len(next(iter(batch.values())))
    bad = np.zeros(n, dtype=bool)
    for values in batch.values():
        if np.issubdtype(values.dtype, np.floating):
            bad |= ~np.isfinite(values.reshape(n, -1)).all(axis=1)
    return bad


def drop_non_finite_rows(batch: dict) -> dict:
    """A Ray Data `map_batches` function: the batch without its rows holding NaN or inf
    (what `scan` skips with skip_nan_rows, so a stream yields the rows that were counted)."""
    batch = {c: np.asarray(v) for c, v in batch.items()}
    if not batch or not len(next(iter(batch.values()))):
        return batch
    keep = ~_non_finite(batch)
    return batch if keep.all() else {c: v[keep] for c, v in batch.items()}


class _Windows:
    """Cuts a stream of batches into windows of `scan.window_rows` rows and digests each."""

    def __init__(self, scan: Scan):
        self.scan = scan
        self.pending: list[dict[str, np.ndarray]] = []
        self.pending_rows = 0

    def add(self, batch: dict[str, np.ndarray]) -> None:
        self.pending.append(batch)
        self.pending_rows += len(next(iter(batch.values())))
        size = self.scan.window_rows
        while self.pending_rows >= size:
            merged = _concat(self.pending)
            self.scan.window_digests.append(fingerprint(Table({c: v[:size] for c, v in merged.items()})))
            self.pending_rows -= size
            self.pending = [{c: v[size:] for c, v in merged.items()}] if self.pending_rows else []

    def finish(self) -> None:
        if self.pending_rows:
            self.scan.window_digests.append(fingerprint(Table(_concat(self.pending))))
        self.pending, self.pending_rows = [], 0


def _concat(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(batches) == 1:
        return batches[0]
    return {c: np.concatenate([b[c] for b in batches]) for c in batches[0]}


def _to_device(columns: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    non_blocking = device.type == "cuda"
    return {name: torch.from_numpy(np.ascontiguousarray(col)).to(device, non_blocking=non_blocking) for name, col in columns.items()}


# -- streamed datasets -------------------------------------------------------------------


class Stream:
    """A dataset every worker streams from Ray Data in windows of `window_rows` rows.

    Epoch position p is row `window_order(...)[p % W]` of window p // W of the stream
    (`raytrain.plan.streamed_epoch_order`): each row once per epoch, a new order inside every
    window each epoch, and a start at any offset (the windows before it are read and skipped).
    """

    def __init__(self, dataset, name: str, num_rows: int, window_rows: int, digests: list[str]):
        self.dataset = dataset  # a Ray Data iterator (or Dataset) yielding the rows in one order
        self.name = name
        self.num_rows = num_rows
        self.window_rows = window_rows
        self.digests = digests

    def __len__(self) -> int:
        return self.num_rows

    def epoch(self, seed: int, epoch: int, start: int) -> "StreamEpoch":
        return StreamEpoch(self, seed, epoch, start)

    def windows(self, first: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Windows first, first + 1, ... of the stream, each checked against the driver's digest."""
        batches = self.dataset.iter_batches(batch_size=self.window_rows, batch_format="numpy", prefetch_batches=1)
        count = 0
        for index, batch in enumerate(batches):
            count = index + 1
            if index < first:
                continue  # read to get past it: a stream has no random access
            columns = {c: np.asarray(v) for c, v in batch.items()}
            if index >= len(self.digests) or fingerprint(Table(columns)) != self.digests[index]:
                raise DataError(
                    f"dataset {self.name!r}: window {index} of the stream (rows from {index * self.window_rows}) differs from "
                    "what the driver checked before training; the dataset must yield the same rows in the same order on "
                    "every read (avoid unseeded random_shuffle in build_datasets)"
                )
            yield index, columns
        raise DataError(f"dataset {self.name!r}: the stream ended after {count} windows; the driver checked {len(self.digests)}")

    def eval_batches(self, start: int, end: int, batch_size: int, device: torch.device) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Rows [start, end) of the stream's own order in batches: (row count, batch)."""
        if start >= end:
            first = next(iter(self.dataset.iter_batches(batch_size=1, batch_format="numpy")))
            yield 0, _to_device({c: np.asarray(v)[:1] for c, v in first.items()}, device)
            return
        position = 0
        for batch in self.dataset.iter_batches(batch_size=batch_size, batch_format="numpy", prefetch_batches=1):
            n = len(next(iter(batch.values())))
            lo, hi = max(start, position), min(end, position + n)
            if lo < hi:
                yield hi - lo, _to_device({c: np.asarray(v)[lo - position : hi - position] for c, v in batch.items()}, device)
            position += n
            if position >= end:
                break


class StreamEpoch:
    """One epoch of a Stream: batches by epoch position, windows loaded as positions advance."""

    def __init__(self, stream: Stream, seed: int, epoch: int, start: int):
        self.stream, self.seed, self.epoch = stream, seed, epoch
        self.source = stream.windows(first=start // stream.window_rows)
        self.loaded: dict[int, dict[str, np.ndarray]] = {}

    def _window(self, index: int) -> dict[str, np.ndarray]:
        while index not in self.loaded:
            got, columns = next(self.source)
            order = plan.window_order(len(next(iter(columns.values()))), self.seed, self.epoch, got)
            self.loaded[got] = {c: v[order] for c, v in columns.items()}  # shuffled once per window
        return self.loaded[index]

    def batch(self, lo: int, hi: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Epoch positions [lo, hi) (increasing from call to call) as one batch; for an
        empty range, one row of a window at hand (the caller weights it 0)."""
        size = self.stream.window_rows
        if hi <= lo:
            if not self.loaded:
                self._window(min(lo, self.stream.num_rows - 1) // size)
            return _to_device({c: v[:1] for c, v in self.loaded[min(self.loaded)].items()}, device)
        first, last = lo // size, (hi - 1) // size
        for done in [k for k in self.loaded if k < first]:
            del self.loaded[done]
        pieces = []
        for index in range(first, last + 1):
            window = self._window(index)
            a, b = max(lo, index * size) - index * size, min(hi, (index + 1) * size) - index * size
            pieces.append({c: v[a:b] for c, v in window.items()})
        return _to_device(_concat(pieces), device)


# -- in-memory datasets ------------------------------------------------------------------


class TableEpoch:
    """One epoch of a Table: positions index a full permutation of the rows."""

    def __init__(self, table: Table, order: np.ndarray):
        self.table, self.order = table, order

    def batch(self, lo: int, hi: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Epoch positions [lo, hi) as one batch; for an empty range, one row (weighted 0)."""
        return self.table.batch(self.order[lo:hi] if hi > lo else self.order[:1], device)


def fingerprint(table: Table) -> str:
    """A digest of the table's rows in order: a streaming rank compares each window's with the
    driver's, to be sure it reads the rows that were checked."""
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
