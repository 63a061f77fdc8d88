"""CPU Ray tier: the ports under examples/ (docs/porting.md) train on 2 CPU workers, small sizes."""

from __future__ import annotations

import pytest

import raytrain
from examples.multigpu_tutorial.pipeline import TutorialRegression
from examples.sgd_recipe.pipeline import SGDRecipe

pytestmark = pytest.mark.ray


def test_the_sgd_recipe_port_trains_with_its_schedule_and_augmentation(ray_session, tmp_path):
    pipeline = SGDRecipe()
    cfg = raytrain.TrainConfig(
        **{
            **pipeline.default_config,
            "epochs": 3,
            "lr_milestones": [2],
            "workers": 2,
            "storage": str(tmp_path),
            "name": "sgd",
        }
    )
    result = raytrain.fit(pipeline, cfg)
    assert result.summary["status"] == "finished" and result.summary["samples_seen"] == 3 * 1438
    events = [e["message"] for e in raytrain.rundir.read_jsonl(tmp_path / "sgd" / "events.jsonl")]
    assert "warmup 1 epoch from 1.0e-2; step ×0.1 at epochs 2; sgd" in events[0]
    rows = [r for r in raytrain.rundir.read_jsonl(tmp_path / "sgd" / "metrics.jsonl") if r.get("epoch_end")]
    assert rows[-1]["lr"] == pytest.approx(0.01) and rows[-1]["val_accuracy"] > 0.5


def test_the_ddp_tutorial_port_trains_on_its_torch_dataset(ray_session, tmp_path):
    pipeline = TutorialRegression()
    cfg = raytrain.TrainConfig(
        **{**pipeline.default_config, "epochs": 3, "lr": 0.05, "workers": 2, "storage": str(tmp_path), "name": "tut"}
    )
    result = raytrain.fit(pipeline, cfg)
    assert result.summary["status"] == "finished" and result.summary["samples_seen"] == 3 * 2048
    rows = [r for r in raytrain.rundir.read_jsonl(tmp_path / "tut" / "metrics.jsonl") if r.get("epoch_end")]
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
