"""Pure tests of the data layer's checks: bad data is named before training starts."""

from __future__ import annotations

import numpy as np
import pytest

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
