"""Pure tier: step-based runs — the budget of epochs and steps, the schedule in steps (keyed to
samples, unchanged by a resize), evaluation every N steps over the same rows, sampled
datasets drawn from (seed, position), the records of what ran, and --help's defaults."""

from __future__ import annotations

import json
import pickle
import time

import numpy as np
import pytest
import torch

import raytrain
from raytrain.config import TrainConfig, merge_layers
from raytrain.data.draws import Draws
from raytrain.data.stream import _first_rows
from raytrain.data.table import Table
from raytrain.driver.run import check_validation_set
from raytrain.driver.summary import write_summary
from raytrain.errors import ConfigError, PipelineCodeError
from raytrain.observe.console import EpochProgress
from raytrain.rules import resume
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.budget import Budget, evaluation_due, evaluation_rows, planned_global_batch, samples_after_steps
from raytrain.rules.schedule import run_schedule
from raytrain.rules.steps import DRAW_BLOCK, drawn_items, epoch_steps
from raytrain.rundir import RunDir
from raytrain.rundir.records import MetricsRow, StoredRun, Summary

# -- the budget ------------------------------------------------------------------------------


def test_steps_become_samples_walking_the_epochs_with_their_partial_last_step():
    # 100 rows, 16 per step: 7 steps an epoch, the last of 4 rows
    assert [samples_after_steps(s, 100, 16) for s in (0, 1, 6, 7, 8, 14)] == [0, 16, 96, 100, 116, 200]


@pytest.mark.parametrize(
    "epochs, max_steps, done_at, text",
    [
        (3, None, [(3, 21)], "3 epochs"),
        (None, 10, [(1, 10)], "10 steps"),
        (3, 10, [(1, 10)], "10 steps or 3 epochs, whichever comes first"),  # 10 steps come first
        (1, 10, [(1, 7)], "10 steps or 1 epoch, whichever comes first"),  # one epoch (7 steps) comes first
    ],
)
def test_the_budget_ends_at_whichever_comes_first(epochs, max_steps, done_at, text):
    budget = Budget(epochs, max_steps)
    ((epochs_done, step),) = done_at
    assert budget.done(epochs_done, step) and not budget.done(epochs_done - 1, step - 1)
    assert budget.describe() == text
    assert budget.total_steps(100, 16) == step


def test_a_config_with_max_steps_alone_has_no_epoch_limit_and_without_it_five_epochs():
    assert TrainConfig(max_steps=300).epochs is None
    assert TrainConfig().epochs == 5
    assert (TrainConfig(epochs=2, max_steps=300).epochs, TrainConfig(epochs=2, max_steps=300).max_steps) == (2, 300)


def test_a_layer_naming_one_knob_of_a_pair_replaces_the_other_from_below():
    pipeline = {"epochs": 3, "warmup_epochs": 0.5, "batch_size_per_worker": 32}
    assert merge_layers(pipeline, {"max_steps": 300}) == {
        "max_steps": 300,
        "warmup_epochs": 0.5,
        "batch_size_per_worker": 32,
    }
    assert "warmup_epochs" not in merge_layers(pipeline, {"warmup_steps": 20})
    assert merge_layers(pipeline, {"epochs": 4, "max_steps": 300})["epochs"] == 4  # one layer: whichever first
    assert "max_steps" not in merge_layers({"max_steps": 300}, {"epochs": 2})


@pytest.mark.parametrize(
    "values, field, match",
    [
        ({"max_steps": 0}, "max_steps", "must be a positive integer"),
        ({"warmup_steps": 10, "warmup_epochs": 1.0}, "warmup_steps", "give the warmup one way"),
        ({"warmup_steps": 400, "max_steps": 300}, "warmup_steps", "longer than the 300 steps"),
        ({"warmup_steps": -1}, "warmup_steps", "must be 0 or more"),
        ({"eval_every_steps": 0}, "eval_every_steps", "must be a positive integer"),
        ({"eval_batches": 0}, "eval_batches", "must be a positive integer"),
    ],
)
def test_step_options_are_checked_naming_the_fix(values, field, match):
    with pytest.raises(ConfigError, match=f"{field}: .*{match}"):
        TrainConfig(**values)


def test_a_warmup_in_steps_leaves_the_epochs_warmup_at_zero():
    cfg = TrainConfig(warmup_steps=20, max_steps=100)
    assert (cfg.warmup_epochs, cfg.warmup_steps) == (0.0, 20)
    assert TrainConfig(warmup_steps=20, warmup_epochs=0).warmup_steps == 20  # a resumed config.yaml has both


