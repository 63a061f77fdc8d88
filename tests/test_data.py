"""Pure tests of the data layer's checks: bad data is named before training starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytrain.data import DataError, fingerprint, read_table


class FakeIterator:
    """Stands in for a Ray Data iterator: yields the given numpy batches."""

    def __init__(self, *batches):
        self.batches = batches

    def iter_batches(self, batch_size, batch_format):
        assert batch_format == "numpy"
        yield from self.batches


def batch(n=4, start=0, **extra):
    return {"x": np.arange(start, start + n, dtype=np.float32).reshape(n, 1).repeat(2, axis=1), "y": np.arange(n), **extra}


def test_reads_all_batches_in_order():
    table = read_table(FakeIterator(batch(3), batch(2, start=3)), "train")
    assert len(table) == 5 and table.columns["x"][:, 0].tolist() == [0, 1, 2, 3, 4]


def test_empty_dataset_is_named():
    with pytest.raises(DataError, match="dataset 'train' is empty"):
        read_table(FakeIterator(), "train")


def test_nan_fails_with_row_and_column_by_default():
    bad = batch(4)
    bad["x"][2, 1] = np.nan
    with pytest.raises(DataError, match=r"1 row\(s\) hold NaN or inf, the first is row 6 in column 'x'.*--skip-nan-rows"):
        read_table(FakeIterator(batch(4), bad), "train")


def test_nan_rows_can_be_skipped_and_counted():
    bad = batch(4)
    bad["x"][[0, 3], 0] = [np.nan, np.inf]
    table = read_table(FakeIterator(bad), "val", skip_nan_rows=True)
    assert table.dropped_rows == 2 and len(table) == 2 and np.isfinite(table.columns["x"]).all()


def test_all_rows_nan_is_an_error_even_when_skipping():
    bad = batch(2)
    bad["x"][:] = np.nan
    with pytest.raises(DataError, match="every row holds NaN"):
        read_table(FakeIterator(bad), "train", skip_nan_rows=True)


def test_non_numeric_column_is_named():
    with pytest.raises(DataError, match="column 'name': dtype <U1 is not numeric"):
        read_table(FakeIterator(batch(2, name=np.array(["a", "b"]))), "train")


def test_ragged_rows_are_named():
    with pytest.raises(DataError, match="column 'x': rows of different shapes"):
        read_table(FakeIterator(batch(2), {"x": np.zeros((2, 3), np.float32), "y": np.arange(2)}), "train")


def test_changing_columns_are_named():
    with pytest.raises(DataError, match="columns changed between blocks"):
        read_table(FakeIterator(batch(2), {"x": np.zeros((2, 2), np.float32)}), "train")


def test_read_failure_inside_ray_data_becomes_a_data_error():
    class Broken:
        def iter_batches(self, **_):
            raise RuntimeError("Traceback...\npyarrow.lib.ArrowInvalid: Could not open Parquet input source 'x.parquet'")
            yield

    with pytest.raises(DataError, match="dataset 'train' cannot be read: pyarrow.lib.ArrowInvalid: Could not open Parquet"):
        read_table(Broken(), "train")


def test_fingerprint_follows_order_and_content():
    a = read_table(FakeIterator(batch(3), batch(2, start=3)), "t")
    b = read_table(FakeIterator(batch(3), batch(2, start=3)), "t")
    c = read_table(FakeIterator(batch(2, start=3), batch(3)), "t")
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


# -- streamed datasets -------------------------------------------------------------------

from raytrain.data import Stream, drop_non_finite_rows, scan  # noqa: E402
from raytrain.plan import streamed_epoch_order  # noqa: E402


class RowsDataset:
    """Stands in for a Ray Data dataset: yields its rows in order, `batch_size` at a time."""

    def __init__(self, columns):
        self.columns = columns

    def iter_batches(self, batch_size, batch_format, prefetch_batches=1):
        assert batch_format == "numpy"
        n = len(next(iter(self.columns.values())))
        for lo in range(0, n, batch_size):
            yield {c: v[lo : lo + batch_size] for c, v in self.columns.items()}


def rows(n):
    return {"id": np.arange(n), "x": np.arange(n, dtype=np.float32).reshape(n, 1).repeat(3, axis=1)}


def stream_of(columns, window_rows):
    checked = scan(RowsDataset(columns), "train", keep_bytes=0, window_rows=window_rows, read_batch_size=7)
    assert checked.table is None  # too big to keep: only counted, checked and digested
    return Stream(RowsDataset(columns), "train", checked.num_rows, checked.window_rows, checked.window_digests)


def epoch_ids(stream, seed, epoch, start=0, chunk=5):
    data = stream.epoch(seed, epoch, start)
    out = []
    for lo in range(start, len(stream), chunk):
        out.extend(data.batch(lo, min(len(stream), lo + chunk), torch.device("cpu"))["id"].tolist())
    return out


@pytest.mark.parametrize("num_rows, window_rows", [(37, 10), (37, 37), (37, 100), (1001, 64), (7, 2), (1, 4)])
def test_stream_trains_the_windowed_order_exactly_once(num_rows, window_rows):
    stream = stream_of(rows(num_rows), window_rows)
    assert len(stream.digests) == -(-num_rows // window_rows)
    for epoch in (0, 1):
        ids = epoch_ids(stream, seed=3, epoch=epoch)
        assert ids == streamed_epoch_order(num_rows, window_rows, 3, epoch).tolist()
        assert sorted(ids) == list(range(num_rows))



def test_stream_starts_mid_epoch_at_the_stored_offset():
    stream = stream_of(rows(101), 16)
    full = epoch_ids(stream, seed=1, epoch=2)
    for offset in (0, 15, 16, 50, 100):
        assert epoch_ids(stream, seed=1, epoch=2, start=offset, chunk=9) == full[offset:]


def test_stream_reshuffles_each_epoch_and_repeats_for_a_seed():
    stream = stream_of(rows(200), 50)
    assert epoch_ids(stream, 0, 0) != epoch_ids(stream, 0, 1)
    assert epoch_ids(stream, 0, 1) == epoch_ids(stream_of(rows(200), 50), 0, 1)
    assert epoch_ids(stream, 0, 1) != epoch_ids(stream, 1, 1)


def test_stream_that_changed_since_the_check_is_named():
    stream = stream_of(rows(40), 10)
    changed = rows(40)
    changed["x"][25, 0] = -1.0
    stream.dataset = RowsDataset(changed)
    data = stream.epoch(0, 0, 0)
    data.batch(0, 20, torch.device("cpu"))  # windows 0 and 1 are unchanged
    with pytest.raises(DataError, match=r"window 2 of the stream \(rows from 20\) differs from what the driver checked"):
        data.batch(20, 30, torch.device("cpu"))


def test_stream_that_ends_early_is_named():
    stream = stream_of(rows(40), 10)
    stream.dataset = RowsDataset(rows(25))
    data = stream.epoch(0, 0, 0)
    with pytest.raises(DataError):
        data.batch(20, 40, torch.device("cpu"))


def test_stream_eval_batches_cover_a_contiguous_range():
    stream = stream_of(rows(23), 10)
    got = [(n, b["id"].tolist()) for n, b in stream.eval_batches(5, 17, 4, torch.device("cpu"))]
    assert sum(n for n, _ in got) == 12 and [i for _, ids in got for i in ids] == list(range(5, 17))
    empty = list(stream.eval_batches(23, 23, 4, torch.device("cpu")))
    assert len(empty) == 1 and empty[0][0] == 0 and len(empty[0][1]["id"]) == 1  # weight 0, joins the reduction


def test_scan_keeps_small_datasets_and_counts_bytes():
    checked = scan(RowsDataset(rows(30)), "train", read_batch_size=8)
    assert checked.table is not None and len(checked.table) == 30
    assert checked.num_bytes == 30 * (8 + 12) and checked.window_digests == []


def test_scan_chooses_a_window_from_the_row_size_when_asked():
    checked = scan(RowsDataset(rows(30)), "train", keep_bytes=0, window_rows=None)
    assert checked.window_rows >= 1024 and len(checked.window_digests) == 1


def test_skipped_nan_rows_are_the_rows_the_stream_filter_drops():
    columns = rows(30)
    columns["x"][[3, 17], 1] = np.nan
    checked = scan(RowsDataset(columns), "train", skip_nan_rows=True, keep_bytes=0, window_rows=8, read_batch_size=5)
    assert checked.dropped_rows == 2 and checked.num_rows == 28
    filtered = drop_non_finite_rows(columns)
    stream = Stream(RowsDataset(filtered), "train", checked.num_rows, 8, checked.window_digests)
    ids = epoch_ids(stream, 0, 0)
    assert sorted(ids) == sorted(set(range(30)) - {3, 17})


def test_stream_serves_a_rank_with_an_empty_micro_batch_after_its_rows():
    """Accumulation can give a rank an empty micro-batch after a non-empty one: one row of
    a window at hand, never a step back in the stream."""
    stream = stream_of(rows(40), 10)
    data = stream.epoch(0, 0, 0)
    data.batch(8, 12, torch.device("cpu"))  # spans windows 0 and 1
    data.batch(12, 13, torch.device("cpu"))  # window 0 dropped
    assert len(data.batch(5, 5, torch.device("cpu"))["id"]) == 1
    assert data.batch(13, 20, torch.device("cpu"))["id"].tolist() == streamed_epoch_order(40, 10, 0, 0)[13:20].tolist()
    fresh = stream.epoch(0, 1, 30)
    assert len(fresh.batch(40, 40, torch.device("cpu"))["id"]) == 1  # nothing loaded yet: the last window


def test_a_dataset_that_outgrows_the_memory_limit_mid_scan_is_digested_from_its_first_row():
    streamed = scan(RowsDataset(rows(50)), "train", keep_bytes=0, window_rows=8, read_batch_size=7)
    outgrown = scan(RowsDataset(rows(50)), "train", keep_bytes=300, window_rows=8, read_batch_size=7)  # 20 B per row
    kept = scan(RowsDataset(rows(50)), "train", window_rows=8, read_batch_size=7)
    assert outgrown.table is None and outgrown.window_digests == streamed.window_digests and len(streamed.window_digests) == 7
    assert kept.table is not None and kept.window_digests == []  # held in memory: nothing to digest
