"""The data layer: checked rows from Ray Data, cut into each rank's share of every step.

Two ways to hold a dataset (docs/data.md):

- in memory (`Table`): one Ray task reads and checks the whole dataset once; its columns
  sit in Ray's object store, every worker maps them and draws a full permutation per epoch
  (`raytrain.rules.batch.epoch_order`), taking its slice of every step;
- streamed (`Stream`): the dataset is a list of units known from metadata
  (`raytrain.data.shards`); each epoch deals them to lanes (`raytrain.rules.order`), and each rank
  reads with Ray Data only the units of its own lanes, checking every batch as it comes.

Either way every row is trained exactly once per epoch, all ranks run the same steps, and
an epoch continues from one stored offset at any worker count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from raytrain.rules import order
from raytrain.rules import batch as plan
from raytrain.errors import DataError, innermost_error

__all__ = ["DataError", "Schema", "Stream", "Table", "check_units", "load_table"]

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
                f"dataset {name!r}, column {column!r} ({where}) holds tuples ({_preview(values)}): ray.data.from_torch gives "
                "one 'item' column of (input, target) samples. Return the torch Dataset itself from build_datasets — raytrain "
                "makes each field a column, '0', '1', ... (or the keys of dict samples) — or split it in map_batches"
            )
        if values.dtype == object or not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise DataError(
                f"dataset {name!r}, column {column!r} ({where}): dtype {values.dtype} is not numeric ({_preview(values)}); "
                "convert it in the pipeline (e.g. map_batches) to numbers of one shape per row"
            )
        columns[column] = values
    if schema is None:
        return columns
    if sorted(columns) != sorted(schema.names):
        raise DataError(f"dataset {name!r} ({where}): columns {sorted(columns)} differ from the first batch's {sorted(schema.names)}; every batch must have the same columns")
    for column, _, shape in schema.columns:
        if tuple(columns[column].shape[1:]) != shape:
            raise DataError(
                f"dataset {name!r}, column {column!r} ({where}): rows of shape {tuple(columns[column].shape[1:])} where the "
                f"first batch had {shape}; every row must have one shape"
            )
    return columns


def non_finite(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Rows holding NaN or inf in any float column."""
    n = _num_rows(batch)
    bad = np.zeros(n, dtype=bool)
    for values in batch.values():
        if np.issubdtype(values.dtype, np.floating):
            bad |= ~np.isfinite(values.reshape(n, -1)).all(axis=1)
    return bad


def nan_error(name: str, where: str, batch: dict[str, np.ndarray], bad: np.ndarray) -> DataError:
    index = int(np.flatnonzero(bad)[0])
    column = next(c for c, v in batch.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v[index]).all())
    return DataError(
        f"dataset {name!r}: row {index} of {where} holds NaN or inf in column {column!r} ({int(bad.sum())} such row(s) there); "
        "clean the data, or pass --skip-nan-rows to drop such rows (they are counted and reported); "
        "then --resume continues from the last checkpoint"
    )


# -- reading units ------------------------------------------------------------------------------


@dataclass
class Unit:
    """One unit's rows as read and checked; `valid` is False for rows skipped for NaN/inf."""

    columns: dict[str, np.ndarray]
    valid: np.ndarray | None = None  # None: every row valid


def check_units(units, ids: Sequence[int], name: str, schema: Schema, *, skip_nan_rows: bool) -> Iterator[tuple[int, Unit]]:
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
        batches = units.dataset(ids).iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=PREFETCH_BLOCKS)
        for raw in batches:
            batch = check_columns(raw, name, f"{units.labels[ids[min(position, len(ids) - 1)]]}", schema)
            while _num_rows(batch):
                if position == len(ids):
                    raise _count_error(units, ids, name, expected, extra=True)
                take = min(expected[position] - have, _num_rows(batch))
                pending.append({c: v[:take] for c, v in batch.items()})
                batch = {c: v[take:] for c, v in batch.items()}
                have += take
                while position < len(ids) and have == expected[position]:
                    yield ids[position], _finish_unit(pending, units.labels[ids[position]], name, skip_nan_rows)
                    pending, have, position = [], 0, position + 1
    except DataError:
        raise
    except Exception as exc:  # reading or preprocessing failed inside Ray Data (a bad file, the pipeline's map fn)
        raise DataError(f"dataset {name!r} cannot be read: {first_error_line(exc)}") from None
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
        short = sum(expected) - got
        what = f"its preprocessing yielded {short:,} row(s) fewer than its metadata counts (the stream ended in {units.labels[ids[0]]})"
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
        if _num_rows(unit.columns):
            kept.append(unit.columns)
    if not kept:
        raise DataError(f"dataset {name!r}: every row holds NaN or inf; nothing is left to train on")
    return {"columns": concat(kept), "dropped_rows": dropped}