# -- the schedule in steps, keyed to samples ---------------------------------------------------


def test_warmup_and_schedule_in_steps_are_samples_of_the_planned_global_batch():
    cfg = TrainConfig(global_batch_size=16, reference_batch_size=16, max_steps=10, warmup_steps=2, workers="1:4")
    schedules = {n: run_schedule(cfg, batch_plan_for(cfg, n), 100) for n in (1, 2, 4)}
    assert {(s.warmup_samples, s.total_samples) for s in schedules.values()} == {(32, 148)}  # 7 steps + 3 × 16


def test_with_a_per_worker_batch_steps_count_at_the_largest_worker_count_so_a_resize_changes_nothing():
    cfg = TrainConfig(batch_size_per_worker=8, reference_batch_size=8, max_steps=10, warmup_steps=2, workers="1:4")
    assert planned_global_batch(cfg) == 32
    for workers in (1, 2, 4):
        schedule = run_schedule(cfg, batch_plan_for(cfg, workers), 1000)
        assert (schedule.warmup_samples, schedule.total_samples) == (64, 320)
    assert run_schedule(cfg, batch_plan_for(cfg, 2), 1000).peak_lr == pytest.approx(2e-3)  # the peak follows the rule


def test_the_schedule_reaches_its_end_at_the_last_step_of_max_steps():
    cfg = TrainConfig(global_batch_size=16, reference_batch_size=16, max_steps=10, warmup_steps=2, schedule="linear")
    schedule = run_schedule(cfg, batch_plan_for(cfg, 2), 100)
    assert schedule.lr(samples_after_steps(10, 100, 16)) == 0.0 and schedule.lr(samples_after_steps(9, 100, 16)) > 0


def test_a_warmup_in_epochs_longer_than_max_steps_is_counted_as_a_tenth_of_the_run_in_steps():
    # 2,944 rows at a global batch of 32: 92 steps an epoch; the default warmup (1 epoch) would
    # outlast --max-steps 20 and the rate would never reach its peak
    cfg = TrainConfig(batch_size_per_worker=16, reference_batch_size=16, workers=2, max_steps=20)
    schedule = run_schedule(cfg, batch_plan_for(cfg, 2), 2944)
    assert schedule.warmup_samples == 2 * 32
    assert schedule.lr(samples_after_steps(2, 2944, 32)) == pytest.approx(schedule.peak_lr)
    assert schedule.lr(samples_after_steps(20, 2944, 32)) == pytest.approx(0.0)  # and the decay ends with the run
    assert schedule.warmup_words == (
        "warmup 2 steps",
        "to step 2 of 20 (a tenth of the run: 1 epoch is 92 steps, not shorter than the run)",
    )


def test_a_warmup_that_ends_inside_the_run_is_kept_and_the_words_say_where_it_ends():
    longer = TrainConfig(batch_size_per_worker=16, reference_batch_size=16, workers=2, max_steps=300)
    assert run_schedule(longer, batch_plan_for(longer, 2), 2944).warmup_samples == 2944
    assert run_schedule(longer, batch_plan_for(longer, 2), 2944).warmup_words[1] == "to step 92 of 300"
    epochs = TrainConfig(batch_size_per_worker=16, reference_batch_size=16, workers=2, epochs=4, warmup_epochs=0.5)
    assert run_schedule(epochs, batch_plan_for(epochs, 2), 2944).warmup_words == (
        "warmup 0.5 epochs",
        "to step 46 of 368",
    )
    tiny = TrainConfig(batch_size_per_worker=16, reference_batch_size=16, workers=2, max_steps=5)
    assert run_schedule(tiny, batch_plan_for(tiny, 2), 2944).warmup_samples == 0  # a tenth of 5 steps: none


# -- evaluation every N steps --------------------------------------------------------------------


def test_evaluation_is_due_every_n_steps_but_not_at_an_epochs_end_which_validates_anyway():
    assert [s for s in range(1, 13) if evaluation_due(s, 4, last_of_epoch=s == 12)] == [4, 8]
    assert not any(evaluation_due(s, None, False) for s in range(1, 10))


