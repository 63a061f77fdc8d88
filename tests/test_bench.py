"""`raytrain bench`: the pure arithmetic of the report, the outputs, the baselines' launcher,
and one end-to-end study on 1 and 2 CPU workers (marked `ray`).

Throughput itself is never asserted: timings on a shared 2-core machine are benchmarks,
recorded in benchmarks/RESULTS.md, not tests.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from raytrain.bench import (
    BenchOptions,
    baseline_rows,
    baselines,
    epochs_for,
    pick_run,
    render,
    scaling_rows,
    steady_steps_per_epoch,
    step_split,
    study,
)
from raytrain.bench.options import BenchError, PlannedRun
from raytrain.cli import main
from raytrain.config import TrainConfig
from raytrain.errors import ConfigError
from raytrain.rules.batch import resolve_batch_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- pure: epochs, split, speedup ------------------------------------------------------------


def test_epochs_hold_the_steady_steps_asked():
    # digits: 1438 rows; 32 per step -> 45 steps, 3 of them warm-up.
    assert steady_steps_per_epoch(1438, 32, 3) == 42
    assert epochs_for(1438, 32, 3, 42) == 1
    assert epochs_for(1438, 32, 3, 43) == 2
    assert epochs_for(1438, 64, 3, 100) == 5  # 23 steps, 20 steady per epoch
    with pytest.raises(ValueError, match="no step after the 3 warm-up steps"):
        epochs_for(100, 64, 3, 10)


def test_bench_warmup_steps_reach_the_loop_through_the_config(tmp_path):
    opts = BenchOptions(workers=[2], warmup_steps=5, storage=str(tmp_path))
    cfg = study.bench_config({"timing_warmup_steps": 1}, opts, workers=2, epochs=1, storage=tmp_path, name="w2")
    assert cfg.timing_warmup_steps == 5  # bench owns it: the baselines leave out as many


def test_bench_takes_per_step_fault_tolerance_without_flags_it_refuses(tmp_path):
    """Bench owns --max-failures; under per-step it gives the room per-step needs itself, so
    `raytrain bench --fault-tolerance per-step` never asks for a flag bench refuses."""
    pytest.importorskip("torchft")
    opts = BenchOptions(workers=[2], storage=str(tmp_path))
    per_step = study.bench_config(
        {"fault_tolerance": "per-step"}, opts, workers=2, epochs=1, storage=tmp_path, name="w"
    )
    restart = study.bench_config({}, opts, workers=2, epochs=1, storage=tmp_path, name="w")
    assert (per_step.fault_tolerance, per_step.max_failures, restart.max_failures) == ("per-step", 1, 0)


def test_step_split_estimates_communication_from_forward_backward():
    phases = {"data_wait": 0.02, "forward_backward": 0.30, "optimizer": 0.05}
    split = step_split(phases, steady_time_s=0.40, steady_steps=10, fb_1worker_ms=20.0)
    assert split["step"] == pytest.approx(40.0)
    assert split["communication"] == pytest.approx(10.0)  # 30 ms at N workers - 20 ms at 1
    assert split["compute"] == pytest.approx(20.0)
    assert split["data_wait"] == pytest.approx(2.0) and split["optimizer"] == pytest.approx(5.0)
    assert split["other"] == pytest.approx(3.0)
    # Faster than at 1 worker (noise): clipped at 0, never negative.
    assert step_split(phases, 0.40, 10, fb_1worker_ms=35.0)["communication"] == 0.0
    # Half the per-worker batch (fixed global batch): the 1-worker figure is halved first.
    assert step_split(phases, 0.40, 10, fb_1worker_ms=40.0, batch_ratio=0.5)["communication"] == pytest.approx(10.0)
    # The 1-worker run has no communication.
    assert step_split(phases, 0.40, 10, fb_1worker_ms=None)["communication"] == 0.0


def _run(workers: int, samples_per_s: float, fb_s: float, steps: int = 10) -> dict:
    return {
        "workers": workers,
        "global_batch_size": 32 * workers,
        "per_worker_batch": 32,
        "epochs": 1,
        "steady_steps": steps,
        "steady_samples_per_s": samples_per_s,
        "steady_time_s": 32 * workers * steps / samples_per_s,
        "phase_time_s": {"data_wait": 0.001, "forward_backward": fb_s, "optimizer": 0.01},
        "run_dir": f"/runs/w{workers}",
    }


def test_speedup_is_exactly_one_at_one_worker():
    runs = [_run(1, 3000.3, 0.08), _run(2, 5100.0, 0.10), _run(4, 9000.0, 0.12)]
    rows = scaling_rows(runs, grad_bytes=340_000, link=None, bucket_mb=25.0)
    assert rows[0]["speedup"] == 1.0 and rows[0]["efficiency"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(5100 / 3000.3)
    assert rows[2]["efficiency"] == pytest.approx(9000 / 3000.3 / 4)
    assert rows[1]["split_ms"]["communication"] == pytest.approx(2.0)  # (0.10 - 0.08) s / 10 steps
    assert rows[0]["implied_bandwidth_GBps"] is None
    assert rows[1]["implied_bandwidth_GBps"] == pytest.approx(340_000 / 2e-3 / 1e9)
    assert "predicted_speedup" not in rows[1]
    predicted = scaling_rows(runs, grad_bytes=340_000, link="eth10", bucket_mb=25.0)
    assert predicted[0]["predicted_speedup"] == 1.0 and 1.0 < predicted[1]["predicted_speedup"] < 2.0
    assert rows[0]["goodput"] is None  # a run without it in its summary


def test_bench_json_gives_each_worker_counts_goodput():
    rows = scaling_rows([{**_run(1, 3000.0, 0.08), "goodput": 0.61}, _run(2, 5000.0, 0.1)], 340_000, None, 25.0)
    assert [row["goodput"] for row in rows] == [0.61, None]


def test_baseline_ratios_and_median_round():
    rows = scaling_rows([_run(1, 3000.0, 0.08), _run(2, 5000.0, 0.1)], 340_000, None, 25.0)
    baselines = {
        "torchrun": [
            {"world_size": 1, "steady_samples_per_s": 2500.0, "threads": 1},
            {"world_size": 2, "steady_samples_per_s": 5000.0, "threads": 1},
        ]
    }
    ratios = baseline_rows(rows, baselines)
    assert [(b["workers"], b["ratio"]) for b in ratios] == [(1, pytest.approx(1.2)), (2, pytest.approx(1.0))]
    rounds = [{"steady_samples_per_s": x} for x in (900.0, 100.0, 500.0, 700.0)]
    assert pick_run(rounds)["steady_samples_per_s"] == 500.0  # lower of the middle two
    assert pick_run(rounds[:3])["steady_samples_per_s"] == 500.0
    assert pick_run(rounds, "best")["steady_samples_per_s"] == 900.0


def test_bench_options_validate_and_always_run_one_worker(tmp_path):
    opts = BenchOptions(workers=[4, 2], storage=str(tmp_path))
    assert opts.workers == [1, 2, 4]
    with pytest.raises(ConfigError) as info:
        BenchOptions(workers=[0], steps=0, baselines=["deepspeed"], link="nvlnk", repeat=0, statistic="mean")
    fields = [name for name, _ in info.value.problems]
    assert fields == ["workers", "steps", "repeat", "statistic", "baseline", "link"]


def test_the_cost_models_options_without_predict_are_refused_before_a_bench_runs(tmp_path, capsys):
    assert main(["bench", "digits", "--from", str(tmp_path), "--storage", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "raytrain bench: --from is read only with --predict (the cost model, which runs nothing): add --predict to "
        "estimate the speedup from it, or drop it to run the bench\n"
    )
    assert main(["bench", "digits", "--gpus", "4", "--grad-mb", "3", "--storage", str(tmp_path)]) == 2
    assert "--gpus and --grad-mb are read only with --predict" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran
    # --link is the bench's too (a predicted column), read without --predict
    assert main(["bench", "--predict", "--link", "nvlink", "--step-time-ms", "20", "--grad-mb", "3"]) == 0


# -- outputs ------------------------------------------------------------------------------


def _report(tmp_path: Path) -> dict:
    rows = scaling_rows([_run(1, 3000.0, 0.08), _run(2, 5000.0, 0.1)], 340_000, "eth10", 25.0)
    chosen = {
        "torchrun": [
            {"world_size": 1, "steady_samples_per_s": 2900.0, "threads": 1},
            {"world_size": 2, "steady_samples_per_s": 4800.0, "threads": 1},
        ]
    }
    return {
        "pipeline": "digits",
        "name": "b",
        "date": "2026-11-29",
        "command": "raytrain bench digits --workers 1,2",
        "machine": {"cpus": 2, "gpu": None, "torch": "2.13", "ray": "2.60", "load_average_at_end": [1.0, 1.0, 1.0]},
        "train_options": TrainConfig().to_dict(),
        "steps": 10,
        "warmup_steps": 3,
        "repeat": 2,
        "num_train_rows": 1438,
        "params": 85_000,
        "grad_bytes": 340_000,
        "link": "eth10",
        "method": render.METHOD.format(warmup=3, statistic="median"),
        "results": rows,
        "baselines": baseline_rows(rows, chosen),
        "rounds": {"raytrain": {"1": [3000.0, 2800.0], "2": [5000.0, 4000.0]}},
        "baseline_runs": chosen,
    }


def test_outputs_table_markdown_and_png(tmp_path):
    report = _report(tmp_path)
    render.write_bench_files(tmp_path, report)
    assert json.loads((tmp_path / "bench.json").read_text())["results"][0]["speedup"] == 1.0
    markdown = (tmp_path / "bench.md").read_text()
    assert "| 1 | 32 | 3,000 | 1.00× | 100% |" in markdown
    assert "| torchrun | 2 | 4,800 | 5,000 | 1.042 | stopped |" in markdown
    assert "forward+backward at N workers − forward+backward at 1 worker" in markdown
    assert (tmp_path / "scaling.png").read_bytes()[:8] == PNG_MAGIC
    text = render.render_text(report)
    assert "speedup" in text and "raytrain / baseline" in text


# -- the classic template, launched as bench launches it (no Ray) ---------------------------------


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> PlannedRun:
    from pipelines.digits.pipeline import load_arrays

    out = tmp_path_factory.mktemp("bench")
    images, labels = load_arrays()
    (out / "baselines").mkdir()
    np.savez(out / "baselines" / "train.npz", image=images[:200], label=labels[:200])
    cfg = TrainConfig(workers=2, epochs=1, batch_size_per_worker=16, storage=str(out / "runs"), name="w2")
    batch = resolve_batch_plan(2, batch_size_per_worker=16)
    return PlannedRun(workers=2, cfg=cfg, batch=batch, epochs=2, steady_steps=8, num_rows=200, out=out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["torchrun", "plain"])
def test_template_baselines_run(planned, mode):
    opts = BenchOptions(workers=[2], warmup_steps=3, baselines=[mode], storage=str(planned.out))
    lines: list[str] = []
    result = baselines.run_template("digits", planned, opts, planned.out, mode=mode, tag="", echo=lines.append)
    world = 2 if mode == "torchrun" else 1
    assert result["mode"] == mode and result["world_size"] == world and result["threads"] == 1
    # 200 rows, 16 per rank: 7 steps per epoch under torchrun (13 plain), 3 of them warm-up, 2 epochs.
    assert result["steady_steps"] == (2 * (7 - 3) if mode == "torchrun" else 2 * (13 - 3))
    assert result["steady_samples_per_s"] > 0
    assert set(result["phase_time_s"]) == {"data_wait", "forward_backward", "optimizer"}
    assert any("samples/s steady" in line for line in lines)


def _fake_template(outcomes: list[str], runs: list[list[str]]):
    """A `subprocess.run` standing in for torchrun: each call takes the next outcome ("abort":
    gloo's own abort, "bug": the template's failure, "ok": its result file)."""

    def run(command, stdout, **kwargs):
        runs.append(command)
        outcome = outcomes[len(runs) - 1]
        out = Path(command[command.index("--out") + 1])
        if outcome == "ok":
            out.write_text(json.dumps({"steady_samples_per_s": 1.0}))
        stdout.write({"abort": baselines.GLOO_ABORT, "bug": "ValueError: a bug", "ok": "done"}[outcome] + "\n")
        return subprocess.CompletedProcess(command, 0 if outcome == "ok" else 1)

    return run


@pytest.mark.parametrize(
    "outcomes, ran, passes",
    [
        (["abort", "ok"], 2, True),  # gloo aborted a rank by itself: taken once more
        (["abort", "abort"], 2, False),  # twice: the error, after one retry only
        (["bug", "ok"], 1, False),  # the template's own failure is never retried
    ],
)
def test_a_template_run_that_gloo_aborted_by_itself_is_taken_once_more(tmp_path, monkeypatch, outcomes, ran, passes):
    (tmp_path / "baselines").mkdir()
    cfg = TrainConfig(workers=2, epochs=1, batch_size_per_worker=16, storage=str(tmp_path / "runs"), name="w2")
    run = PlannedRun(
        workers=2,
        cfg=cfg,
        batch=resolve_batch_plan(2, batch_size_per_worker=16),
        epochs=1,
        steady_steps=1,
        num_rows=32,
        out=tmp_path,
    )
    runs: list[list[str]] = []
    monkeypatch.setattr(baselines.subprocess, "run", _fake_template(outcomes, runs))
    opts = BenchOptions(workers=[2], warmup_steps=1, baselines=["torchrun"], storage=str(tmp_path))
    lines: list[str] = []

    def call():
        return baselines.run_template("digits", run, opts, tmp_path, mode="torchrun", tag="", echo=lines.append)

    if passes:
        assert call()["steady_samples_per_s"] == 1.0
    else:
        with pytest.raises(BenchError, match="exited with 1"):
            call()
    assert len(runs) == ran
    assert sum("aborted by gloo itself" in line for line in lines) == (1 if ran == 2 else 0)


# -- command line ---------------------------------------------------------------------------


def test_cli_predict(capsys):
    code = main(
        [
            "bench",
            "--predict",
            "--gpus",
            "8",
            "--nodes",
            "1",
            "--link",
            "nvlink",
            "--step-time-ms",
            "80",
            "--grad-mb",
            "102.2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "speedup 7.97× (99.7% efficiency)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "digits", "--baseline", "deepspeed"], "--baseline: got 'deepspeed'"),
        (["bench", "digits", "--workers", "1,two"], "--workers: got '1,two'"),
        (["bench", "digits", "--warmup-steps", "-1"], "--warmup-steps: got -1; must be 0 or more"),
        (["bench", "digits", "--timing-warmup-steps", "-1"], "--warmup-steps: got -1; must be 0 or more"),
        (["bench", "digits", "--lr", "-1"], "--lr: got -1.0"),
        (["bench", "--predict", "--gpus", "8"], "--step-time-ms: needed by --predict"),
        (
            [
                "bench",
                "--predict",
                "--gpus",
                "16",
                "--nodes",
                "2",
                "--link",
                "nvlink",
                "--step-time-ms",
                "80",
                "--grad-mb",
                "1",
            ],
            "inter-node link",
        ),
    ],
)
def test_cli_usage_errors(capsys, argv, message):
    import ray

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not ray.is_initialized()


# -- end to end (Ray) ----------------------------------------------------------------------------


@pytest.mark.ray
def test_bench_digits_one_and_two_workers(ray_session, tmp_path, capsys):
    code = main(["bench", "digits", "--workers", "1,2", "--steps", "10", "--storage", str(tmp_path), "--name", "b"])
    out = capsys.readouterr().out
    assert code == 0, out
    folder = tmp_path / "b"
    report = json.loads((folder / "bench.json").read_text())
    rows = {row["workers"]: row for row in report["results"]}
    assert sorted(rows) == [1, 2]
    assert rows[1]["speedup"] == 1.0 and rows[1]["split_ms"]["communication"] == 0.0
    assert rows[2]["steady_samples_per_s"] > 0 and rows[2]["efficiency"] == pytest.approx(rows[2]["speedup"] / 2)
    assert set(rows[2]["split_ms"]) == {"step", "data_wait", "compute", "communication", "optimizer", "other"}
    assert "| 1 | 32 |" in (folder / "bench.md").read_text()
    # The cost view: the CNN's forward and backward FLOPs per sample, and what each worker achieved.
    cost = rows[2]["cost"]
    assert cost["flops_per_sample"] == 7_548_672 and cost["mfu"] is None  # a CPU: no peak known
    assert cost["achieved_tflops_per_worker"] == pytest.approx(7_548_672 * rows[2]["steady_samples_per_s"] / 2 / 1e12)
    assert "TFLOP/s/worker" in out and "FLOPs per sample: 7,548,672" in (folder / "bench.md").read_text()
    assert (folder / "scaling.png").read_bytes()[:8] == PNG_MAGIC
    assert "speedup" in out and str(folder / "bench.json") in out
