"""`raytrain report RUN_DIR`: plots and report.md from crafted run files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raytrain.cli import main
from raytrain.observe.report import ReportError, load_run, write_report

T0 = 1_800_000_000.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, *, summary: bool = True) -> Path:
    """An elastic run: 2 workers, a restart at step 20, 4 workers from step 40, 3 epochs of 30 steps."""
    run_dir.mkdir(parents=True)
    rows, events = (
        [],
        [{"time": T0, "kind": "plan", "message": "global 64 = 2 workers × 32 per worker × 1 accumulation step"}],
    )
    for step in range(5, 91, 5):
        epoch = (step - 1) // 30 + 1
        world = 2 if step <= 40 else 4
        row = {
            "epoch": epoch,
            "step": step,
            "samples_seen": step * 64 * world // 2,
            "world_size": world,
            "global_batch_size": 32 * world,
            "lr": 1e-3 * min(1.0, step / 30) * world / 2,
            "loss": 2.0 / (1 + step / 10),
            "samples_per_s": 900.0 * world,
            "time_s": T0 + 2 * step,
        }
        if step % 30 == 0:
            row.update(
                epoch_end=True,
                epoch=step // 30,
                epoch_loss=row["loss"] * 1.5,
                val_loss=row["loss"] * 1.1,
                val_accuracy=0.6 + 0.1 * epoch,
            )
        rows.append(row)
    events.append(
        {
            "time": T0 + 45,
            "kind": "restore",
            "message": "Restarted from the checkpoint at step 20 with 2 workers",
            "step": 20,
            "world_size": 2,
        }
    )
    events.append(
        {
            "time": T0 + 81,
            "kind": "resize",
            "message": "Resized 2 → 4 workers at step 40",
            "step": 40,
            "world_size": 4,
            "previous_world_size": 2,
        }
    )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "epochs": 3,
                "workers": "2:4",
                "lr": 0.001,
                "name": "elastic",
                "pipeline": "digits",
                "ddp": {"static_graph": False},
            }
        )
    )
    if summary:
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "status": "finished",
                    "epochs": 3,
                    "steps": 90,
                    "samples_seen": 8000,
                    "wall_time_s": 200.5,
                    "steady_samples_per_s": 2500.0,
                    "world_sizes": [2, 4],
                    "failures_recovered": 1,
                    "final_metrics": {"loss": 0.2, "val_loss": 0.22, "val_accuracy": 0.9},
                }
            )
        )
    return run_dir


def test_report_writes_valid_pngs_and_a_markdown_summary(tmp_path):
    run_dir = write_run(tmp_path / "elastic")
    report = write_report(run_dir)
    assert Path(report) == run_dir / "report.md"
    from PIL import Image

    for name in ("loss", "val", "lr", "workers", "throughput"):
        path = run_dir / "plots" / f"{name}.png"
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.size == (825, 352)  # 7.5 × 3.2 in at 110 dpi
            assert len(image.convert("RGB").getcolors(1 << 20)) > 20  # something is drawn

    text = report.read_text()
    assert text.startswith("# elastic\n")
    assert (
        "**finished** · pipeline `digits` · 3/3 epochs · 90 steps · 8,000 samples · 200.5 s wall · 2,500 samples/s "
        "steady · workers 2 → 4 · 1 failure recovered" in text
    )
    head = "| epoch | step | epoch_loss | loss (last window) | val_accuracy | val_loss | lr | samples/s | workers |"
    assert head in text
    assert "| 3 | 90 | 0.3000 | 0.2000 | 0.9000 | 0.2200 | 2.00e-03 | 3,600 | 4 | 128 |" in text
    assert "(+45 s): Restarted from the checkpoint at step 20 with 2 workers" in text
    assert "(+81 s): Resized 2 → 4 workers at step 40" in text
    for name in ("loss", "val", "lr", "workers", "throughput"):
        assert f"![{name}](plots/{name}.png)" in text
    assert "| ddp.static_graph | False |" in text and "| workers | 2:4 |" in text
    assert f"tensorboard --logdir {run_dir}" in text


def test_an_event_whose_time_no_clock_reaches_is_written_as_its_number(tmp_path):
    run_dir = write_run(tmp_path / "far")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    events[1]["time"] = 1e300  # past any time_t: time.localtime raises OverflowError
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["report", str(run_dir)]) == 0
    text = (run_dir / "report.md").read_text()
    assert "- 1e+300 (+1e+300 s): Restarted from the checkpoint at step 20 with 2 workers" in text
    assert "(+81 s): Resized 2 → 4 workers at step 40" in text


def test_report_of_a_run_still_going_or_killed_has_no_summary_yet(tmp_path):
    run_dir = write_run(tmp_path / "partial", summary=False)
    text = write_report(run_dir).read_text()
    assert "**running or interrupted**" in text and "workers 2 → 4" in text
    assert (run_dir / "plots" / "throughput.png").exists()


def test_report_of_a_run_without_metrics_has_no_plots(tmp_path):
    run_dir = tmp_path / "fresh"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("epochs: 2\nname: fresh\n")
    text = write_report(run_dir).read_text()
    assert "**no metrics yet**" in text and "## Plots" not in text
    assert not (run_dir / "plots").exists()


def test_report_of_something_that_is_not_a_run(tmp_path):
    with pytest.raises(ReportError, match="is not a directory"):
        load_run(tmp_path / "missing")
    with pytest.raises(ReportError, match="is not a raytrain run directory"):
        load_run(tmp_path)


def test_report_command(tmp_path, capsys):
    run_dir = write_run(tmp_path / "elastic")
    assert main(["report", str(run_dir)]) == 0
    assert (
        capsys.readouterr().out
        == f"Wrote {run_dir / 'report.md'} and 5 plots: loss.png, lr.png, throughput.png, val.png, workers.png\n"
    )
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "raytrain report: " in capsys.readouterr().err


def test_report_says_the_goodput_and_where_the_rest_went(tmp_path):
    run_dir = write_run(tmp_path / "elastic")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["goodput"] = {
        "goodput": 0.8123,
        "wall_s": 200.5,
        "kept_steps_s": 162.87,
        "step_s": 1.81,
        "start_s": 12.0,
        "checkpoint_stall_s": 3.5,
        "recovery_s": 15.0,
        "redone_s": 4.0,
        "validation_s": None,
        "other_s": 3.13,
        "failures": 1,
        "checkpoints": 3,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    text = write_report(run_dir).read_text()
    assert "1 failure recovered · goodput 81%" in text
    assert "## Goodput" in text and "**81.2%** of the wall time went to steps that were kept" in text
    assert "| recovery | 15.0 | 7.5% |" in text
    assert "| validation | not recorded |  |" in text
    assert "their time is part of *other*" in text


def write_straggling_run(run_dir: Path) -> Path:
    """The elastic run with each rank's own step time: ~100 ms everywhere, until rank 2 (of the
    4 workers from step 45) takes ~7× as long from step 55, and is named a straggler at step 70."""
    write_run(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if not row.get("epoch_end"):
            times = [0.100 + 0.001 * rank for rank in range(row["world_size"])]
            if row["world_size"] == 4 and row["step"] >= 55:
                times[2] = 0.700
            row["rank_step_s"] = times
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    straggler = {
        "time": T0 + 140,
        "kind": "straggler",
        "message": "Straggler: rank 2 (host 10.0.0.3) takes 6.9× the others' median step time for 15 steps running, "
        "and every step waits for it; it computes slowly (data wait 2% of its step): a slow or busy device or host.",
        "step": 70,
        "rank": 2,
        "host": "10.0.0.3",
        "step_ratio": 6.931,
        "data_wait_fraction": 0.02,
        "slow_steps": 15,
        "ended": False,
    }
    with (run_dir / "events.jsonl").open("a") as events:
        events.write(json.dumps(straggler) + "\n")
    return run_dir


def test_report_shows_each_ranks_own_step_time_and_the_straggler(tmp_path):
    run_dir = write_straggling_run(tmp_path / "straggling")
    text = write_report(run_dir).read_text()
    section = text.split("## Step time per rank\n", 1)[1].split("\n## ", 1)[0]
    assert "| rank | steps | median ms | max ms | median / all ranks' median |" in section
    assert "| 0 | 5–85 | 100.0 | 100.0 (step 5) | 0.98× |" in section  # 2 workers up to step 40, 4 after
    assert "| 2 | 45–85 | 700.0 | 700.0 (step 55) | 6.86× |" in section  # 700 / 102 ms
    assert "| 3 | 45–85 | 103.0 | 103.0 (step 45) | 1.01× |" in section
    assert "(+140 s): Straggler: rank 2 (host 10.0.0.3) takes 6.9× the others' median step time" in section
    assert text.index("## Step time per rank") < text.index("## Plots")
    assert "![ranks](plots/ranks.png)" in text
    assert (run_dir / "plots" / "ranks.png").read_bytes()[:8] == PNG_SIGNATURE


def test_report_of_a_run_without_rank_step_times_has_no_such_section(tmp_path):
    run_dir = write_run(tmp_path / "elastic")
    text = write_report(run_dir).read_text()
    assert "Step time per rank" not in text and "ranks.png" not in text
    assert not (run_dir / "plots" / "ranks.png").exists()
