"""`raytrain plan`: each mode's best interval and goodput per worker count, from options or a run's
measured figures, drawn against the worker count; bad input exits 2 naming the option (pure)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest
import yaml
from test_cli import RAYTRAIN, assert_usage_error, cli, needs_script

from raytrain.bench.plan import PlanOptions, inputs, planned_counts, run_plan, scenarios
from raytrain.errors import ConfigError
from raytrain.rules import goodput

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_worker_counts():
    assert planned_counts("16384,8, 512") == [8, 512, 16384]
    for bad in ("", "8,x", "0", "16385", "8,-1"):
        with pytest.raises(ConfigError, match="workers: got .*; give worker counts from 1 to 16,384"):
            planned_counts(bad)


def test_plan_prints_every_mode_per_worker_count_and_draws_it(tmp_path):
    lines = []
    opts = PlanOptions(workers="8,16384", step_time_s=2.0, checkpoint_stall_s=20.0, plot=str(tmp_path / "g.png"))
    predictions = run_plan(opts, echo=lines.append)
    assert [(p.workers, p.mode) for p in predictions] == [(n, m) for n in (8, 16384) for m in goodput.MODES]
    text = "\n".join(lines)
    assert "a step 2 s, a save stalls 20 s" in text and "node MTBF 6,335 h" in text
    big_restart = predictions[3]
    assert big_restart.interval_steps == goodput.best_interval_steps(
        goodput.Scenario(workers=16384, step_s=2.0, stall_s=20.0), "restart"
    )
    assert f"{big_restart.interval_steps:,} steps" in text and f"{big_restart.goodput:.1%}" in text
    # at 16,384 workers per-step keeps more than restart; on one node they are the same
    assert predictions[4].goodput > big_restart.goodput
    assert predictions[0].goodput == pytest.approx(predictions[1].goodput)
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG_SIGNATURE


def write_run(path, *, mode="restart", failures=2):
    path.mkdir()
    goodput_record = {"goodput": 0.8, "step_s": 0.25, "recovery_s": 40.0, "failures": failures}
    summary = {"status": "finished", "goodput": goodput_record, "checkpoint_wait_s": 0.7}
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "config.yaml").write_text(yaml.safe_dump({"fault_tolerance": mode, "pipeline": "digits"}))
    return path


def test_a_runs_measured_figures_replace_the_defaults(tmp_path):
    run = write_run(tmp_path / "run")
    costs, source = inputs(PlanOptions(run=str(run)))
    assert (costs["step_s"], costs["stall_s"], costs["restart"]) == (0.25, 0.7, 20.0)
    assert costs["per-step"] == goodput.RECOVERY_S["per-step"]
    assert source == f"measured in {run}: recovery_s, stall_s, step_s"
    # an option given wins over the run
    costs, _ = inputs(PlanOptions(run=str(run), step_time_s=3.0, recovery_restart_s=90.0))
    assert (costs["step_s"], costs["restart"]) == (3.0, 90.0)
    # a per-step run's recovery is per-step's
    costs, _ = inputs(PlanOptions(run=str(write_run(tmp_path / "ft", mode="per-step"))))
    assert costs["per-step"] == 20.0 and costs["restart"] == goodput.RECOVERY_S["restart"]


def test_a_run_without_failures_keeps_the_default_recovery(tmp_path):
    costs, _ = inputs(PlanOptions(run=str(write_run(tmp_path / "run", failures=0))))
    assert costs["restart"] == goodput.RECOVERY_S["restart"]


def test_cli_plan(capsys, tmp_path):
    code, out, err = cli(capsys, "plan", "--workers", "8,64", "--plot", str(tmp_path / "p.png"))
    assert code == 0, err
    assert "per-step-groups" in out and (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "99999"], "--workers: got '99999'; give worker counts from 1 to 16,384"),
        (["--step-time-s", "0"], "--step-time-s: got 0.0; must be a positive number"),
        (["--checkpoint-stall-s", "-1"], "--checkpoint-stall-s: got -1.0; must be 0 or more"),
        (["--mtbf-hours", "0"], "--mtbf-hours: got 0.0; must be a positive number"),
        (["--recovery-restart-s", "-5"], "--recovery-restart-s: got -5.0; must be 0 or more"),
        (["--replica-group-size", "0"], "--replica-group-size: got 0; need at least 1"),
        (["--storage-gbps", "0"], "--storage-gbps: got 0.0; must be a positive number of GB/s"),
        (["--run", "/nonexistent/run"], "--run: no summary.json in /nonexistent/run"),
        (["--detection-s", "-1"], "--detection-s: got -1.0; must be 0 or more"),
        (["--preemptions-per-node-day", "-0.5"], "--preemptions-per-node-day: got -0.5; must be 0 or more"),
        (["--preemption-notice-s", "inf"], "--preemption-notice-s: got inf; must be 0 or more"),
        (
            ["--replica-group-size", "3", "--workers", "8,10"],
            "--replica-group-size: got 3 with --workers 8,10: 8, 10 are not a whole number of groups of 3",
        ),
    ],
)
def test_cli_plan_bad_input_names_the_option(capsys, tmp_path, argv, message):
    code, out, err = cli(capsys, "plan", *argv, "--plot", str(tmp_path / "p.png"))
    assert_usage_error(code, out, err, message, lines=None)
    assert not (tmp_path / "p.png").exists()


@pytest.mark.slow
@needs_script
def test_the_installed_script_plans_and_refuses_bad_input(tmp_path):
    ok = subprocess.run(
        [str(RAYTRAIN), "plan", "--workers", "8,16384"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert "16384   2048" in ok.stdout and (tmp_path / "goodput.png").read_bytes()[:8] == PNG_SIGNATURE
    bad = subprocess.run(
        [str(RAYTRAIN), "plan", "--mtbf-hours", "-3"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert_usage_error(bad.returncode, bad.stdout, bad.stderr, "--mtbf-hours: got -3.0; must be a positive number")


@pytest.mark.parametrize(
    "argv", [["--mtbf-hours", "1e-9"], ["--step-time-s", "1e12", "--mtbf-hours", "1"], ["--mtbf-hours", "1e-300"]]
)
def test_plan_answers_when_failures_outrun_every_step(capsys, tmp_path, argv):
    """e^x past a float's range is a goodput of 0, said with what to check, not an OverflowError."""
    code, out, err = cli(capsys, "plan", "--workers", "8,64", *argv, "--plot", str(tmp_path / "p.png"))
    assert code == 0, err
    assert "0.0%" in out and "nothing is kept at any interval; check --mtbf-hours and --step-time-s" in out


