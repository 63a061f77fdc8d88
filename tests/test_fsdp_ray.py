"""CPU Ray tier: --strategy fsdp on 2 workers (gloo) — a rank killed and recovered, a resume at 3
workers from a 2-worker sharded checkpoint, a DDP checkpoint resumed under fsdp and back, and a
plain export — with every row trained exactly once per epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rt_test_pipelines import RecordingPipeline, TiedPipeline, read_jsonl

import raytrain
from raytrain.cli import main
from raytrain.errors import PipelineCodeError
from raytrain.rundir.checkpoints import checkpoint_dirs, stored_step

pytestmark = pytest.mark.ray

ROWS, BATCH = 96, 16  # 6 steps per epoch


@pytest.fixture
def config(make_config):
    """make_config with the settings every run here shares; keywords override them."""
    base = dict(
        strategy="fsdp",
        workers=2,
        global_batch_size=BATCH,  # the same rows per step at every worker count
        lr=1e-2,
        warmup_epochs=0,
        schedule="constant",
        checkpoint_every_steps=2,
        log_every_steps=1,
        num_checkpoints_to_keep=20,
        name="fsdp",
    )
    return lambda **values: make_config(**{**base, **values})


def ids_by_epoch(records: list[dict], epoch: int, steps: range | None = None) -> list[int]:
    return sorted(
        i for row in records if row["epoch"] == epoch and (steps is None or row["step"] in steps) for i in row["ids"]
    )


def records_of(out: Path) -> list[dict]:
    return [row for path in sorted(out.glob("ids-rank*.jsonl")) for row in read_jsonl(path)]


def test_fsdp_recovers_a_killed_rank_then_resumes_at_three_workers_exactly(ray_session, tmp_path, config):
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    first_out.mkdir()
    second_out.mkdir()
    cfg = config(epochs=2, max_failures=1)
    result = raytrain.fit(RecordingPipeline(str(first_out), num_rows=ROWS, crash_at_step=5), cfg)
    summary, run_dir = result.summary, Path(result.run_dir)
    assert summary["status"] == "finished" and summary["failures_recovered"] == 1

    # A rank died at step 5 and the group restarted from the last complete sharded checkpoint
    # (step 4; step 2 when step 4's files were still being written as it died): every row
    # once per epoch.
    records = records_of(first_out)
    second = [row for row in records if row["attempt"] == "second"]
    resumed_at = min(row["step"] for row in second)
    assert resumed_at in (2, 4)
    first = [row for row in records if row["attempt"] == "first"]
    trained = [i for row in first if row["epoch"] == 0 and row["step"] < resumed_at for i in row["ids"]]
    trained += ids_by_epoch(second, 0)
    assert sorted(trained) == list(range(ROWS))
    assert ids_by_epoch(second, 1) == list(range(ROWS))

    events = [e["message"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert any("fsdp over the root, " in m and "parameters on this rank" in m for m in events)
    latest = checkpoint_dirs(run_dir)[-1]
    assert not (latest / "model.pt").exists()  # sharded: the DCP files only
    assert len(list(latest.glob("*.distcp"))) == 2  # each rank wrote its own part

    # The final model and an export of a sharded checkpoint are plain, and load strict.
    model = RecordingPipeline(str(first_out)).build_model(cfg)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True), strict=True)
    exported = tmp_path / "exported.pt"
    assert main(["export", str(latest), "-o", str(exported)]) == 0
    weights = torch.load(exported, weights_only=True)
    model.load_state_dict(weights, strict=True)
    final = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(weights[k], final[k]) for k in final)  # the last checkpoint is the end of training


def test_a_two_worker_sharded_checkpoint_resumes_at_three_workers_mid_epoch_exactly(ray_session, tmp_path, config):
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    first_out.mkdir()
    second_out.mkdir()
    # The pipeline's own error at step 11 (epoch 2) ends the run (exit 2, never retried) with the
    # step-10 checkpoint: the one being written is let complete.
    with pytest.raises(PipelineCodeError, match="a bug in compute_loss at step 11"):
        raytrain.fit(RecordingPipeline(str(first_out), num_rows=ROWS, fail_at_step=11), config(epochs=2))
    run_dir = tmp_path / "fsdp"
    assert stored_step(checkpoint_dirs(run_dir)[-1]) == 10
    before = {row["step"]: row["loss"] for row in read_jsonl(run_dir / "metrics.jsonl") if not row.get("epoch_end")}

    # Fixed, it resumes at 3 workers: the shards of 2 are resharded over 3, the rows of epoch 2
    # not yet trained are trained once, and step 11's loss is what 2 workers computed (the
    # same rows and weights; only the reduction order differs).
    resumed = raytrain.fit(RecordingPipeline(str(second_out), num_rows=ROWS), config(epochs=2, workers=3, resume=True))
    assert resumed.summary["status"] == "finished"
    first, again = records_of(first_out), records_of(second_out)
    assert {row["world_size"] for row in again} == {3} and min(row["step"] for row in again) == 10
    epoch1 = [i for row in first if row["epoch"] == 1 and row["step"] < 10 for i in row["ids"]] + ids_by_epoch(again, 1)
    assert sorted(epoch1) == list(range(ROWS))
    after = {row["step"]: row["loss"] for row in read_jsonl(run_dir / "metrics.jsonl") if not row.get("epoch_end")}
    assert after[11] == pytest.approx(before[11], rel=1e-4)
    resize = [e["message"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resize"]
    assert resize and resize[-1].startswith("Resized 2 → 3 workers at step 10")


def test_a_ddp_checkpoint_resumes_under_fsdp_and_back(ray_session, tmp_path, config):
    outs = [tmp_path / name for name in ("ddp", "fsdp", "ddp-again")]
    for out in outs:
        out.mkdir()
    raytrain.fit(RecordingPipeline(str(outs[0]), num_rows=ROWS), config(strategy="ddp", epochs=1))
    run_dir = tmp_path / "fsdp"
    assert (checkpoint_dirs(run_dir)[-1] / "model.pt").exists()  # unsharded: the plain model too
    raytrain.fit(RecordingPipeline(str(outs[1]), num_rows=ROWS), config(epochs=2, resume=True))
    raytrain.fit(RecordingPipeline(str(outs[2]), num_rows=ROWS), config(strategy="ddp", epochs=3, resume=True))
    for epoch, out in enumerate(outs):
        assert ids_by_epoch(records_of(out), epoch) == list(range(ROWS))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs"] == 3
    lines = [e["message"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] in ("plan", "restore")]
    assert ["fsdp over the root" in line for line in lines] == [False, True, False]


def test_tied_weights_split_over_two_units_are_shard_modules_error_before_any_step(ray_session, tmp_path, config):
    with pytest.raises(PipelineCodeError) as failure:
        raytrain.fit(TiedPipeline(str(tmp_path), num_rows=ROWS), config(epochs=1))
    message = str(failure.value)
    assert message.startswith("pipeline TiedPipeline: shard_modules puts one parameter in two FSDP units")
    assert "0.weight (block 0) and 2.weight (block 2) are one tied parameter" in message
    assert "compute_loss" not in message and "rt_test_pipelines.py" in message
    assert not checkpoint_dirs(tmp_path / "fsdp")
