"""A Ray Dataset cut into units that Ray Data reads on their own: sharded reading.

`split(ds)` looks at the dataset's logical plan (the pipeline's `read_*` followed by its
per-row steps, `map_batches` and the like) and lists its *units* from metadata alone:

- files (`read_parquet`): the Parquet row groups or files Ray Data's own file listing
  gives, with row counts from the Parquet footers;
- read tasks (`range`, `from_torch`, custom datasources): the datasource's read tasks,
  asked for at a fixed parallelism so the units never depend on the cluster;
- blocks (`from_items`, `from_numpy`, a materialized dataset): the blocks themselves.

`Units.dataset(ids)` is then the pipeline's own dataset restricted to those units, in that
order: its reading and preprocessing run in Ray Data (tasks, prefetch, backpressure,
spilling) as the pipeline wrote them, only over the rows a worker trains on.

This is the one module that reads Ray Data's logical plan (Ray 2.60's internals); it is
covered by tests/test_stream_ray.py. A plan it cannot cut (an all-to-all step such as
`random_shuffle`, a `zip` or `union`, a `filter`, or a file format without row counts in
its metadata) comes back as a reason, and the caller materializes the dataset once.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

# Units asked of a datasource whose read tasks Ray would otherwise size to the cluster.
READ_TASK_UNITS = 64
# File units (Parquet row-group runs) read by one Ray Data task, in order.
FILE_UNITS_PER_BUNDLE = 8


@dataclass
class Units:
    """A dataset as a list of independently readable units, with row counts."""

    kind: str  # "files", "tasks" or "blocks"
    rows: tuple[int, ...]
    labels: list[str]  # what a message names for each unit (a file and row group, a block)
    payload: list[Any]  # per unit: a file manifest row (a dict), a ReadTask or a (block ref, metadata, schema)
    above: list[Any] = field(repr=False, default_factory=list)  # logical ops over the source, source side first
    source: Any = field(repr=False, default=None)  # the original source op (tasks: the Read to copy)
    context: Any = field(repr=False, default=None)  # the dataset's DataContext
    manifest_schema: Any = field(repr=False, default=None)  # files: the schema of a file manifest row

    @property
    def num_rows(self) -> int:
        return int(sum(self.rows))

    def dataset(self, ids: Sequence[int], *, limit: int | None = None):
        """The pipeline's dataset over units `ids`, read in that order (at most `limit` rows
        of them go through the pipeline's own steps)."""
        from ray.data import Dataset
        from ray.data._internal.logical.interfaces import LogicalPlan
        from ray.data._internal.logical.operators import Limit
        from ray.data._internal.stats import DatasetStats

        op, above = self._source_op(ids), list(self.above)
        if self.kind == "files":  # the file reader itself sits right above the listing
            op, above = above[0]._with_new_input_dependencies([op]), above[1:]
        if limit is not None:
            op = Limit(limit=limit, input_dependencies=[op])
        for template in above:
            op = template._with_new_input_dependencies([op])
        with warnings.catch_warnings():  # Ray's own copy touches fields it has deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            context = self.context.copy()
        context.execution_options.preserve_order = True  # the units' order is the order we train in
        context.enable_progress_bars = False
        return Dataset(LogicalPlan(op, context), context, DatasetStats(metadata={}, parent=None))

    def _source_op(self, ids: Sequence[int]):
        import pyarrow as pa
        import ray
        from ray.data._internal.execution.interfaces import BlockEntry, RefBundle
        from ray.data._internal.logical.operators import InputData
        from ray.data.block import BlockAccessor

        if self.kind == "tasks":
            tasks = [self.payload[i] for i in ids]
            source = _ReadTaskList(tasks, self.source.datasource)
            return dataclasses.replace(
                self.source, datasource=source, datasource_or_legacy_reader=source, parallelism=len(tasks)
            )
        bundles = []
        if self.kind == "files":  # one-row manifests, a few per bundle (each bundle is one put and one read task)
            for start in range(0, len(ids), FILE_UNITS_PER_BUNDLE):
                table = pa.Table.from_pylist(
                    [self.payload[i] for i in ids[start : start + FILE_UNITS_PER_BUNDLE]], schema=self.manifest_schema
                )
                meta = BlockAccessor.for_block(table).get_metadata(input_files=None, block_exec_stats=None)
                bundles.append(RefBundle((BlockEntry(ray.put(table), meta),), owns_blocks=False, schema=table.schema))
        else:
            for i in ids:
                ref, meta, schema = self.payload[i]
                bundles.append(RefBundle((BlockEntry(ref, meta),), owns_blocks=False, schema=schema))
        return InputData(input_data=bundles)


