"""CPU Ray tier: the user's recipe across failures — each optimizer's state survives a kill and a
resume at another worker count, transform_batch differs every epoch and repeats after a resume,
and a torch Dataset trains every sample exactly once per epoch."""

from __future__ import annotations

import pytest
import torch
from rt_test_pipelines import AugmentingPipeline, OptimizerProbePipeline, TorchDatasetPipeline, read_jsonl

import raytrain
from raytrain.rundir.checkpoints import checkpoint_dirs, load_state

pytestmark = pytest.mark.ray


# AdamW, the default, crosses a kill and a resume at another count in most Ray tests (exact
# resumes in tests/test_train_ray.py, test_fsdp_ray.py, test_steps_ray.py); here the others:
# SGD's momentum buffers (made at the first step) and a third-party optimizer's state.
# Lamb in the scenario stage (docs/testing.md): SGD keeps the round trip of a non-default
# optimizer's state in CI.
@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("lamb", marks=pytest.mark.scenario)])
def test_optimizer_state_round_trips_a_kill_and_a_resume_at_another_worker_count(
    ray_session, tmp_path, optimizer, make_config
):
    out = tmp_path / "records"
    out.mkdir()
    base = dict(
        epochs=2,
        global_batch_size=24,
        optimizer=optimizer,
        name=optimizer,
        checkpoint_every_steps=3,
        checkpoint_async=False,  # the step-6 checkpoint is whole before the crash at step 7
        max_failures=0,
        log_every_steps=3,
        **({"momentum": 0.9, "nesterov": True} if optimizer == "sgd" else {}),
    )
    pipeline = OptimizerProbePipeline(str(out), num_rows=120, crash_at_step=7)
    with pytest.raises(raytrain.RunFailed):
        raytrain.fit(pipeline, make_config(workers=2, **base))
    resumed_from = max(checkpoint_dirs(tmp_path / optimizer), key=lambda d: load_state(d)["position"]["step"])
    saved = load_state(resumed_from)["optimizer"]["state"]
    saved_sum = sum(
        float(v.double().sum()) for s in saved.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1
    )
    result = raytrain.fit(pipeline, make_config(workers=3, resume=True, **base))
    assert result.summary["status"] == "finished" and result.summary["world_sizes"][-1] == 3
    probes = [r for r in read_jsonl(out / "optimizer-state-rank0.jsonl") if r["world_size"] == 3]
    assert probes and probes[0]["step"] == 6 and saved_sum != 0
    assert probes[0]["state_sum"] == pytest.approx(saved_sum, rel=1e-9)  # the state the optimizer continued with


def test_transform_batch_differs_each_epoch_and_repeats_after_a_resume(ray_session, tmp_path, make_config):
    out = tmp_path / "records"
    out.mkdir()
    base = dict(
        epochs=2,
        global_batch_size=16,
        name="aug",
        checkpoint_every_steps=2,
        checkpoint_async=False,  # the step-4 checkpoint is whole before the crash at step 5
        workers=2,
    )
    with pytest.raises(raytrain.RunFailed):
        raytrain.fit(AugmentingPipeline(str(out), num_rows=128, crash_at_step=5), make_config(max_failures=0, **base))
    raytrain.fit(AugmentingPipeline(str(out), num_rows=128), make_config(resume=True, **base))
    rows = read_jsonl(out / "noise-rank1.jsonl")
    first = {(r["epoch"], r["step"]): r["noise"] for r in rows if r["attempt"] == "first"}
    second = {(r["epoch"], r["step"]): r["noise"] for r in rows if r["attempt"] == "second"}
    redone = set(first) & set(second)
    # Resumed from the step-4 checkpoint: step 4 is redone, and step 5 too when rank 1 reached
    # it before rank 0's crash there ended the attempt; redone steps get the same noise.
    assert {4} <= {step for _, step in redone} <= {4, 5} and all(first[k] == second[k] for k in redone)
    # 8 steps an epoch: step 4 of epoch 0 and step 12 (the same place in epoch 1) differ, as all do.
    assert second[(0, 4)] != second[(1, 12)] and len({tuple(v) for v in second.values()}) == len(second)


def test_a_torch_dataset_trains_every_sample_once_per_epoch(ray_session, tmp_path, make_config):
    out = tmp_path / "records"
    out.mkdir()
    for mode in (0, 50):  # in memory, then streamed (windows of 50 rows)
        run = raytrain.fit(
            TorchDatasetPipeline(str(out), num_rows=203),
            make_config(epochs=2, workers=2, global_batch_size=24, name=f"torch-{mode}", shuffle_window_rows=mode),
        )
        assert run.summary["samples_seen"] == 2 * 203
        rows = read_jsonl(out / "ids-rank0.jsonl") + read_jsonl(out / "ids-rank1.jsonl")
        for epoch in (0, 1):
            assert sorted(i for r in rows if r["epoch"] == epoch for i in r["ids"]) == list(range(203))
        for path in out.glob("ids-rank*.jsonl"):
            path.unlink()
