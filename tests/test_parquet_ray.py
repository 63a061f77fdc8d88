"""CPU Ray tier: `raytrain data` writes Parquet shards; the `parquet` pipeline trains on them
and names bad data (missing column, unreadable file, NaN) before training starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.digits.pipeline import load_arrays, split
from raytrain.cli import main

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def digits_parquet(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("digits-parquet")
    assert main(["data", "digits", "--out", str(out)]) == 0
    return out


def test_data_command_writes_each_dataset_as_parquet(digits_parquet):
    train = pq.read_table(sorted((digits_parquet / "train").glob("*.parquet")))
    val = pq.read_table(sorted((digits_parquet / "val").glob("*.parquet")))
    assert train.num_rows + val.num_rows == 1797
    assert set(train.column_names) == {"image", "label"}
    # Written in a seeded random order (--shuffle-seed 0), not the pipeline's: the same
    # rows, in another order.
    _, labels = load_arrays()
    train_rows, _ = split(len(labels))
    written = train.column("label").to_numpy()
    assert sorted(written) == sorted(labels[train_rows]) and not np.array_equal(written, labels[train_rows])


def test_parquet_pipeline_streams_written_shards(digits_parquet, tmp_path, capsys):
    code = main(
        [
            "train",
            "parquet",
            "--pipeline-arg",
            f"path={digits_parquet / 'train'}",
            "--pipeline-arg",
            f"val_path={digits_parquet / 'val'}",
            "--pipeline-arg",
            "label=label",
            "--workers",
            "2",
            "--epochs",
            "4",
            "--storage",
            str(tmp_path),
            "--name",
            "pq",
            "--shuffle-window-rows",
            "300",
        ]
    )
    assert code == 0
    # streamed from the Parquet files by every worker (the small val set stays in memory)
    assert "dataset 'train': 1,438 rows" in capsys.readouterr().out
    summary = json.loads((tmp_path / "pq" / "summary.json").read_text())
    assert summary["samples_seen"] == 4 * 1438 and summary["final_metrics"]["val_accuracy"] >= 0.9


# Scenario stage (docs/testing.md): --compile on Ray is a fit of its own (the ray stage has no room);
# in CI the count is tests/test_device.py's, the summary and report test_run_files.py's.
@pytest.mark.scenario
def test_compile_builds_graphs_for_a_sequential_model_on_every_rank(digits_parquet, tmp_path):
    """The parquet pipeline's model is an nn.Sequential, which nn.Module.compile would leave eager."""
    args = ["train", "parquet", "--pipeline-arg", f"path={digits_parquet / 'train'}", "--pipeline-arg", "label=label"]
    args += ["--workers", "2", "--epochs", "1", "--compile", "--storage", str(tmp_path), "--name", "pqc"]
    assert main(args) == 0
    run = tmp_path / "pqc"
    record = json.loads((run / "summary.json").read_text())["compile"]
    assert record["compiled"] is True and min(record["graphs"]) >= 1 and len(record["graphs"]) == 2, record
    assert min(record["seconds"]) > 0.0, record
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    plan = next(e for e in events if e["kind"] == "plan")["message"]
    assert "to compile" in plan and "compiled" not in plan
    said = [e for e in events if e["kind"] == "compile"]
    assert len(said) == 1 and said[0]["message"].startswith("Compiled by step"), said
    assert "Compile: graphs built by rank" in (run / "report.md").read_text()


def bad_run(tmp_path, capsys, *pipeline_args) -> str:
    args = ["train", "parquet", "--workers", "2", "--epochs", "1", "--storage", str(tmp_path)]
    for arg in pipeline_args:
        args += ["--pipeline-arg", arg]
    assert main(args) == 2
    err = capsys.readouterr().err
    # raytrain's answer is one line (the shared test Ray also forwards its workers' logs).
    ours = [line for line in err.splitlines() if line.startswith("raytrain train:")]
    assert len(ours) == 1, err
    assert not list(tmp_path.glob("*/checkpoint_*"))
    return ours[0]


def write(path: Path, **columns) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path / "part-0.parquet")
    return path


def test_missing_column_is_named(ray_session, tmp_path, capsys):
    data = write(tmp_path / "d", a=np.arange(10.0), b=np.arange(10.0), y=np.arange(10) % 2)
    err = bad_run(tmp_path, capsys, f"path={data}", "label=target")
    assert "column(s) target not in" in err and "a, b, y" in err


def test_unreadable_parquet_file_is_named(ray_session, tmp_path, capsys):
    data = tmp_path / "broken"
    data.mkdir()
    (data / "part-0.parquet").write_bytes(b"not parquet at all")
    err = bad_run(tmp_path, capsys, f"path={data}", "label=y")
    assert "cannot read" in err and "part-0.parquet" in err or "Parquet" in err


def test_nan_in_features_fails_with_the_row_unless_skipped(ray_session, tmp_path, capsys):
    x = np.arange(40.0)
    x[17] = np.nan
    data = write(tmp_path / "nan", x=x, y=np.arange(40) % 2)
    err = bad_run(tmp_path, capsys, f"path={data}", "label=y", "val_fraction=0")
    assert (
        "row 17 of" in err
        and "part-0.parquet" in err
        and "NaN or inf in column 'features'" in err
        and "--skip-nan-rows" in err
    )
    code = main(
        [
            "train",
            "parquet",
            "--pipeline-arg",
            f"path={data}",
            "--pipeline-arg",
            "label=y",
            "--pipeline-arg",
            "val_fraction=0",
            "--workers",
            "2",
            "--epochs",
            "1",
            "--storage",
            str(tmp_path),
            "--name",
            "skipped",
            "--skip-nan-rows",
        ]
    )
    assert code == 0
    assert json.loads((tmp_path / "skipped" / "summary.json").read_text())["samples_seen"] == 39


def test_string_label_or_feature_columns_are_named(ray_session, tmp_path, capsys):
    data = write(tmp_path / "strings", x=np.arange(10.0), y=np.array(["cat", "dog"] * 5))
    err = bad_run(tmp_path, capsys, f"path={data}", "label=y", "val_fraction=0")
    assert "label column 'y' holds text (string)" in err and ".astype('category').cat.codes" in err
    data = write(tmp_path / "strfeat", x=np.array(["a"] * 10), y=np.arange(10) % 2)
    err = bad_run(tmp_path, capsys, f"path={data}", "label=y", "val_fraction=0")
    assert "feature column(s) x hold text" in err and "--pipeline-arg features=COL,COL" in err