class _ReadTaskList:
    """A datasource that hands out a fixed list of another datasource's read tasks."""

    def __init__(self, tasks: list, original):
        self.tasks, self.original = tasks, original

    def __getattr__(self, name):  # everything else as the original datasource says
        if name in ("tasks", "original"):
            raise AttributeError(name)
        return getattr(self.original, name)

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list:
        return list(self.tasks)

    def estimate_inmemory_data_size(self):
        sizes = [task.metadata.size_bytes for task in self.tasks]
        return sum(sizes) if all(s is not None for s in sizes) else None

    @property
    def should_create_reader(self) -> bool:
        return False


def materialize_in_order(ds):
    """The dataset computed once (`materialize`) with its blocks in the order of its rows.
    Without `preserve_order` Ray Data keeps blocks in the order their tasks finish, so the
    rows at a position (what a data position and a resume count on) would vary from run to
    run; the blocks' sizes still follow the cluster (Ray Data splits a read by its CPUs)."""
    from raytrain.data.checks import data_error_in

    ds.context.execution_options.preserve_order = True
    try:
        return ds.materialize()
    except Exception as exc:  # a DataError a pipeline's step raised in Ray Data's tasks: its own message
        fault = data_error_in(exc)
        if fault is None:
            raise
        raise fault from None


def split(ds) -> Units | str:
    """The dataset's units, or why they cannot be listed from metadata (a sentence)."""
    from ray.data._internal.logical.interfaces import SourceOperator
    from ray.data._internal.logical.operators import InputData, ListFiles, Read, ReadFiles
    from ray.data._internal.logical.operators.map_operator import AbstractMap
    from ray.data._internal.logical.operators.one_to_one_operator import AbstractOneToOne, Limit

    ops = [ds._logical_plan.dag]
    while ops[-1].input_dependencies:
        inputs = ops[-1].input_dependencies
        if len(inputs) != 1:
            return f"it combines datasets ({_op_name(ops[-1])})"
        ops.append(inputs[0])
    ops.reverse()
    source, above = ops[0], ops[1:]
    for op in above:
        if isinstance(op, Limit) or not isinstance(op, (AbstractMap, AbstractOneToOne)):
            return f"its plan has {_op_name(op)}, which needs every row at once"
        if type(op).__name__ in ("Filter", "FlatMap"):
            return f"its {_op_name(op)} step changes the number of rows, which must be known before reading"
    context = ds.context
    if isinstance(source, ListFiles):
        if not above or not isinstance(above[0], ReadFiles):
            return "its file listing is not followed by a file read"
        return _file_units(source, above, context)
    if isinstance(source, Read):
        return _task_units(source, above, context)
    if isinstance(source, SourceOperator) and getattr(source, "input_data", None) is not None:
        return _block_units(source.input_data, above, context)
    if isinstance(source, InputData):
        return _block_units(source.input_data, above, context)
    return f"its source {_op_name(source)} is not one raytrain can cut into pieces"


