"""How each dataset of a run reaches the workers: decided on the driver, opened on a worker.

The driver (`prepare_datasets`) looks at metadata and one small first batch and picks, per
dataset (docs/data.md); it reads no full pass:

- in memory (`MemorySource`: small, or `--shuffle-window-rows 0`): one Ray task reads and
  checks it while the workers start; every worker maps the result from the object store;
- streamed (`StreamSource`): the dataset's units (`raytrain.data.shards`) and the run's
  `StreamLayout`; each rank reads only the units of its lanes (`raytrain.rules.order`);
- sampled (`SampledSource`: the pipeline returned a `raytrain.Sampled`): nothing is read
  ahead; every rank draws the rows of its share of each step (`raytrain.data.draws`).

A worker turns its source into a `Table`, a `Stream` or `Draws` (`open_source`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np

from raytrain import hooks
from raytrain.data import checks
from raytrain.data.checks import Schema
from raytrain.data.draws import Draws
from raytrain.data.shards import Units
from raytrain.data.stream import Stream
from raytrain.data.table import Table
from raytrain.errors import DataError
from raytrain.rules.order import StreamLayout
from raytrain.sampled import Sampled

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.pipeline import Pipeline

# Rows of the first unit the driver reads to learn the columns (and check them) before training.
PROBE_ROWS = 16


@dataclass(frozen=True)
class MemorySource:
    """A dataset that one Ray task reads and checks once; `table` is the reference to its
    result in Ray's object store (`checks.load_table`), the same object for every rank."""

    rows: int
    table: Any  # ray.ObjectRef
    sample: dict[str, np.ndarray]  # one checked row: an example of the model's input for a tracker


@dataclass(frozen=True)
class StreamSource:
    """A dataset each rank reads its own units of."""

    rows: int
    units: Units
    layout: StreamLayout
    schema: Schema
    sample: dict[str, np.ndarray]  # one checked row, for a rank with no rows in a step (and a tracker's example)


@dataclass(frozen=True)
class SampledSource:
    """A dataset drawn every step: the pipeline's `Sampled`, which every rank draws from itself."""

    rows: int  # draws per epoch
    spec: Sampled
    sample: dict[str, np.ndarray]  # one drawn row: an example of the model's input for a tracker


Source = Union[MemorySource, StreamSource, SampledSource]


def build_datasets(pipe: "Pipeline", cfg: "TrainConfig") -> dict[str, Any]:
    """The pipeline's datasets as Ray Datasets (map-style torch Datasets and Hugging Face
    `datasets`, a Dataset per split or a DatasetDict, are converted)."""
    import ray.data

    from raytrain import hf_datasets as hf
    from raytrain.data.torch_dataset import from_torch_dataset

    datasets = hf.splits_of(hooks.call(pipe, "build_datasets", cfg))
    return {
        name: ds
        if isinstance(ds, (ray.data.Dataset, Sampled))
        else hf.to_ray(ds)
        if hf.is_hf_dataset(ds)
        else from_torch_dataset(ds, name)
        for name, ds in datasets.items()
    }


def prepare_datasets(datasets: dict[str, Any], cfg: "TrainConfig", echo: Callable[[str], None]) -> dict[str, Source]:
    """How the workers get each dataset (see the module's docstring), from metadata and one
    small first batch; says what it chose. Returns the sources the workers open."""
    import ray

    from raytrain.data import shards

    sources: dict[str, Source] = {}
    for name, ds in datasets.items():
        if isinstance(ds, Sampled):
            sources[name] = prepare_sampled(name, ds, echo)
            continue
        units = shards.split(ds)
        if isinstance(units, str):
            echo(
                f"dataset {name!r}: {units}; Ray Data computes it once before training (materialize) and workers read "
                "its blocks. To read it sharded instead, keep such steps out of build_datasets (e.g. write the data "
                "with raytrain data)"
            )
            units = shards.split(shards.materialize_in_order(ds))
        if not units.num_rows:
            raise DataError(
                f"dataset {name!r} is empty: it has no rows; check the pipeline's build_datasets and its input files"
            )
        probe = read_probe(units, name, cfg.skip_nan_rows)
        schema = Schema.of(probe)
        window = cfg.shuffle_window_rows if name == "train" or cfg.shuffle_window_rows == 0 else None
        estimate = schema.row_bytes() * units.num_rows
        sample = {c: np.nan_to_num(v[:1]) if np.issubdtype(v.dtype, np.floating) else v[:1] for c, v in probe.items()}
        size = f"{units.num_rows:,} rows (~{estimate / 2**20:,.0f} MiB)"
        if window == 0 or (window is None and estimate <= checks.IN_MEMORY_LIMIT_BYTES):
            load = ray.remote(num_cpus=0)(checks.load_table)
            sources[name] = MemorySource(units.num_rows, load.remote(units, name, schema, cfg.skip_nan_rows), sample)
            echo(f"dataset {name!r}: {size} in memory, read once and shared by every worker")
            continue
        layout = StreamLayout(units.rows, window or checks.auto_window_rows(schema.row_bytes()), cfg.data_partitions)
        sources[name] = StreamSource(units.num_rows, units, layout, schema, sample)
        echo(
            f"dataset {name!r}: {size} in {len(units.rows):,} {_UNIT_WORDS[units.kind]}, streamed in {layout.lanes} "
            f"partition{'s' if layout.lanes != 1 else ''}, each read by one worker; "
            f"shuffled within windows of {layout.window_rows:,} rows"
        )
    return sources