def test_a_bounded_pass_is_the_same_rows_at_any_worker_count():
    cfg = TrainConfig(global_batch_size=8, eval_batches=2)
    assert evaluation_rows(cfg) == 16 and evaluation_rows(TrainConfig()) is None
    table = Table({"id": np.arange(100)})

    def rows(world: int) -> list[int]:
        return sorted(
            i
            for rank in range(world)
            for count, batch in table.eval_batches(rank, world, 3, torch.device("cpu"), limit=16, seed=5)
            for i in batch["id"].tolist()[:count]
        )

    assert rows(1) == rows(2) == rows(3) and len(rows(1)) == 16 and rows(1) != list(range(16))  # drawn, not the head
    assert len({tuple(rows(1)), tuple(rows(2))}) == 1


def test_a_streamed_bounded_pass_keeps_the_units_holding_the_first_rows():
    assert _first_rows([10, 10, 10], 15) == ([10, 5, 0], {1: 5})
    assert _first_rows([10, 10, 10], 20) == ([10, 10, 0], {})


def test_options_needing_a_validation_set_are_refused_without_one():
    with pytest.raises(
        ConfigError, match="eval_every_steps: got 100, but the pipeline's build_datasets returns no 'val'"
    ):
        check_validation_set(TrainConfig(eval_every_steps=100), {"train": object()})
    check_validation_set(TrainConfig(eval_every_steps=100), {"train": object(), "val": object()})


# -- sampled datasets ----------------------------------------------------------------------------


def test_draws_depend_on_the_position_alone():
    whole = drawn_items(50, seed=3, epoch=1, lo=0, hi=3 * DRAW_BLOCK)
    pieces = [
        drawn_items(50, 3, 1, lo, hi) for lo, hi in [(0, 5), (5, DRAW_BLOCK + 7), (DRAW_BLOCK + 7, 3 * DRAW_BLOCK)]
    ]
    assert np.array_equal(whole, np.concatenate(pieces)) and whole.min() >= 0 and whole.max() < 50
    assert not np.array_equal(whole[:100], drawn_items(50, 3, 2, 0, 100))  # another epoch, other draws
    assert not np.array_equal(whole[:100], drawn_items(50, 4, 1, 0, 100))  # another seed too
    assert len(np.unique(whole[:200])) < 50 or len(whole) > 50  # with replacement


def sampled_rows(world_sizes_from: list[tuple[int, int]], total_steps: int, global_batch: int) -> list[list[int]]:
    """The items each step trains when the run is at (offset → world size) segments: each rank's
    slice of each step, joined in rank order."""
    draws = Draws("train", raytrain.Sampled(1000, lambda items: {"id": items}, epoch_rows=10_000))
    trained: list[list[int]] = []
    bounds = [*world_sizes_from, (total_steps * global_batch, 0)]
    for (start, world), (end, _) in zip(bounds, bounds[1:]):
        epochs = [draws.epoch(seed=0, epoch=0, start=start, rank=rank, world_size=world) for rank in range(world)]
        for step in epoch_steps(end, global_batch, start):
            batches = [epoch.batch(epoch.rows(step), torch.device("cpu")) for epoch in epochs]
            trained.append([i for batch, count in batches for i in batch["id"].tolist()[:count]])
    return trained


def test_a_sampled_run_resumed_mid_epoch_and_resized_draws_the_rows_of_an_uninterrupted_one():
    uninterrupted = sampled_rows([(0, 2)], total_steps=9, global_batch=12)
    resumed = sampled_rows([(0, 2), (5 * 12, 3)], total_steps=9, global_batch=12)  # a resume at step 5 on 3 workers
    assert resumed == uninterrupted and len({tuple(step) for step in uninterrupted}) == 9  # fresh rows every step


def test_a_sampled_set_checks_what_its_take_returns():
    bad = Draws("train", raytrain.Sampled(10, lambda items: {"x": np.zeros(3)}))
    with pytest.raises(PipelineCodeError, match="returned 3 row\\(s\\) for 2 item\\(s\\)"):
        bad.rows_of(np.arange(2))
    failing = Draws("train", raytrain.Sampled(10, lambda items: 1 / 0))
    with pytest.raises(PipelineCodeError, match="its Sampled take raised ZeroDivisionError"):
        failing.rows_of(np.arange(2))
    with pytest.raises(ValueError, match="num_items must be a positive integer"):
        raytrain.Sampled(0, lambda items: {})


