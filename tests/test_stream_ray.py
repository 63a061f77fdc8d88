"""Streamed, sharded datasets on CPU Ray workers: multi-file Parquet and multi-block sources,
every row exactly once per epoch in local mode and at 2 and 3 workers, each row preprocessed
about once per epoch across the whole run, a rank killed mid-epoch and the run resumed at
another worker count, and a bad row that stops the run once, with exit 2, naming the row."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rt_test_pipelines import ShardedRecordingPipeline, preprocessed_rows, read_jsonl, write_id_parquet

import raytrain
from raytrain.cli import main
from raytrain.data import shards
from raytrain.data.sources import PROBE_ROWS
from raytrain.rules import order

pytestmark = pytest.mark.ray

ROWS, GLOBAL_BATCH, WINDOW, SEED, EPOCHS = 1003, 48, 120, 5, 2


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    return write_id_parquet(tmp_path_factory.mktemp("ids") / "train", ROWS, num_files=7)


def records(out: Path) -> list[dict]:
    return [row for path in sorted(out.glob("ids-rank*.jsonl")) for row in read_jsonl(path)]


def steps_by_epoch(rows: list[dict]) -> dict[int, dict[int, list[int]]]:
    """{epoch: {global step: sorted ids of every rank}}, and each step's ranks agree on it."""
    out: dict[int, dict[int, list[int]]] = {}
    for row in rows:
        out.setdefault(row["epoch"], {}).setdefault(row["step"], []).extend(row["ids"])
    return {epoch: {step: sorted(ids) for step, ids in steps.items()} for epoch, steps in out.items()}


@pytest.fixture
def run(make_config):
    """`run(pipeline, name, **overrides)`: the run of `pipeline` with the settings every run here
    shares; keywords override them."""
    cfg = dict(
        epochs=EPOCHS,
        global_batch_size=GLOBAL_BATCH,
        shuffle_window_rows=WINDOW,
        seed=SEED,
        log_every_steps=5,
        max_failures=0,
        schedule="constant",
    )
    return lambda pipeline, name, **overrides: raytrain.fit(pipeline, make_config(**{**cfg, "name": name, **overrides}))


def test_units_of_multi_file_parquet_and_multi_block_items(ray_session, parquet_dir, tmp_path):
    pipeline = ShardedRecordingPipeline(str(tmp_path), path=str(parquet_dir))
    units = shards.split(pipeline.build_datasets(None)["train"])
    assert units.kind == "files" and len(units.rows) == 7 and units.num_rows == ROWS
    ids = [int(i) for b in units.dataset([4, 0]).iter_batches(batch_size=None, batch_format="numpy") for i in b["id"]]
    assert ids == list(range(574, 717)) + list(range(0, 144))  # units 4 then 0, each whole, in that order
    items = shards.split(ShardedRecordingPipeline(str(tmp_path), num_blocks=6).build_datasets(None)["train"])
    assert items.kind == "blocks" and len(items.rows) == 6 and items.num_rows == ROWS
    import ray.data

    assert "random_shuffle" in shards.split(ray.data.range(10).random_shuffle())


def slow_first_rows(batch):
    time.sleep(0.5 if batch["id"][0] < 200 else 0.0)  # the first blocks finish last
    return batch


def test_a_dataset_that_cannot_be_cut_is_materialized_in_the_order_of_its_rows(ray_session):
    """A position names the same rows in every run only if the blocks keep the rows' order,
    not the order in which their tasks finished."""
    import ray.data

    ds = ray.data.range(1_000, override_num_blocks=10).map_batches(slow_first_rows).filter(lambda row: True)
    units = shards.split(shards.materialize_in_order(ds))
    ids = [int(i) for b in units.dataset(range(len(units.rows))).iter_batches(batch_format="numpy") for i in b["id"]]
    assert ids == list(range(1_000))


# Local mode (--workers 0: the per-worker loop in this process, no Ray Train workers) is the
# world of one rank, without the start of a Ray Train worker group.
@pytest.mark.parametrize("workers, source", [(0, "parquet"), (2, "items"), (3, "parquet")])
def test_every_row_once_per_epoch_the_same_steps_at_any_worker_count_read_once(
    ray_session, parquet_dir, tmp_path, workers, source, run
):
    out = tmp_path / "records"
    out.mkdir()
    pipeline = ShardedRecordingPipeline(str(out), path=str(parquet_dir) if source == "parquet" else None, num_blocks=6)
    result = run(pipeline, "sharded", workers=workers)
    assert result.summary["status"] == "finished" and result.summary["samples_seen"] == EPOCHS * ROWS

    rows = records(out)
    by_epoch = steps_by_epoch(rows)
    units = shards.split(pipeline.build_datasets(None)["train"])
    layout = order.StreamLayout(units.rows, WINDOW, 24)
    for epoch in range(EPOCHS):
        steps = by_epoch[epoch]
        expected = order.epoch_step_ids(layout, SEED, epoch, GLOBAL_BATCH)
        # Each step trains the rows the plan names — which do not depend on the worker count —
        # and the epoch trains every row once.
        assert list(steps.values()) == [ids.tolist() for ids in expected]
        assert sorted(i for ids in steps.values() for i in ids) == list(range(ROWS))
        per_rank_steps = {
            r: sorted({row["step"] for row in rows if row["rank"] == r and row["epoch"] == epoch})
            for r in range(max(workers, 1))  # local mode is rank 0
        }
        assert len({tuple(s) for s in per_rank_steps.values()}) == 1  # every rank ran the same steps
    assert by_epoch[0] != by_epoch[1]
    # Sharded: the pipeline's preprocessing handled each row about once per epoch, across all
    # processes of the run (the driver's first-batch probe included).
    passes = preprocessed_rows(out) / (EPOCHS * ROWS)
    assert passes <= 1.1, passes