def first_error_line(exc: BaseException) -> str:
    """The innermost `Type: message` line of a (possibly Ray-wrapped) exception."""
    return innermost_error(exc)


# -- torch Datasets -------------------------------------------------------------------------------

# A map-style torch Dataset is read through Ray Data in this many read tasks at most (a parallel
# read over index ranges, each task fetching its indices; the tasks are a stream's units).
TORCH_READ_TASKS = 96


def from_torch_dataset(dataset, name: str):
    """A map-style torch Dataset as a Ray Dataset: `ray.data.range` over its indices, each
    read task fetching its samples in parallel (`ray.data.from_torch` reads in one task).
    A sample's fields become columns: '0', '1', ... for a tuple or list, the keys of a dict,
    '0' for a lone tensor or number."""
    import ray.data

    try:
        size = len(dataset)
    except TypeError:
        raise DataError(f"dataset {name!r} is a torch IterableDataset: it has no length and no indices to shard; give a map-style Dataset (with __len__ and __getitem__) or a ray.data.Dataset") from None
    if size == 0:
        raise DataError(f"dataset {name!r} is empty: the torch Dataset has length 0")
    sample_columns(dataset[0], name, 0)  # the first sample's fields, checked before any worker starts
    blocks = max(1, min(size, TORCH_READ_TASKS))
    return ray.data.range(size, override_num_blocks=blocks).map_batches(TorchSamples(dataset, name), batch_format="numpy")


class TorchSamples:
    """The map_batches step of `from_torch_dataset`: indices in, columns out."""

    def __init__(self, dataset, name: str):
        self.dataset, self.name = dataset, name

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [sample_columns(self.dataset[int(index)], self.name, int(index)) for index in batch["id"]]
        return {column: np.stack([row[column] for row in rows]) for column in rows[0]}


def sample_columns(sample: Any, name: str, index: int) -> dict[str, np.ndarray]:
    """One torch sample as named numeric arrays (DataError naming the dataset, index and field)."""
    if isinstance(sample, dict):
        fields = {str(key): value for key, value in sample.items()}
    elif isinstance(sample, (tuple, list)):
        fields = {str(i): value for i, value in enumerate(sample)}
    else:
        fields = {"0": sample}
    columns = {}
    for key, value in fields.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        array = np.asarray(value) if isinstance(value, (np.ndarray, np.generic, int, float, bool)) else None
        if array is None or array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
            raise DataError(
                f"dataset {name!r}: sample {index}, field {key!r} is a {type(value).__name__} ({str(value)[:60]!r}); a torch "
                "Dataset must yield tensors, numpy arrays or numbers (for images, e.g. torchvision's transforms.ToTensor())"
            )
        columns[key] = array
    return columns


# -- in memory ----------------------------------------------------------------------------------


