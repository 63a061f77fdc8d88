"""CPU Ray tier: real TorchTrainer runs with gloo on one shared local Ray (4 logical CPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from design import METRICS_KEYS
from rt_test_pipelines import RecordingPipeline, read_jsonl

import raytrain
from raytrain.errors import ConfigError
from raytrain.rules import schedule

pytestmark = pytest.mark.ray


def test_digits_two_workers_trains_and_leaves_run_files(digits_two_worker_run, tmp_path):
    # `raytrain train digits --workers 2 --epochs 4 --log-every-steps 5` (tests/conftest.py)
    assert digits_two_worker_run.code == 0, digits_two_worker_run.out
    run_dir = digits_two_worker_run.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["epochs"] == 4 and summary["world_sizes"] == [2] and summary["failures_recovered"] == 0
    assert summary["final_metrics"]["val_accuracy"] >= 0.90
    assert summary["steady_samples_per_s"] > 0
    for key in ("steps", "samples_seen", "wall_time_s", "best_checkpoint", "model_path"):
        assert summary[key], key
    assert summary["samples_seen"] == 4 * 1438  # every training sample once per epoch
    # The cost view: the CNN's forward and backward FLOPs per sample, counted on rank 0's first batch
    # (convolutions and linear layers: 2,528,512 forward + 5,020,160 backward), and what they make per worker.
    cost = summary["cost"]
    assert cost["flops_per_sample"] == 7_548_672 and cost["device"] == "cpu" and cost["mfu"] is None
    assert cost["achieved_tflops_per_worker"] == pytest.approx(7_548_672 * summary["steady_samples_per_s"] / 2 / 1e12)
    assert "Cost: 7.55 MFLOP per sample (forward + backward)" in (run_dir / "report.md").read_text()

    rows = read_jsonl(run_dir / "metrics.jsonl")
    for key in METRICS_KEYS:
        assert all(key in row for row in rows), key
    epoch_rows = [row for row in rows if row.get("epoch_end")]
    assert [row["epoch"] for row in epoch_rows] == [1, 2, 3, 4]
    assert all("val_loss" in row and "val_accuracy" in row for row in epoch_rows)
    assert all(row["global_batch_size"] == 64 and row["world_size"] == 2 for row in rows)

    from pipelines.digits.model import DigitsCNN

    for path in (run_dir / "model.pt", Path(summary["best_checkpoint"]) / "model.pt"):
        weights = torch.load(path, weights_only=True)
        assert not any(key.startswith("module.") for key in weights)
        DigitsCNN().load_state_dict(weights, strict=True)

    from raytrain.cli import main

    exported = tmp_path / "exported.pt"
    assert main(["export", str(run_dir), "-o", str(exported)]) == 0
    DigitsCNN().load_state_dict(torch.load(exported, weights_only=True), strict=True)

    events = read_jsonl(run_dir / "events.jsonl")
    assert events[0]["message"].startswith(
        "global 64 = 2 workers × 32 per worker × 1 accumulation step; lr 2.0e-3 = 1.0e-3 × 2 (linear rule, reference "
        "batch 32); warmup 1 epoch, to step "
    )
    assert "; cosine; adamw; gloo" in events[0]["message"]

    # The run name is taken now: reusing it without --resume is an error, not a silent resume.
    storage = str(digits_two_worker_run.storage)
    with pytest.raises(ConfigError, match="already exists.*--resume"):
        raytrain.fit("digits", raytrain.TrainConfig(workers=2, epochs=4, storage=storage, name="digits2"))


def test_all_ranks_hold_identical_weights_after_first_step(one_epoch_recording_run):
    # Read from the shared 2-worker run (tests/conftest.py): each rank wrote its weights at step 1.
    out = one_epoch_recording_run.out
    ranks = [json.loads((out / f"weights-rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]


def test_worker_failure_resumes_at_checkpoint_step_with_same_lr_and_exactly_once(crash_recovered_run):
    # Rank 0 dies at step 11; checkpoints every 4 steps; 203 rows, 2 epochs (tests/conftest.py).
    result, out = crash_recovered_run.result, crash_recovered_run.out
    summary = result.summary
    assert summary["status"] == "finished" and summary["failures_recovered"] == 1

    records = [row for r in range(2) for row in read_jsonl(out / f"ids-rank{r}.jsonl")]
    first = [row for row in records if row["attempt"] == "first"]
    second = [row for row in records if row["attempt"] == "second"]
    resumed_at = min(row["step"] for row in second)
    assert resumed_at == 8  # the last checkpoint before the crash at step 11

    # The LR at each step is the same in both attempts (derived from samples seen).
    lr_first = {row["step"]: row["lr"] for row in first}
    for row in second:
        if row["step"] in lr_first:
            assert row["lr"] == pytest.approx(lr_first[row["step"]], rel=1e-12)

    # Epoch 0 was interrupted: steps before the checkpoint come from the first attempt,
    # the rest from the second; together every row exactly once.
    trained = [i for row in first if row["epoch"] == 0 and row["step"] < resumed_at for i in row["ids"]]
    trained += [i for row in second if row["epoch"] == 0 for i in row["ids"]]
    assert sorted(trained) == list(range(203))
    epoch1 = [i for row in second if row["epoch"] == 1 for i in row["ids"]]
    assert sorted(epoch1) == list(range(203))

    # metrics.jsonl continues from the checkpoint: one row per step, no repeats.
    steps = [row["step"] for row in read_jsonl(Path(result.run_dir) / "metrics.jsonl")]
    assert steps == sorted(steps) and len(steps) == len(set(steps))
    events = read_jsonl(Path(result.run_dir) / "events.jsonl")
    assert any(e["kind"] == "restore" and "step 8" in e["message"] for e in events)
    crashed_at = float((out / "crashed").read_text())
    recovery_s = min(row["time"] for row in second) - crashed_at
    lost_steps = 11 - resumed_at
    print(f"recovery: {recovery_s:.1f} s from the failure to the first step after restart; {lost_steps} step(s) redone")


def test_local_mode_runs_the_loop_in_process(ray_session, tmp_path, make_config):
    out = tmp_path / "records"
    out.mkdir()
    cfg = make_config(workers=0, epochs=2, global_batch_size=16, name="local", log_every_steps=1, timing_warmup_steps=1)
    result = raytrain.fit(RecordingPipeline(str(out), num_rows=37), cfg)
    rows = read_jsonl(out / "ids-rank0.jsonl")
    for epoch in (0, 1):
        ids = [i for row in rows if row["epoch"] == epoch for i in row["ids"]]
        assert sorted(ids) == list(range(37))
    orders = [[i for row in rows if row["epoch"] == e for i in row["ids"]] for e in (0, 1)]
    assert orders[0] != orders[1]  # reshuffled every epoch
    assert result.summary["steps"] == 2 * 3  # ceil(37 / 16) steps per epoch, tail kept
    assert result.summary["steady_steps"] == 2 * (3 - 1)  # the first step of every epoch is warm-up
    expected_lr = schedule.LRSchedule("cosine", 1e-3, 1e-3, warmup_samples=37, total_samples=74).lr(0)
    assert rows[0]["lr"] == pytest.approx(expected_lr)


def test_resume_after_the_driver_stopped_continues_from_the_last_checkpoint(one_epoch_recording_run):
    # A finished 1-epoch, 2-worker run of 4 steps (tests/conftest.py), resumed for a second epoch.
    out, base = one_epoch_recording_run.out, one_epoch_recording_run.base
    pipeline = RecordingPipeline(str(out), num_rows=64)
    result = raytrain.fit(pipeline, raytrain.TrainConfig(epochs=2, resume=True, **base))
    assert result.summary["epochs"] == 2
    rows = [row for r in range(2) for row in read_jsonl(out / f"ids-rank{r}.jsonl")]
    assert sorted({row["step"] for row in rows}) == list(range(8))  # 4 steps per epoch, none repeated


def test_embedded_ray_starts_its_workers_at_niceness_0(tmp_path):
    # A fresh process: the session's shared Ray would be joined instead of starting one.
    script = (
        "import os, ray\n"
        "from raytrain.config import TrainConfig\n"
        "from raytrain.driver.session import ray_session\n"
        "with ray_session(TrainConfig(workers=1, storage='unused')):\n"
        "    print('niceness', ray.get(ray.remote(lambda: os.nice(0)).remote()))\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_worker_niceness", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert "niceness 0" in done.stdout, done.stderr[-2000:]