def prepare_sampled(name: str, spec: Sampled, echo: Callable[[str], None]) -> SampledSource:
    """A sampled dataset, its rows checked on a first draw (as a walked one's first batch is)."""
    probe = Draws(name, spec).rows_of(np.arange(min(PROBE_ROWS, spec.num_items), dtype=np.int64))
    bad = checks.non_finite(probe)
    if bad.any():
        raise checks.nan_error(name, "rows from its Sampled take", probe, bad)
    echo(
        f"dataset {name!r}: sampled, {spec.num_items:,} items drawn with replacement, fresh rows every step from "
        f"(seed, position); an epoch is {spec.rows_per_epoch:,} draws"
    )
    return SampledSource(spec.rows_per_epoch, spec, {column: values[:1] for column, values in probe.items()})


_UNIT_WORDS = {"files": "Parquet row groups/files", "tasks": "read tasks", "blocks": "blocks"}


def read_probe(units: Units, name: str, skip_nan_rows: bool) -> dict[str, np.ndarray]:
    """The first few rows of the first unit, through the pipeline's steps, checked."""
    first = next(i for i, rows in enumerate(units.rows) if rows)
    try:
        batch = units.dataset([first], limit=PROBE_ROWS).take_batch(PROBE_ROWS, batch_format="numpy")
    except Exception as exc:
        raise checks.read_error(units, [first], name, exc) from None
    try:
        columns = checks.check_columns(batch, name, units.labels[first])
        bad = checks.non_finite(columns)
        if bad.any() and not skip_nan_rows:
            raise checks.nan_error(name, units.labels[first], columns, bad)
    except DataError as error:  # perhaps another file's columns, read into this one's as nulls
        raise checks.with_file_cause(units, name, error) from None
    return columns


def open_source(
    name: str, source: Source, get_object: Callable[[Any], Any], skip_nan_rows: bool
) -> Table | Stream | Draws:
    """A dataset as the driver prepared it, on a worker: the in-memory table (mapped from the
    object store with `get_object`, not copied), a stream of units each rank reads its own
    share of, or the draws of a sampled one."""
    if isinstance(source, SampledSource):
        return Draws(name, source.spec)
    if isinstance(source, MemorySource):
        loaded = get_object(source.table)
        return Table(loaded["columns"], dropped_rows=loaded["dropped_rows"])
    return Stream(name, source.units, source.layout, source.schema, source.sample, skip_nan_rows=skip_nan_rows)


def data_digest(data: Table | Stream | Draws) -> dict[str, Any]:
    """What a checkpoint records of the training set, so that an epoch half done never
    continues on other data: a stream's layout, a table's row count, a sampled set's items and
    epoch."""
    if isinstance(data, Draws):
        return {"sampled_items": data.spec.num_items, "rows": len(data)}
    return data.layout.digest() if isinstance(data, Stream) else {"rows": len(data)}


def cost_notes(data: Table | Stream | Draws, world_size: int) -> list[str]:
    """What the data costs the run: rows skipped in memory, and stream partitions that cannot
    keep every worker equally busy."""
    notes = []
    if isinstance(data, Table) and data.dropped_rows:
        notes.append(
            f"dataset 'train': skipped {data.dropped_rows:,} row(s) holding NaN or inf (--skip-nan-rows); "
            f"{len(data):,} left"
        )
    if not isinstance(data, Stream) or world_size == 1:
        return notes
    lanes = data.layout.lanes
    if lanes < world_size:
        notes.append(
            f"dataset 'train' has {lanes} partition(s) for {world_size} workers: {world_size - lanes} worker(s) get "
            "no rows and wait for the others; give it more files or row groups (raytrain data), or raise "
            "--data-partitions"
        )
    elif lanes % world_size:
        notes.append(
            f"dataset 'train': {lanes} partitions over {world_size} workers leave some with one partition more, "
            "and the busiest sets the pace; a worker count that divides --data-partitions keeps them even"
        )
    return notes
