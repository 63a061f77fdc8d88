"""CPU Ray tier: the ports under examples/ (docs/porting.md) train on 2 CPU workers, small sizes."""

from __future__ import annotations

import pytest

import raytrain
from examples.multigpu_tutorial.pipeline import TutorialRegression
from examples.nanogpt_style.pipeline import NanoGPTStyle
from examples.sgd_recipe.pipeline import SGDRecipe

pytestmark = pytest.mark.ray


def test_the_sgd_recipe_port_trains_with_its_schedule_and_augmentation(ray_session, tmp_path, make_config):
    pipeline = SGDRecipe()
    cfg = make_config(**{**pipeline.default_config, "epochs": 3, "lr_milestones": [2], "workers": 2, "name": "sgd"})
    result = raytrain.fit(pipeline, cfg)
    assert result.summary["status"] == "finished" and result.summary["samples_seen"] == 3 * 1438
    events = [e["message"] for e in raytrain.rundir.read_jsonl(tmp_path / "sgd" / "events.jsonl")]
    assert "warmup 1 epoch from 1.0e-2, to step 12 of 36; step ×0.1 at epochs 2; sgd" in events[0]
    rows = [r for r in raytrain.rundir.read_jsonl(tmp_path / "sgd" / "metrics.jsonl") if r.get("epoch_end")]
    assert rows[-1]["lr"] == pytest.approx(0.01) and rows[-1]["val_accuracy"] > 0.5


def test_the_ddp_tutorial_port_trains_on_its_torch_dataset(ray_session, tmp_path, make_config):
    pipeline = TutorialRegression()
    cfg = make_config(**{**pipeline.default_config, "epochs": 3, "lr": 0.05, "workers": 2, "name": "tut"})
    result = raytrain.fit(pipeline, cfg)
    assert result.summary["status"] == "finished" and result.summary["samples_seen"] == 3 * 2048
    rows = [r for r in raytrain.rundir.read_jsonl(tmp_path / "tut" / "metrics.jsonl") if r.get("epoch_end")]
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]


def test_the_nanogpt_style_port_trains_in_steps_on_sampled_windows(ray_session, tmp_path, make_config):
    import torch

    from examples.nanogpt_style.data import prepare
    from pipelines.charlm.model import CharGPT

    data = prepare(tmp_path / "data", megabytes=0.2)
    pipeline = NanoGPTStyle()
    recipe = {**pipeline.default_config, "max_steps": 12, "warmup_steps": 4, "eval_every_steps": 5, "eval_batches": 2}
    cfg = make_config(**{**recipe, "workers": 2, "name": "nano", "pipeline_args": {"data": str(data)}})
    result = raytrain.fit(pipeline, cfg)
    assert (result.summary["status"], result.summary["steps"], result.summary["samples_seen"]) == ("finished", 12, 192)
    events = [e["message"] for e in raytrain.rundir.read_jsonl(tmp_path / "nano" / "events.jsonl")]
    assert (
        "warmup 4 steps from 0.0e0, to step 4 of 12; the pipeline's lr_factor; the pipeline's build_optimizer "
        "(AdamW, 2 groups)" in (events[0])
    )
    rows = raytrain.rundir.read_jsonl(tmp_path / "nano" / "metrics.jsonl")
    assert [row["step"] for row in rows if "val_loss" in row] == [5, 10, 12]
    assert rows[-1]["lr"] == pytest.approx(1e-4)  # the cosine's floor, from the pipeline's option via the context
    CharGPT(block=64, width=128, layers=2, heads=4).load_state_dict(
        torch.load(tmp_path / "nano" / "model.pt", weights_only=True), strict=True
    )
