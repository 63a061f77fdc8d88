"""Goodput accounted on a real run: a worker crash and a restart from the checkpoint show in
summary.json's `goodput` as a failure, steps redone and recovery, the parts adding up to the wall
time (Ray, 2 CPU workers, a tiny model)."""

from __future__ import annotations

import pytest
from rt_test_pipelines import RecordingPipeline

import raytrain

pytestmark = pytest.mark.ray


def test_a_crash_shows_as_recovery_and_steps_redone(crash_recovered_run):
    # 0.05 s a step; rank 0 dies after step 11, the last checkpoint is step 8: steps 9 to 11 are
    # redone (the 2-worker, 2-epoch run of tests/conftest.py, shared with test_train_ray.py)
    result = crash_recovered_run.result
    summary = result.summary
    g = summary["goodput"]
    print(g)
    assert summary["status"] == "finished" and g["failures"] == 1
    assert 0.05 <= g["step_s"] < 0.5
    assert g["kept_steps_s"] == pytest.approx(summary["steps"] * g["step_s"], rel=1e-3)
    assert g["redone_s"] == pytest.approx(3 * g["step_s"], rel=0.05)
    assert g["recovery_s"] > 1.0  # a restart of the worker group takes seconds
    assert g["start_s"] > 1.0
    assert g["checkpoint_stall_s"] > 0
    parts = ("kept_steps_s", "start_s", "checkpoint_stall_s", "recovery_s", "redone_s", "validation_s", "other_s")
    assert g["validation_s"] == 0.0  # no validation set: no pass to time
    assert sum(g[key] for key in parts) == pytest.approx(g["wall_s"], abs=0.01)
    assert g["other_s"] < 0.5 * g["wall_s"]
    assert g["goodput"] == pytest.approx(g["kept_steps_s"] / summary["wall_time_s"], abs=1e-3)
    report = (crash_recovered_run.run_dir / "report.md").read_text()
    assert "## Goodput" in report


def test_checkpoint_every_auto_measures_saves_and_counts_the_failure(ray_session, tmp_path, make_config):
    """--checkpoint-every auto on a real run with a crash: the interval is said at the start, moves
    once the first save is measured, the run recovers from its checkpoint and trains every row
    exactly once, and summary.json counts the failure."""
    import json

    out = tmp_path / "records"
    out.mkdir()
    pipeline = RecordingPipeline(str(out), num_rows=400, crash_at_step=14, step_sleep_s=0.02)
    cfg = make_config(
        workers=2,
        epochs=1,
        batch_size_per_worker=8,
        max_failures=1,
        checkpoint_every="auto",
        checkpoint_min_steps=3,
        checkpoint_max_steps=8,
        mtbf_hours=0.01,  # a failure every 36 s per node: Daly's interval is short, held within 3..8 steps
        checkpoint_async=False,
        name="auto",
    )
    result = raytrain.fit(pipeline, cfg)
    assert result.summary["status"] == "finished" and result.summary["failures_recovered"] == 1
    events = [json.loads(line) for line in (tmp_path / "auto" / "events.jsonl").read_text().splitlines()]
    lines = [e["message"] for e in events if e["message"].startswith("Checkpoint interval")]
    print("\n".join(lines))
    assert lines[0].startswith("Checkpoint interval 3 steps (--checkpoint-every auto")
    assert any("→" in line and "Daly" in line for line in lines)  # moved once a save was measured
    records = [json.loads(line) for path in out.glob("ids-rank*.jsonl") for line in path.read_text().splitlines()]
    second = [row for row in records if row["attempt"] == "second"]
    resumed_at = min(row["step"] for row in second)  # the step after the checkpoint auto chose
    trained = [i for row in records if row["attempt"] == "first" and row["step"] < resumed_at for i in row["ids"]]
    trained += [i for row in second for i in row["ids"]]
    assert sorted(trained) == list(range(400))  # every row once, from auto's last checkpoint on
