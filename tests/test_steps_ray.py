"""CPU Ray tier: step-based runs end to end — --max-steps inside an epoch with evaluations every
N steps and the records of what ran; a kill and a resume at another worker count, exact and
stopping at N, for a walked and for a sampled training set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from rt_test_pipelines import StepsPipeline, read_jsonl

import raytrain
from raytrain.rules.steps import drawn_items, epoch_order

pytestmark = pytest.mark.ray


def trained_ids(out: Path, world_sizes: range) -> dict[int, list[int]]:
    """step -> the ids every rank trained in it (of the last attempt that took that step)."""
    rows = [row for rank in world_sizes for row in read_jsonl(out / f"ids-rank{rank}.jsonl")]
    resumed_at = min((row["step"] for row in rows if row["attempt"] == "second"), default=None)
    steps: dict[int, list[int]] = {}
    for row in rows:
        redone = resumed_at is not None and row["step"] >= resumed_at
        if row["attempt"] == ("second" if redone else "first"):
            steps.setdefault(row["step"], []).extend(row["ids"])
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


def test_max_steps_stops_inside_an_epoch_with_evaluations_every_n_steps_and_records_what_ran(
    ray_session, tmp_path, make_config
):
    out = tmp_path / "records"
    out.mkdir()
    cfg = make_config(
        workers=2,
        max_steps=6,  # 64 rows of 16: 4 steps an epoch, so the run ends 2 steps into the second
        global_batch_size=16,
        eval_every_steps=2,
        eval_batches=1,
        name="steps",
    )
    result = raytrain.fit(StepsPipeline(str(out), num_rows=64), cfg)
    run_dir = Path(result.run_dir)

    summary = result.summary
    assert (summary["status"], summary["steps"], summary["epochs"], summary["samples_seen"]) == ("finished", 6, 1, 96)
    assert summary["model_path"] and (run_dir / "model.pt").exists()
    assert any(path.name.startswith("checkpoint_s000000006_") for path in run_dir.iterdir())  # a checkpoint at N
    trained = trained_ids(out, range(2))
    assert list(trained) == list(range(6))  # no step after the budget's last
    assert sorted(i for step in range(4) for i in trained[step]) == list(range(64))  # epoch 1: every row once
    assert sorted(i for step in (4, 5) for i in trained[step]) == sorted(epoch_order(64, 0, 1)[:32].tolist())

    rows = read_jsonl(run_dir / "metrics.jsonl")
    validated = [(row["step"], bool(row.get("epoch_end"))) for row in rows if "val_loss" in row]
    assert validated == [(2, False), (4, True), (6, False)]  # every 2 steps; the epoch's own; the last step's
    assert rows[-1]["step"] == 6 and "epoch_loss" in rows[-1]
    events = read_jsonl(run_dir / "events.jsonl")
    assert events[0]["message"].endswith("; 6 steps")  # the plan line says the budget
    evaluations = [e["message"] for e in events if e["kind"] == "eval"]
    assert evaluations[0].startswith("step 2 (epoch 1): loss ") and "val_loss" in evaluations[0]
    assert evaluations[-1].startswith("step 6 (epoch 2, the last step): epoch_loss ")
    from test_tracking import load_tensorboard, series

    assert [step for step, _ in series(load_tensorboard(run_dir), "val/loss")] == [2, 4, 6]

    # what ran, said as such: the pipeline's own optimizer and schedule
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["optimizer"] == "the pipeline's build_optimizer (AdamW, 2 groups)"
    assert config["schedule"] == "the pipeline's lr_factor" and "weight_decay" not in config
    report = (run_dir / "report.md").read_text()
    assert "the pipeline's build_optimizer (AdamW, 2 groups)" in report and "loss (last window: steps 5–6)" in report
    assert summary["final_loss_steps"] == [5, 6] and {"loss", "epoch_loss", "val_loss"} <= set(summary["final_metrics"])

    # the resolved plan, where the pipeline needs it
    planned = json.loads((out / "plan-datasets-rank0.json").read_text())
    assert planned == {
        "global_batch_size": 16,
        "batch_size_per_worker": 8,
        "world_size": 2,
        "max_steps": 6,
        "total_steps": None,
    }
    built = json.loads((out / "plan-optimizer-rank1.json").read_text())
    assert (built["global_batch_size"], built["batch_size_per_worker"], built["total_steps"]) == (16, 8, 6)


# Scenario stage (docs/testing.md): in CI a kill resumed at another worker count is
# tests/test_stream_ray.py's, a step budget resumed at another count tests/test_hf_ray.py's, and
# sampled windows train in tests/test_examples_ray.py; the rows of a resumed, resized run, walked
# or sampled, and the summary across the resume are tests/test_steps.py's and tests/test_plan.py's.
@pytest.mark.scenario
@pytest.mark.parametrize("sampled", [False, True], ids=["walked", "sampled"])
def test_max_steps_with_a_kill_and_a_resume_at_another_worker_count_is_exact_and_stops_at_n(
    ray_session, tmp_path, sampled, make_config
):
    out = tmp_path / "records"
    out.mkdir()
    base = dict(
        max_steps=8,  # 60 rows of 12: 5 steps an epoch, so the run ends 3 steps into the second
        global_batch_size=12,
        reference_batch_size=6,  # as config.yaml froze it at the first start (the Python API resumes what it is given)
        checkpoint_every_steps=2,
        log_every_steps=1,
        name="killed",
    )
    pipeline = StepsPipeline(str(out), num_rows=60, sampled=sampled, crash_at_step=5)
    with pytest.raises(raytrain.RunFailed):  # rank 0's process dies at step 5, and no restart is allowed
        raytrain.fit(pipeline, make_config(workers=2, max_failures=0, **base))
    first = json.loads((tmp_path / "killed" / "summary.json").read_text())

    result = raytrain.fit(pipeline, make_config(workers=1, resume=True, **base))
    summary = result.summary
    assert (summary["status"], summary["steps"], summary["samples_seen"]) == ("finished", 8, 96)
    assert summary["world_sizes"] == [2, 1]

    trained = trained_ids(out, range(2))
    assert list(trained) == list(range(8))  # stopped at N after the resume too
    for step, ids in trained.items():
        epoch, index = divmod(step, 5)
        lo, hi = 12 * index, 12 * index + 12
        expected = drawn_items(60, 0, epoch, lo, hi) if sampled else epoch_order(60, 0, epoch)[lo:hi]
        assert ids == sorted(expected.tolist()), step  # the rows of an uninterrupted run, step by step
    if sampled:
        assert len({tuple(ids) for ids in trained.values()}) == 8  # fresh rows every step
    else:
        assert sorted(i for step in range(5) for i in trained[step]) == list(range(60))

    rows = [row for rank in range(2) for row in read_jsonl(out / f"ids-rank{rank}.jsonl")]
    lr = {}
    for row in rows:
        lr.setdefault(row["step"], set()).add(round(row["lr"], 15))
    assert all(len(rates) == 1 for rates in lr.values())  # a redone step has the rate it had: keyed to samples

    # the records after the resume: the whole run
    run_dir = Path(result.run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    assert any(e["kind"] == "resize" and e["message"].startswith("Resized 2 → 1 workers") for e in events)
    steps = [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 8
    assert summary["starts"] == 2 and summary["wall_time_s"] > first["wall_time_s"]
    assert summary["final_loss_steps"] == [8, 8] and np.isfinite(summary["final_metrics"]["epoch_loss"])