@dataclass
class Table:
    """Columns of equal length, as numpy arrays."""

    columns: dict[str, np.ndarray]
    dropped_rows: int = 0  # rows skipped for NaN/inf (with skip_nan_rows)

    def __len__(self) -> int:
        return _num_rows(self.columns) if self.columns else 0

    def batch(self, rows: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        return to_device({name: col[rows] for name, col in self.columns.items()}, device)

    def epoch(self, seed: int, epoch: int, start: int, rank: int, world_size: int) -> "TableEpoch":
        return TableEpoch(self, plan.epoch_order(len(self), seed, epoch), rank, world_size)

    def eval_batches(self, rank: int, world_size: int, batch_size: int, device: torch.device) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """This rank's contiguous share of the rows in batches: (row count, batch); (0, one
        row) when it has none."""
        start, end = plan.split_range(len(self), world_size)[rank]
        if start >= end:
            yield 0, self.batch(np.arange(0, 1), device)
        for lo in range(start, end, batch_size):
            hi = min(end, lo + batch_size)
            yield hi - lo, self.batch(np.arange(lo, hi), device)


class TableEpoch:
    """One epoch of a Table: positions index a full permutation of the rows; a rank takes a
    contiguous slice of every step."""

    def __init__(self, table: Table, permutation: np.ndarray, rank: int, world_size: int):
        self.table, self.order, self.rank, self.world_size = table, permutation, rank, world_size

    def rows(self, step: plan.Step) -> list[tuple[int, int]]:
        return [plan.rank_rows(step, self.rank, self.world_size)]

    def batch(self, rows: list[tuple[int, int]], device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """The rows as one batch and their count; for none, one row (the caller weights it 0)."""
        index = np.concatenate([self.order[lo:hi] for lo, hi in rows]) if rows else np.zeros(0, dtype=np.int64)
        count = len(index)
        return self.table.batch(index if count else self.order[:1], device), count


# -- streamed -----------------------------------------------------------------------------------


@dataclass
class Stream:
    """A dataset each rank reads its own units of (worker side); see raytrain.rules.order."""

    name: str
    units: Any  # raytrain.data.shards.Units
    layout: order.StreamLayout
    schema: Schema
    sample: dict[str, np.ndarray]  # one checked row, for a rank with no rows in a step
    skip_nan_rows: bool = False

    def __len__(self) -> int:
        return self.layout.num_rows

    def epoch(self, seed: int, epoch: int, start: int, rank: int, world_size: int) -> "StreamEpoch":
        return StreamEpoch(self, order.EpochPlan.build(self.layout, seed, epoch), rank, world_size, start)

    def eval_batches(self, rank: int, world_size: int, batch_size: int, device: torch.device) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """The rows of this rank's units (`order.deal_units`) in batches; (0, one row) if none."""
        mine = order.deal_units(self.units.rows, world_size)[rank]
        served = False
        pending: list[dict[str, np.ndarray]] = []
        for _, unit in check_units(self.units, mine, self.name, self.schema, skip_nan_rows=self.skip_nan_rows):
            pending.append(unit.columns if unit.valid is None else {c: v[unit.valid] for c, v in unit.columns.items()})
            rows = concat(pending)
            while _num_rows(rows) >= batch_size:
                yield batch_size, to_device({c: v[:batch_size] for c, v in rows.items()}, device)
                served, rows = True, {c: v[batch_size:] for c, v in rows.items()}
            pending = [rows] if _num_rows(rows) else []
        if pending:
            rows = concat(pending)
            yield _num_rows(rows), to_device(rows, device)
        elif not served:
            yield 0, to_device(self.sample, device)


@dataclass
class StreamEpoch:
    """One epoch of a Stream on one rank: reads the units of its lanes in the order they are
    needed (one Ray Data execution), builds each lane's shuffled blocks, and serves the rows
    of every step that belong to its lanes."""

    stream: Stream
    plan: order.EpochPlan
    rank: int
    world_size: int
    start: int
    lanes: list[int] = field(init=False)
    units: dict[tuple[int, int], Unit] = field(init=False, default_factory=dict)
    blocks: dict[tuple[int, int], Unit] = field(init=False, default_factory=dict)
    skipped_rows: int = field(init=False, default=0)  # rows served as skipped (NaN/inf), this epoch

    def __post_init__(self):
        owners = order.lane_owners(self.plan.lane_rows, self.world_size)
        self.lanes = [lane for lane, owner in enumerate(owners) if owner == self.rank]
        self.reading = self.plan.read_order(self.lanes, self.start)
        self._source: Iterator[tuple[int, Unit]] | None = None

    def rows(self, step: plan.Step) -> list[tuple[int, int, int]]:
        """This rank's rows of `step`: (lane, lo, hi) lane positions."""
        return self.plan.segments(self.lanes, step.start, step.end)

    def batch(self, rows: list[tuple[int, int, int]], device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """Lane positions (increasing from call to call) as one batch and its count of valid
        rows; none: one row the caller weights 0."""
        pieces = []
        size = self.plan.layout.block_rows
        for lane, lo, hi in rows:
            for block in range(lo // size, (hi - 1) // size + 1):
                built = self._block(lane, block)
                a, b = max(lo, block * size) - block * size, min(hi, (block + 1) * size) - block * size
                piece = {c: v[a:b] for c, v in built.columns.items()}
                if built.valid is not None:
                    keep = built.valid[a:b]
                    self.skipped_rows += int((~keep).sum())
                    piece = {c: v[keep] for c, v in piece.items()}
                pieces.append(piece)
            self._drop_blocks_before(lane, hi // size)
        columns = concat(pieces) if pieces else {}
        count = _num_rows(columns) if columns else 0
        return to_device(columns if count else self.stream.sample, device), count

    def _block(self, lane: int, block: int) -> Unit:
        key = (lane, block)
        if key in self.blocks:
            return self.blocks[key]
        size, starts = self.plan.layout.block_rows, self.plan.lane_unit_starts[lane]
        lo, hi = block * size, min(self.plan.lane_rows[lane], (block + 1) * size)
        touching = [i for i in range(len(starts) - 1) if starts[i] < hi and starts[i + 1] > lo]
        while any((lane, i) not in self.units for i in touching):
            self._read_next()
        pieces, valid = [], []
        for i in touching:
            unit = self.units[(lane, i)]
            a, b = max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i]
            pieces.append({c: v[a:b] for c, v in unit.columns.items()})
            valid.append(unit.valid[a:b] if unit.valid is not None else np.ones(b - a, dtype=bool))
            if starts[i + 1] <= hi:  # all its rows are in blocks built by now
                del self.units[(lane, i)]
        shuffled = self.plan.block_order(lane, block)
        columns = {c: v[shuffled] for c, v in concat(pieces).items()}
        mask = np.concatenate(valid)[shuffled]
        self.blocks[key] = Unit(columns, None if mask.all() else mask)
        return self.blocks[key]

    def _read_next(self) -> None:
        if self._source is None:
            ids = [self.plan.lane_units[lane][index] for lane, index in self.reading]
            self._where = {unit: (lane, index) for unit, (lane, index) in zip(ids, self.reading)}
            self._source = check_units(self.stream.units, ids, self.stream.name, self.stream.schema, skip_nan_rows=self.stream.skip_nan_rows)
        try:
            unit_id, unit = next(self._source)
        except StopIteration:
            raise RuntimeError(f"dataset {self.stream.name!r}: rank {self.rank} needed a unit it had already read past") from None
        self.units[self._where[unit_id]] = unit

    def _drop_blocks_before(self, lane: int, block: int) -> None:
        for key in [k for k in self.blocks if k[0] == lane and k[1] < block]:
            del self.blocks[key]


# -- helpers ------------------------------------------------------------------------------------


def auto_window_rows(row_bytes: int) -> int:
    """Rows in a shuffle window of about AUTO_WINDOW_BYTES."""
    return max(MIN_WINDOW_ROWS, int(AUTO_WINDOW_BYTES // max(1, row_bytes)))


def concat(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(batches) == 1:
        return batches[0]
    return {c: np.concatenate([b[c] for b in batches]) for c in batches[0]}


def to_device(columns: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    non_blocking = device.type == "cuda"
    return {name: torch.from_numpy(np.ascontiguousarray(col)).to(device, non_blocking=non_blocking) for name, col in columns.items()}


def _num_rows(batch: dict[str, np.ndarray]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _preview(values: np.ndarray) -> str:
    return f"{values[:1]!r}..."[:120]
