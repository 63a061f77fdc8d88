"""Pure tests of the data layer: checks that name bad data, and the streamed epoch serving each
rank exactly its rows of every step while reading only its own units (fake Ray Data units)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from raytrain.data.checks import Schema, check_columns, check_units, load_table
from raytrain.data.stream import Stream
from raytrain.data.write import write_datasets
from raytrain.errors import DataError, UsageError
from raytrain.rules import order
from raytrain.rules.order import StreamLayout
from raytrain.rules.steps import epoch_steps, micro_batches

CPU = torch.device("cpu")


class FakeUnits:
    """Stands in for raytrain.data.shards.Units: each unit a numpy batch, read in the asked order,
    in pieces of `piece` rows (as Ray Data yields blocks), recording what was read."""

    kind = "blocks"

    def __init__(self, unit_columns: list[dict[str, np.ndarray]], piece: int = 7, change=None):
        self.unit_columns = unit_columns
        self.rows = tuple(len(next(iter(u.values()))) for u in unit_columns)
        self.labels = [f"file-{i}.parquet" for i in range(len(unit_columns))]
        self.piece, self.change = piece, change
        self.read: list[int] = []

    def dataset(self, ids, *, limit=None):
        fake = self

        class _Dataset:
            def iter_batches(self, batch_size, batch_format, prefetch_batches=1):
                assert batch_format == "numpy" and batch_size is None
                joined = {c: np.concatenate([fake.unit_columns[i][c] for i in ids]) for c in fake.unit_columns[0]}
                if fake.change:
                    joined = fake.change(joined)
                fake.read.extend(ids)
                n = len(next(iter(joined.values())))
                for lo in range(0, n, fake.piece):
                    yield {c: v[lo : lo + fake.piece] for c, v in joined.items()}

        return _Dataset()


def make_units(sizes, piece=7, change=None):
    units, start = [], 0
    for n in sizes:
        ids = np.arange(start, start + n)
        units.append({"id": ids, "x": ids.astype(np.float32).reshape(n, 1).repeat(3, axis=1)})
        start += n
    return FakeUnits(units, piece=piece, change=change)


def schema_of(units):
    return Schema.of({c: v[:1] for c, v in units.unit_columns[0].items()})


def stream_of(units, window, partitions=24, skip_nan_rows=False):
    layout = StreamLayout(units.rows, window, partitions)
    sample = {c: v[:1] for c, v in units.unit_columns[0].items()}
    return Stream("train", units, layout, schema_of(units), sample, skip_nan_rows=skip_nan_rows)


def train_ids(stream, world_size, epoch, global_batch, accumulation=1, start=0, stop_after=None):
    """What each rank trains, per step, as the loop asks for it: {step index: ids of all ranks}."""
    epochs = [stream.epoch(seed=5, epoch=epoch, start=start, rank=r, world_size=world_size) for r in range(world_size)]
    out, skipped_before = {}, 0
    for step in epoch_steps(len(stream), global_batch, start)[:stop_after]:
        ids, counts = [], []
        for data in epochs:
            for piece in micro_batches(data.rows(step), accumulation):
                batch, count = data.batch(piece, CPU)
                counts.append(count)
                ids.extend(batch["id"].tolist()[:count])
        out[step.start] = sorted(ids)
        assert sum(counts) + sum(e.skipped_rows for e in epochs) - skipped_before == step.size
        skipped_before = sum(e.skipped_rows for e in epochs)
    return out, epochs


@pytest.mark.parametrize("sizes", [(200, 201, 202, 200, 200), (1003,), (64, 64, 64, 8, 0, 90)])
@pytest.mark.parametrize("world_size, accumulation", [(1, 1), (2, 1), (3, 2)])
def test_stream_serves_every_rank_its_rows_of_each_step_exactly_once(sizes, world_size, accumulation):
    units = make_units(sizes)
    stream = stream_of(units, window=100)
    for epoch in range(2):
        got, _ = train_ids(stream, world_size, epoch, 48, accumulation)
        reference = order.epoch_step_ids(stream.layout, 5, epoch, 48)
        assert list(got.values()) == [ids.tolist() for ids in reference]
        assert sorted(i for ids in got.values() for i in ids) == list(range(sum(sizes)))


def test_each_rank_reads_only_its_own_units_once_per_epoch():
    units = make_units([100] * 12)
    stream = stream_of(units, window=240, partitions=6)
    train_ids(stream, 3, 0, 48)
    assert sorted(units.read) == list(range(12))  # 1.0 pass over the units across the ranks


def test_a_restart_mid_epoch_skips_the_finished_units_and_trains_the_rest_once():
    units = make_units([50] * 20)
    stream = stream_of(units, window=200, partitions=4)
    before, _ = train_ids(stream, 2, 0, 40, stop_after=13)
    offset = 13 * 40
    units.read.clear()
    after, _ = train_ids(stream, 3, 0, 30, start=offset)
    trained = [i for ids in (*before.values(), *after.values()) for i in ids]
    assert sorted(trained) == list(range(1000))
    assert len(units.read) <= 20 // 2 + 4  # the unread half, plus the units being read when it stopped


def test_nan_row_stops_the_stream_naming_the_file_and_row():
    def poison(columns):
        columns["x"][columns["id"] == 230, 1] = np.nan
        return columns

    units = make_units([200, 200], change=poison)
    stream = stream_of(units, window=400, partitions=1)
    with pytest.raises(
        DataError, match=r"row 30 of file-1.parquet holds NaN or inf in column 'x'.*--skip-nan-rows.*--resume"
    ):
        train_ids(stream, 1, 0, 400)


def test_nan_rows_are_skipped_and_counted_with_skip_nan_rows():
    def poison(columns):
        columns["x"][columns["id"] == 3, 0] = np.nan
        columns["x"][columns["id"] == 250, 0] = np.inf
        return columns

    units = make_units([200, 200], change=poison)
    stream = stream_of(units, window=100, skip_nan_rows=True)
    got, epochs = train_ids(stream, 2, 0, 64)
    trained = sorted(i for ids in got.values() for i in ids)
    assert len(trained) == 398 and 3 not in trained and 250 not in trained
    assert sum(e.skipped_rows for e in epochs) == 2


def test_preprocessing_that_drops_rows_is_named():
    units = make_units([100, 100], change=lambda c: {k: v[(c["id"] < 150) | (c["id"] >= 200)] for k, v in c.items()})
    stream = stream_of(units, window=50, partitions=1)
    with pytest.raises(DataError, match=r"yielded 50 row\(s\) fewer than its metadata counts.*keeps every row"):
        train_ids(stream, 1, 0, 200)


def test_preprocessing_that_adds_rows_is_named():
    units = make_units([10], change=lambda c: {k: np.concatenate([v, v]) for k, v in c.items()})
    with pytest.raises(DataError, match="yielded more rows than the 10 its metadata counts"):
        list(check_units(units, [0], "train", schema_of(units), skip_nan_rows=False))


def test_load_table_reads_every_unit_once_and_drops_nan_rows_when_asked():
    def poison(columns):
        columns["x"][columns["id"] == 5, 0] = np.nan
        return columns

    units = make_units([30, 0, 20], change=poison)
    loaded = load_table(units, "train", schema_of(units), skip_nan_rows=True)
    assert loaded["dropped_rows"] == 1 and len(loaded["columns"]["id"]) == 49 and units.read == [0, 2]
    with pytest.raises(DataError, match="row 5 of file-0.parquet"):
        load_table(make_units([30], change=poison), "train", schema_of(units), skip_nan_rows=False)


def test_streamed_eval_covers_each_row_once_across_ranks():
    units = make_units([40, 41, 42, 5])
    stream = stream_of(units, window=50)
    seen = []
    for rank in range(3):
        for n, batch in stream.eval_batches(rank, 3, 16, CPU):
            seen.extend(batch["id"].tolist()[:n])
    assert sorted(seen) == list(range(128))
    idle = list(stream_of(make_units([10]), window=50).eval_batches(1, 2, 16, CPU))
    assert [n for n, _ in idle] == [0]


def test_split_rows_cuts_lane_ranges_into_micro_batches():
    rows = [(0, 10, 15), (3, 0, 4)]
    parts = micro_batches(rows, 3)
    assert [sum(hi - lo for *_, lo, hi in part) for part in parts] == [3, 3, 3]
    assert [r for part in parts for r in part] == [(0, 10, 13), (0, 13, 15), (3, 0, 1), (3, 1, 4)]
    assert micro_batches([(2, 5)], 2) == [[(2, 4)], [(4, 5)]]
    assert micro_batches([], 2) == [[], []]


# -- checks --------------------------------------------------------------------------------------


def test_non_numeric_column_is_named():
    with pytest.raises(DataError, match=r"column 'name' \(file-0\): dtype <U1 is not numeric"):
        check_columns({"name": np.array(["a", "b"])}, "train", "file-0")


def test_ragged_rows_and_changed_columns_are_named():
    schema = Schema.of({"x": np.zeros((1, 2), np.float32), "y": np.zeros(1)})
    with pytest.raises(DataError, match=r"column 'x' \(f\): rows of shape \(3,\) where the first batch had \(2,\)"):
        check_columns({"x": np.zeros((2, 3), np.float32), "y": np.zeros(2)}, "train", "f", schema)
    with pytest.raises(DataError, match=r"columns \['x'\] differ from the first batch's \['x', 'y'\]"):
        check_columns({"x": np.zeros((2, 2), np.float32)}, "train", "f", schema)


def test_read_failure_inside_ray_data_becomes_a_data_error():
    class Broken(FakeUnits):
        def dataset(self, ids, *, limit=None):
            class _Dataset:
                def iter_batches(self, **_):
                    raise RuntimeError(
                        "Traceback...\npyarrow.lib.ArrowInvalid: Could not open Parquet input source 'x.parquet'"
                    )
                    yield

            return _Dataset()

    units = Broken([{"x": np.zeros(3)}])
    with pytest.raises(
        DataError, match="dataset 'train' cannot be read: pyarrow.lib.ArrowInvalid: Could not open Parquet"
    ):
        list(check_units(units, [0], "train", Schema.of({"x": np.zeros(1)}), skip_nan_rows=False))


def test_schema_row_bytes():
    assert Schema.of({"x": np.zeros((1, 8, 8), np.float32), "y": np.zeros(1, np.int64)}).row_bytes() == 8 * 8 * 4 + 8


# -- a failed read of files names the file, the column and the fix -----------------------------------


class FileUnits(FakeUnits):
    """Units over Parquet files (one unit per file), whose reading fails as Ray Data's does on a
    file it cannot decode."""

    kind = "files"

    def __init__(self, paths, error: Exception):
        self.payload = [{"__path": str(path)} for path in paths]
        self.labels = [f"{path} (row groups all)" for path in paths]
        self.rows = tuple(4 for _ in paths)
        self.source = type("Listing", (), {"filesystem": None})()
        self.error = error

    def dataset(self, ids, *, limit=None):
        error = self.error

        class _Dataset:
            def iter_batches(self, **_):
                raise error
                yield

        return _Dataset()


def write_parquet_files(directory, columns_of_each: list[dict]) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for index, columns in enumerate(columns_of_each):
        path = directory / f"part-{index}.parquet"
        pq.write_table(pa.table(columns), path)
        paths.append(path)
    return paths


def read_units(units) -> None:
    list(check_units(units, list(range(len(units.rows))), "train", Schema.of({"image": np.zeros(1)}), skip_nan_rows=0))


def test_a_renamed_column_in_one_file_is_named_with_the_file_and_the_fix(tmp_path):
    good = {"image": np.zeros(4, np.float32), "label": np.zeros(4, np.int64)}
    renamed = {"img": np.zeros(4, np.float32), "label": np.zeros(4, np.int64)}
    retyped = {"image": np.zeros(4, np.float32), "label": np.array(["a", "b", "c", "d"])}
    paths = write_parquet_files(tmp_path, [good, good, renamed])
    units = FileUnits(paths, TypeError("buffer is too small for requested array"))
    with pytest.raises(DataError) as failure:
        read_units(units)
    assert str(failure.value) == (
        f"dataset 'train': file {paths[2]} lacks column(s) 'image', has column(s) 'img' instead compared with "
        f"{paths[0]}; every file of a dataset must have the same columns and types: rewrite that file with them "
        "(e.g. table.rename_columns(...) in pyarrow), or move it out of the dataset's directory"
    )
    (tmp_path / "first").mkdir()
    first = write_parquet_files(tmp_path / "first", [renamed, good, good])
    with pytest.raises(DataError, match=rf"file {first[0]} lacks column\(s\) 'image', has column\(s\) 'img' instead"):
        read_units(FileUnits(first, TypeError("buffer is too small for requested array")))  # the odd one is the first
    paths = write_parquet_files(tmp_path, [good, retyped])
    with pytest.raises(DataError, match=r"part-1.parquet has column 'label' as string, not int64 compared with"):
        read_units(FileUnits(paths, TypeError("buffer is too small for requested array")))


def test_a_file_deleted_or_damaged_after_the_listing_is_named_with_the_fix(tmp_path):
    columns = {"image": np.zeros(4, np.float32)}
    paths = write_parquet_files(tmp_path, [columns, columns, columns])
    paths[1].unlink()
    with pytest.raises(DataError, match=rf"file {paths[1]} is gone .*put it back and continue with --resume"):
        read_units(FileUnits(paths, FileNotFoundError(str(paths[1]))))
    paths = write_parquet_files(tmp_path, [columns, columns, columns])
    paths[2].write_bytes(paths[2].read_bytes()[:20])
    with pytest.raises(DataError, match=rf"file {paths[2]} cannot be read as Parquet \(.*\): it is truncated, damaged"):
        read_units(FileUnits(paths, OSError("Couldn't deserialize thrift")))


def test_a_read_error_no_file_explains_keeps_ray_datas_words_and_where(tmp_path):
    columns = {"image": np.zeros(4, np.float32)}
    paths = write_parquet_files(tmp_path, [columns, columns])
    with pytest.raises(DataError) as failure:
        read_units(FileUnits(paths, ValueError("map_batches: bad things")))
    assert str(failure.value).startswith(
        f"dataset 'train' cannot be read: ValueError: map_batches: bad things (while reading {paths[0]} (row groups "
        "all) or the units after it); check those files, or the pipeline's own steps over them (map_batches)"
    )


def test_the_parquet_pipeline_refuses_files_of_other_columns_before_reading_a_row(tmp_path):
    from pipelines.parquet.pipeline import check_same_columns

    good = {"image": np.zeros(4, np.float32), "label": np.zeros(4, np.int64)}
    paths = write_parquet_files(tmp_path, [good, {"img": np.zeros(4, np.float32), "label": np.zeros(4, np.int64)}])
    with pytest.raises(DataError, match=rf"file {paths[1]} lacks column\(s\) 'image', has column\(s\) 'img' instead"):
        check_same_columns(str(tmp_path))
    paths[1].write_text("not parquet")
    with pytest.raises(DataError, match=rf"file {paths[1]} cannot be read as Parquet .*move it out of {tmp_path}"):
        check_same_columns(str(tmp_path))
    paths[1].unlink()
    check_same_columns(str(tmp_path))


def test_nulls_from_a_file_of_other_columns_are_blamed_on_that_file(tmp_path):
    """Ray Data reads every file with the columns of all: a file lacking 'image' shows up as
    NaN in it. The file and its columns are the cause named, the NaN what was seen."""
    good = {"image": np.zeros(4, np.float32), "label": np.zeros(4, np.int64)}
    paths = write_parquet_files(tmp_path, [good, good, {"img": np.zeros(4, np.float32), "label": np.zeros(4)}])

    class Unified(FakeUnits):
        kind = "files"

    units = Unified([{"image": np.full(4, v, np.float32)} for v in (0.0, 0.0, np.nan)])
    units.payload = [{"__path": str(path)} for path in paths]
    units.source = type("Listing", (), {"filesystem": None})()
    with pytest.raises(DataError) as failure:
        list(check_units(units, [0, 1, 2], "train", Schema.of({"image": np.zeros(1)}), skip_nan_rows=False))
    message = str(failure.value)
    assert message.startswith(f"dataset 'train': file {paths[2]} lacks column(s) 'image', has column(s) 'img' instead")
    assert "(Seen as: dataset 'train': row 0 of file-2.parquet holds NaN or inf in column 'image'" in message


def test_a_data_error_raised_in_ray_datas_tasks_comes_back_as_it_was():
    from raytrain.data.checks import read_error

    wrapped = RuntimeError(
        "ray.exceptions.RayTaskError(UserCodeException): ray::MapBatches()\n"
        "raytrain.errors.DataError: dataset 'train': sample 217, field '0' has shape (5,) where sample 0's has (4,)"
    )
    error = read_error(FakeUnits([{"x": np.zeros(3)}]), [0], "train", wrapped)
    assert str(error) == "dataset 'train': sample 217, field '0' has shape (5,) where sample 0's has (4,)"


@pytest.mark.parametrize(
    ("rows", "out_has_a_file", "message"),
    [(None, True, "is not empty; choose a new directory"), (0, False, "--row-group-rows: got 0")],
)
def test_raytrain_data_refuses_its_options_before_ray_starts(tmp_path, rows, out_has_a_file, message):
    """`raytrain data` overwrites nothing and says what is wrong before it starts Ray (the
    command's session is entered only once OUT and --row-group-rows are accepted)."""
    entered = []
    if out_has_a_file:
        (tmp_path / "kept.parquet").write_bytes(b"")

    @contextlib.contextmanager
    def session():
        entered.append(True)
        yield

    with pytest.raises(UsageError, match=message):
        write_datasets(None, None, tmp_path, row_group_rows=rows, session=session)
    assert entered == [] and (tmp_path / "kept.parquet").exists() == out_has_a_file
