"""The run's summary.json, from the files rank 0 leaves (pure tier: no Ray)."""

from __future__ import annotations

import json

from raytrain.config import TrainConfig
from raytrain.trainer import write_summary


def test_summary_carries_the_steady_step_count(tmp_path):
    progress = {"epoch": 2, "step": 90, "samples_seen": 2876, "steady_steps": 84, "steady_samples": 2688, "steady_samples_per_s": 2500.0}
    (tmp_path / "progress.json").write_text(json.dumps(progress))
    summary = write_summary(tmp_path, TrainConfig(storage=str(tmp_path)), None, None, started=0.0)
    assert (summary.steady_steps, summary.steady_samples_per_s) == (84, 2500.0)
    assert json.loads((tmp_path / "summary.json").read_text())["steady_steps"] == 84


def test_summary_of_a_run_without_progress_has_no_steady_figures(tmp_path):
    summary = write_summary(tmp_path, TrainConfig(storage=str(tmp_path)), None, RuntimeError("boom"), started=0.0)
    assert summary.steady_steps is None and summary.status == "failed"