def test_rank_killed_mid_epoch_then_resumed_at_another_worker_count(ray_session, tmp_path, run):
    # 7 files of 4 row groups (36 rows) each: 28 units in 4 partitions of 7 units.
    data = write_id_parquet(tmp_path / "train", ROWS, num_files=7, row_group_rows=36)
    out = tmp_path / "records"
    out.mkdir()
    pipeline = ShardedRecordingPipeline(str(out), path=str(data), crash_at_step=13)
    # Rank 0's process dies at step 13 of epoch 0; no retry allowed: the run fails with its
    # step-12 checkpoint in storage, then continues on 3 workers instead of 2.
    # Synchronous checkpoints: the step-12 one is whole before step 13 begins.
    with pytest.raises(raytrain.RunFailed):
        run(pipeline, "killed", workers=2, checkpoint_every_steps=4, data_partitions=4, checkpoint_async=False)
    before = preprocessed_rows(out)
    result = run(pipeline, "killed", workers=3, checkpoint_every_steps=4, data_partitions=4, resume=True)
    assert result.summary["status"] == "finished" and result.summary["samples_seen"] == EPOCHS * ROWS

    rows = records(out)
    second = [r for r in rows if r["attempt"] == "second"]
    resumed_at = min(r["step"] for r in second)
    assert resumed_at == 12 and {r["world_size"] for r in second} == {3}
    kept = [r for r in rows if r["attempt"] == "first" and r["step"] < resumed_at] + second
    for epoch, steps in steps_by_epoch(kept).items():
        assert sorted(i for ids in steps.values() for i in ids) == list(range(ROWS)), epoch
    # The resumed attempt skipped the finished units of epoch 0 from metadata: it preprocessed
    # the rest of epoch 0 — again, per partition, at most the shuffle block (30 rows) and the
    # unit (36 rows) it was in when it stopped — plus epoch 1, not two whole epochs.
    rest = ROWS - resumed_at * GLOBAL_BATCH
    assert preprocessed_rows(out) - before <= rest + 4 * (30 + 36) + ROWS + PROBE_ROWS


def test_bad_row_stops_the_run_once_with_exit_2_naming_the_row(ray_session, tmp_path, capsys):
    data = write_id_parquet(tmp_path / "bad", ROWS, num_files=7, nan_at_id=600)  # row 26 of part-004
    out = tmp_path / "records"
    out.mkdir()
    code = main(
        [
            "train",
            "rt_test_pipelines:ShardedRecordingPipeline",
            "--pipeline-arg",
            f"path={data}",
            "--pipeline-arg",
            f"out={out}",
            "--workers",
            "2",
            "--epochs",
            "1",
            "--global-batch-size",
            "48",
            "--shuffle-window-rows",
            "120",
            "--max-failures",
            "3",
            "--storage",
            str(tmp_path),
            "--name",
            "bad",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    # raytrain's own answer is one line (the shared test Ray also forwards the workers' logs).
    ours = [line for line in err.splitlines() if line.startswith("raytrain train:")]
    assert len(ours) == 1, err
    assert (
        "row 26 of" in ours[0]
        and "part-004.parquet" in ours[0]
        and "column 'x'" in ours[0]
        and "--skip-nan-rows" in ours[0]
    )
    # Not retried, though --max-failures 3 allowed it: rank 0 writes one "plan" event per attempt
    # (a retry without a checkpoint would write another), and no restore. The bad row may sit in
    # the first block a rank reads, so no training step need have run.
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "bad" / "events.jsonl")]
    assert kinds.count("plan") == 1 and "restore" not in kinds, kinds
    assert json.loads((tmp_path / "bad" / "summary.json").read_text())["status"] == "failed"


def test_a_file_whose_column_was_renamed_stops_the_run_naming_the_file_and_the_column(ray_session, tmp_path, capsys):
    import pyarrow.parquet as pq

    data = write_id_parquet(tmp_path / "drift", ROWS, num_files=7)
    odd = sorted(data.glob("*.parquet"))[4]
    table = pq.read_table(odd)
    pq.write_table(table.rename_columns(["g3" if c == "f3" else c for c in table.column_names]), odd)
    out = tmp_path / "records"
    out.mkdir()
    args = ["--pipeline-arg", f"path={data}", "--pipeline-arg", f"out={out}", "--workers", "2", "--epochs", "1"]
    args += ["--global-batch-size", "48", "--shuffle-window-rows", "120", "--max-failures", "3"]
    code = main(
        ["train", "rt_test_pipelines:ShardedRecordingPipeline", *args, "--storage", str(tmp_path), "--name", "d"]
    )
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("raytrain train:")]
    assert code == 2 and len(ours) == 1, err
    assert f"file {odd} lacks column(s) 'f3', has column(s) 'g3' instead compared with" in ours[0]
    assert "every file of a dataset must have the same columns and types" in ours[0]
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "d" / "events.jsonl")]
    assert kinds.count("plan") == 1 and "restore" not in kinds, kinds  # not retried
