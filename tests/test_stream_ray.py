"""Streamed datasets (--shuffle-window-rows) on CPU Ray workers: the windowed order, every
row exactly once per epoch, and an interrupted epoch finished at another worker count."""

from __future__ import annotations

import pytest
from rt_test_pipelines import RecordingPipeline, read_jsonl

import raytrain
from raytrain import plan

pytestmark = pytest.mark.ray

ROWS, WINDOW, SEED = 203, 50, 5


def test_crash_then_resume_at_another_worker_count_trains_each_row_once(ray_session, tmp_path):
    out = tmp_path / "records"
    out.mkdir()
    pipeline = RecordingPipeline(str(out), num_rows=ROWS, crash_at_step=9)
    base = dict(
        epochs=2, global_batch_size=12, shuffle_window_rows=WINDOW, seed=SEED, checkpoint_every_steps=4,
        log_every_steps=1, storage=str(tmp_path), name="streamed", max_failures=0,
    )  # fmt: skip
    # Rank 0's process dies at step 9 of epoch 0 and no retry is allowed: the run fails
    # with its step-8 checkpoint in storage.
    with pytest.raises(raytrain.RunFailed):
        raytrain.fit(pipeline, raytrain.TrainConfig(workers=2, **base))
    # Continued on 3 workers instead of 2: the same global batch, the epoch from offset 96.
    result = raytrain.fit(pipeline, raytrain.TrainConfig(workers=3, resume=True, **base))
    assert result.summary["status"] == "finished"
    assert result.summary["samples_seen"] == 2 * ROWS

    records = [row for rank in range(3) if (out / f"ids-rank{rank}.jsonl").exists() for row in read_jsonl(out / f"ids-rank{rank}.jsonl")]
    first = [row for row in records if row["attempt"] == "first"]
    second = [row for row in records if row["attempt"] == "second"]
    assert {row["world_size"] for row in first} == {2} and {row["world_size"] for row in second} == {3}
    resumed_at = min(row["step"] for row in second)
    assert resumed_at == 8

    def trained(rows):  # ids in epoch order: by step, then by rank (ranks hold contiguous slices)
        return [i for row in sorted(rows, key=lambda r: (r["step"], r["rank"])) for i in row["ids"]]

    epoch0 = trained([r for r in first if r["epoch"] == 0 and r["step"] < resumed_at]) + trained([r for r in second if r["epoch"] == 0])
    epoch1 = trained([r for r in second if r["epoch"] == 1])
    # Each epoch: every row exactly once, in the windowed order the plan defines (the
    # dataset's own order is the ids 0..202), whatever the worker count.
    for epoch, ids in ((0, epoch0), (1, epoch1)):
        assert ids == plan.streamed_epoch_order(ROWS, WINDOW, SEED, epoch).tolist()
    assert epoch0 != epoch1
