"""`raytrain data`: a pipeline's datasets written as Parquet, in the units a streamed run reads.

Rows are written in a seeded random order (a streamed run's window shuffle then mixes rows
of the whole dataset) and in many row groups: the units a streamed run deals to its
partitions and workers.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from raytrain.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.pipeline import Pipeline

# At least this many row groups (a few per partition), of at most DATA_GROUP_ROWS rows each,
# and DATA_GROUPS_PER_FILE row groups per file.
DATA_UNITS, DATA_GROUP_ROWS, DATA_GROUPS_PER_FILE = 96, 8192, 16


def parquet_layout(rows: int, group_rows: int | None = None) -> tuple[int, int]:
    """(rows per row group, files) for writing `rows` rows."""
    group_rows = group_rows or max(1, min(DATA_GROUP_ROWS, -(-rows // DATA_UNITS)))
    return group_rows, max(1, -(-rows // (group_rows * DATA_GROUPS_PER_FILE)))


def write_datasets(
    pipe: "Pipeline",
    cfg: "TrainConfig",
    out: str | Path,
    *,
    shuffle_seed: int = 0,
    row_group_rows: int | None = None,
    session: Callable[[], AbstractContextManager[Any]],
    echo: Callable[[str], None] = print,
) -> Path:
    """Write each of the pipeline's datasets under OUT/<dataset>/*.parquet; returns OUT.
    `shuffle_seed` -1 keeps the pipeline's order. `session()`: Ray up while the rows are
    written (the command's `raytrain.driver.session.ray_session`), entered once OUT is checked."""
    from raytrain.data.sources import build_datasets
    from raytrain.sampled import Sampled

    out = Path(out).expanduser().absolute()
    if row_group_rows is not None and row_group_rows < 1:
        raise UsageError(f"--row-group-rows: got {row_group_rows}; must be a positive row count, e.g. 8192")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out: {out} is not empty; choose a new directory so no data is overwritten")
    with session():
        for name, ds in build_datasets(pipe, cfg).items():
            if isinstance(ds, Sampled):  # drawn at every step: no rows to write
                echo(f"{name}: sampled (raytrain.Sampled), drawn at every step from its own source; not written")
                continue
            rows = ds.count()
            group_rows, num_files = parquet_layout(rows, row_group_rows)
            if shuffle_seed >= 0:
                ds = ds.random_shuffle(seed=shuffle_seed)
            ds.repartition(num_files).write_parquet(str(out / name), row_group_size=group_rows)
            files = sorted((out / name).glob("*.parquet"))
            echo(
                f"{name}: {rows:,} rows in {len(files)} Parquet file(s) of row groups of up to {group_rows:,} rows "
                f"under {out / name}"
            )
    return out