def test_windows_of_a_token_array_and_of_a_token_file(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    windows = raytrain.Sampled.windows(tokens, 9)
    assert windows.num_items == 92 and windows.rows_per_epoch == 92
    assert windows.take(np.array([0, 91]))["tokens"].tolist() == [list(range(9)), list(range(91, 100))]
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    mapped = raytrain.Sampled.windows(str(path), 9, epoch_rows=500)
    assert mapped.take(np.array([5]))["tokens"].tolist() == [list(range(5, 14))] and mapped.rows_per_epoch == 500
    copy = pickle.loads(pickle.dumps(mapped.take))  # to a worker: the path travels, not the mapping
    assert copy._mapped is None and copy(np.array([1]))["tokens"].dtype == np.int64
    with pytest.raises(ValueError, match="fewer than one window"):
        raytrain.Sampled.windows(tokens[:5], 9)


# -- the records of what ran ---------------------------------------------------------------------


def test_config_yaml_names_the_pipelines_hooks_and_leaves_out_what_they_replaced():
    values = TrainConfig().to_dict()
    recorded = resume.recorded_config(values, ["build_optimizer", "lr_factor"], {"build_optimizer": "AdamW, 2 groups"})
    assert recorded["optimizer"] == "the pipeline's build_optimizer (AdamW, 2 groups)"
    assert recorded["schedule"] == "the pipeline's lr_factor"
    assert not {"weight_decay", "momentum", "nesterov", "decay_norm_and_bias", "lr_milestones", "lr_gamma"} & set(
        recorded
    )
    again = TrainConfig.from_dict(resume.resolvable(recorded))  # a resume reads it back as options
    assert again.optimizer == "adamw" and again.lr == values["lr"]


def test_a_resume_compares_a_hooks_options_like_with_like(tmp_path):
    recorded = resume.recorded_config(TrainConfig(epochs=2).to_dict(), ["build_optimizer"], {"build_optimizer": "SGD"})
    stored = StoredRun(tmp_path, recorded, "steps", tmp_path / "checkpoint", {"epoch": 1})
    changed, refused = resume.changes(stored, TrainConfig(epochs=4).to_dict(), "steps", ["build_optimizer"])
    assert refused == [] and changed == [("epochs", 2, 4)]


def test_the_plan_line_says_the_hooks_and_the_budget():
    from rt_test_pipelines import StepsPipeline

    from raytrain.rules.attempt import describe_plan

    cfg = TrainConfig(global_batch_size=16, reference_batch_size=16, max_steps=300, warmup_steps=20, epochs=4)
    plan = batch_plan_for(cfg, 2)
    line = describe_plan(cfg, StepsPipeline("."), plan, run_schedule(cfg, plan, 100), "gloo", "AdamW, 2 groups")
    assert line.endswith(
        "warmup 20 steps, to step 20 of 28; the pipeline's lr_factor; the pipeline's build_optimizer "
        "(AdamW, 2 groups); gloo; 300 steps or 4 epochs, whichever comes first"
    )


def rows_file(run_dir, rows: list[dict]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_summary_after_a_resume_covers_the_whole_run(tmp_path, make_config):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = make_config(epochs=2)
    rows_file(run_dir, [{"epoch": 1, "step": 10, "loss": 0.9}, {"epoch": 1, "step": 20, "loss": 0.8}])
    first = write_summary(run_dir, cfg, None, None, time.time() - 30.0, interrupted=2)
    assert first.wall_time_s == pytest.approx(30.0, abs=1) and first.starts == 1
    # the resumed invocation trains on from step 20 to the end of the second epoch
    rows_file(
        run_dir,
        [
            {"epoch": 1, "step": 10, "loss": 0.9},
            {"epoch": 1, "step": 20, "loss": 0.8},
            {"epoch": 1, "step": 25, "loss": 0.7, "epoch_end": True, "epoch_loss": 0.85, "val_loss": 0.75},
            {"epoch": 2, "step": 40, "loss": 0.6},
            {"epoch": 2, "step": 50, "loss": 0.5, "epoch_end": True, "epoch_loss": 0.55},
        ],
    )
    second = write_summary(run_dir, cfg, None, None, time.time() - 12.0)
    assert second.wall_time_s == pytest.approx(42.0, abs=1) and second.starts == 2  # both invocations' time
    assert second.final_metrics == {"loss": 0.5, "epoch_loss": 0.55, "val_loss": 0.75}
    assert second.final_loss_steps == [41, 50]  # the last window: the steps since the row before
    assert RunDir(run_dir).summary().to_json()["final_loss_steps"] == [41, 50]


def test_the_reports_final_metrics_say_what_each_loss_is_the_mean_of():
    from raytrain.observe.report import final_label

    summary = Summary(status="finished", final_loss_steps=[291, 300])
    assert final_label("loss", summary) == "loss (last window: steps 291–300)"
    assert final_label("epoch_loss", summary) == "epoch_loss (mean over the last epoch)"
    assert final_label("val_loss", summary) == "val_loss"


def test_progress_of_a_step_budget_counts_the_runs_steps():
    progress = EpochProgress(epochs=None, train_rows=1000, max_steps=300)
    row = MetricsRow(epoch=2, step=120, samples_seen=120 * 64, global_batch_size=64, loss=2.5, samples_per_s=640.0)
    snapshot = progress.update(row)
    assert snapshot.line().startswith("step 120/300 (40%)  epoch 2  ETA 0:18  loss 2.5000")
    both = EpochProgress(epochs=2, train_rows=1000, max_steps=300).update(row)
    assert both.epoch_steps == 32  # two epochs of 16 steps come before 300 steps


# -- --help --------------------------------------------------------------------------------------


def help_of(capsys, *argv: str) -> str:
    """`raytrain ARGV` (a --help), its output on one line (COLUMNS set wide by the test: argparse
    wraps at hyphens otherwise)."""
    from raytrain.cli import main

    with pytest.raises(SystemExit) as done:
        main(list(argv))
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    text = help_of(capsys, "train", "--help")
    for expected in (
        "--lr LR Learning rate tuned for `reference_batch_size` (the single-GPU recipe). (default: 0.001)",
        "(default: 5; none with --max-steps alone)",
        "(default: 1; 0 with --warmup-steps)",
        "--lr-scaling {linear,sqrt,none} How the peak rate follows the global batch: linear, sqrt or none. "
        "(default: linear)",
        "(default: 32 without --global-batch-size)",
    ):
        assert expected in text, expected
    assert "options of pipeline" not in text


def test_help_after_a_pipeline_adds_its_own_options_with_types_defaults_and_docstrings(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    text = help_of(capsys, "train", "charlm", "--help")
    assert "options of pipeline charlm (--pipeline-arg KEY=VALUE" in text
    assert "--pipeline-arg corpus_mb=FLOAT Megabytes of the stdlib's .py sources. (default: 1)" in text
    assert "--pipeline-arg heads=INT Attention heads (must divide width). (default: 4)" in text
    assert "charlm's own defaults, under --config and the flags: --epochs 3" in text
    assert "digits takes no --pipeline-arg" in help_of(capsys, "train", "digits", "-h")


@pytest.mark.slow
def test_the_nanogpt_style_original_runs_alone_and_saves_a_model_its_port_builds(tmp_path):
    """The "before" of docs/porting.md's step-based port runs as a plain script (a few iterations)."""
    import subprocess
    import sys
    from pathlib import Path

    from examples.nanogpt_style.data import prepare
    from examples.nanogpt_style.pipeline import NanoGPTStyle

    repo = Path(__file__).resolve().parents[1]
    data = prepare(tmp_path / "data", megabytes=0.1)
    done = subprocess.run(
        [sys.executable, "examples/nanogpt_style/original.py", "--data", str(data), "--max-iters", "3"]
        + ["--save", str(tmp_path / "m.pt"), "--out", str(tmp_path / "r.json")],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(json.loads((tmp_path / "r.json").read_text())) == {"train_loss", "val_loss", "wall_time_s"}
    port = NanoGPTStyle()
    model = port.build_model(TrainConfig(**port.default_config))
    model.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True), strict=True)


def test_a_warmup_in_epochs_over_half_of_a_step_based_run_is_said_with_the_fix():
    """hf-causal-lm's default 0.1 epoch under --max-steps 40 was 39 of the 40 steps, unsaid."""
    from raytrain.rules.schedule import run_warmup

    cfg = TrainConfig(global_batch_size=16, reference_batch_size=16, max_steps=40, warmup_epochs=0.1, epochs=3)
    warm = run_warmup(cfg, 6240)  # 390 steps an epoch: 0.1 epoch is 39 steps
    assert warm.where == (
        "to step 39 of 40 — more than half of the run warms up; for less, give --warmup-steps (e.g. 4, a tenth) "
        "or a shorter --warmup-epochs"
    )
    assert run_warmup(TrainConfig(global_batch_size=16, max_steps=400, warmup_epochs=0.1), 6240).where == (
        "to step 39 of 400"
    )