def _file_units(listing, above, context) -> Units | str:
    import pyarrow as pa
    from ray.data._internal.datasource_v2.common.listing_utils import list_files_for_each_block
    from ray.data._internal.datasource_v2.interfaces.file_manifest import PATH_COLUMN_NAME

    scanner = getattr(above[0], "scanner", None)
    if listing.predicate is not None or getattr(scanner, "predicate", None) is not None:
        return "it filters rows while reading, so the row counts of its files are not known before reading"

    class _Task:  # list_files_for_each_block reads excluded ids from the task context
        kwargs: dict = {}

    _right_size_footer_readers(listing.file_indexer)
    blocks = list_files_for_each_block(
        [pa.table({PATH_COLUMN_NAME: list(listing.paths)})],
        _Task(),
        indexer=listing.file_indexer,
        filesystem=listing.filesystem,
        file_extensions=listing.file_extensions,
        partition_filter=listing.partition_filter,
        partition_pruner=listing.partition_pruner,
        preserve_order=True,
        predicate=None,
        limit=None,
        projected_columns=listing.projected_columns,
        shuffle_config=None,
        execution_idx=0,
    )
    manifest = pa.concat_tables(blocks) if blocks else None
    if manifest is None or manifest.num_rows == 0:
        return "its file listing found no files"
    if "__file_chunk_metadata" not in manifest.column_names:
        return "its file format keeps no row counts in metadata (Parquet does: raytrain data writes it)"
    chunks = manifest.column("__file_chunk_metadata").to_pylist()
    if any(chunk is None or chunk.get("num_rows") is None for chunk in chunks):
        return "some of its files have no row counts in their metadata"
    paths = manifest.column(PATH_COLUMN_NAME).to_pylist()
    labels = [f"{path} (row groups {_ranges(chunk.get('row_group_ids') or [])})" for path, chunk in zip(paths, chunks)]
    # Plain rows, turned back into one-row manifests only for the units a worker reads: a
    # slice of the manifest table would pickle (and ship to every worker) all of its buffers.
    payload = manifest.to_pylist()
    units = Units("files", tuple(int(c["num_rows"]) for c in chunks), labels, payload, above, listing, context)
    units.manifest_schema = manifest.schema
    return units


def _right_size_footer_readers(indexer) -> None:
    """Ray Data starts 32 footer-reading actors per listing (RAY_DATA_PARQUET_FOOTER_NUM_ACTORS),
    whatever the cluster: on a small machine their start-up dominates the listing. Unless the
    user set that variable, use no more actors than the cluster has CPUs."""
    import os

    import ray

    if "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS" in os.environ or not hasattr(indexer, "_num_actors"):
        return
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else 1
    indexer._num_actors = max(1, min(indexer._num_actors, cpus))
    if hasattr(indexer, "_max_inflight_batches"):
        indexer._max_inflight_batches = 2 * indexer._num_actors


def _task_units(read, above, context) -> Units | str:
    datasource = read.datasource
    if getattr(datasource, "should_create_reader", False):
        return f"its datasource {type(datasource).__name__} is a legacy reader"
    parallelism = read.parallelism if read.parallelism and read.parallelism > 0 else READ_TASK_UNITS
    tasks = datasource.get_read_tasks(parallelism)
    if not tasks:
        return "its datasource has nothing to read"
    rows = [task.metadata.num_rows for task in tasks]
    if any(n is None for n in rows):
        return f"its datasource ({datasource.get_name()}) does not know its row counts before reading"
    labels = [f"{datasource.get_name()} read task {i}" + _files(task.metadata) for i, task in enumerate(tasks)]
    return Units("tasks", tuple(int(n) for n in rows), labels, list(tasks), above, read, context)


def _block_units(bundles, above, context) -> Units:
    payload, rows = [], []
    for bundle in bundles:
        for entry in bundle.blocks:
            ref, meta = entry.ref, entry.metadata
            payload.append((ref, meta, bundle.schema))
            rows.append(int(meta.num_rows))
    return Units("blocks", tuple(rows), [f"block {i}" for i in range(len(rows))], payload, above, None, context)


def _files(metadata) -> str:
    files = getattr(metadata, "input_files", None) or []
    return f" ({files[0]}{' …' if len(files) > 1 else ''})" if files else ""


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "all"
    return f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}–{ids[-1]}"


def _op_name(op) -> str:
    name = type(op).__name__
    return {
        "RandomShuffle": "random_shuffle",
        "Repartition": "repartition",
        "Sort": "sort",
        "Zip": "zip",
        "Union": "union",
        "Aggregate": "an aggregation",
        "RandomizeBlocks": "randomize_block_order",
        "Limit": "limit",
        "Filter": "filter",
        "FlatMap": "flat_map",
        "Join": "join",
    }.get(name, name)