def test_goodput_is_zero_not_an_error_far_past_the_float_range():
    assert goodput.restart_goodput(1.0, 1.0, 3.6e-6, 37.0) == 0.0
    assert goodput.restart_goodput(1e12, 1.0, 3600.0, 37.0) == 0.0
    exact = 100.0 / (1e4 * (2.718281828459045 ** (37.0 / 1e4)) * goodput.math.expm1(101.0 / 1e4))
    assert goodput.restart_goodput(100.0, 1.0, 1e4, 37.0) == pytest.approx(exact, rel=1e-12)


def test_plan_names_a_corrupt_summary_as_such_not_as_missing(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{truncated")
    code, out, err = cli(capsys, "plan", "--run", str(run), "--plot", str(tmp_path / "p.png"))
    assert_usage_error(code, out, err, f"--run: {run}/summary.json is not a raytrain summary", lines=None)


def test_the_default_group_size_fits_a_count_below_it():
    (four,) = scenarios(PlanOptions(workers="4"))
    assert four.group_size == 4


def test_the_plan_shows_what_a_preemption_notice_saves(tmp_path):
    lines = []
    opts = PlanOptions(
        workers="8,16384",
        step_time_s=2.0,
        checkpoint_stall_s=20.0,
        preemptions_per_node_day=0.1,
        preemption_notice_s=30.0,
        plot=str(tmp_path / "g.png"),
    )
    predictions = run_plan(opts, echo=lines.append)
    text = "\n".join(lines)
    assert "+ 15 s to find a silent node" in text and "0.1 preemptions per node-day, 30 s notice" in text
    header = next(line for line in text.splitlines() if line.startswith("workers"))
    assert header.split()[5:8] == ["goodput", "no", "notice"]
    largest = scenarios(opts)[-1]
    assert (largest.detection_s, largest.preemption_notice_s) == (15.0, 30.0)
    without = goodput.best(replace(largest, preemption_notice_s=0.0), "restart").goodput
    with_notice = predictions[3]
    assert (with_notice.workers, with_notice.mode) == (16384, "restart")
    assert with_notice.goodput > without + 0.1  # 205 preemptions a day, each a rollback without notice
    row = next(line for line in text.splitlines() if line.startswith("  16384") and " restart " in line)
    assert f"{with_notice.goodput:.1%} {without:.1%}" in " ".join(row.split())  # goodput, then without notice
    assert lines[-2] == (
        "The 30 s notice keeps every preempted step; goodput without it → with it, at 16384 workers "
        f"(205 preemptions a day): restart {without:.1%} → {with_notice.goodput:.1%}, per-step "
        f"{goodput.best(replace(largest, preemption_notice_s=0.0), 'per-step').goodput:.1%} → "
        f"{predictions[4].goodput:.1%}, per-step-groups "
        f"{goodput.best(replace(largest, preemption_notice_s=0.0), 'per-step-groups').goodput:.1%} → "
        f"{predictions[5].goodput:.1%}."
    )


@pytest.mark.parametrize(
    "notice_s, says",
    [
        (0.0, "Without notice a preemption is a failure; a notice of 22 s"),
        (21.0, "A 21 s notice is too short to save: a preemption still rolls back to the last save; a notice of 22 s"),
    ],
)
def test_a_notice_too_short_to_save_names_the_one_that_would(tmp_path, notice_s, says):
    lines = []
    opts = PlanOptions(
        workers="16384",
        step_time_s=2.0,
        checkpoint_stall_s=20.0,
        preemptions_per_node_day=0.1,
        preemption_notice_s=notice_s,
        plot=str(tmp_path / "g.png"),
    )
    (restart, *_) = run_plan(opts, echo=lines.append)
    assert lines[-2].startswith(says)
    noticed = goodput.best(replace(scenarios(opts)[0], preemption_notice_s=22.0), "restart").goodput
    assert f"restart {restart.goodput:.1%} → {noticed:.1%}" in lines[-2] and noticed > restart.goodput + 0.1
    assert ("no notice" in lines[1]) == (notice_s > 0)


def test_without_preemptions_the_table_is_as_before(tmp_path):
    lines = []
    run_plan(PlanOptions(workers="8", detection_s=65.0, plot=str(tmp_path / "g.png")), echo=lines.append)
    assert "+ 65 s to find a silent node" in lines[0] and "preemption" not in lines[0]
    assert "notice" not in "\n".join(lines)
