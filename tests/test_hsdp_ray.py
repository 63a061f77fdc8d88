"""Per-step fault tolerance for a sharded model on CPU (`--fault-tolerance per-step --strategy
fsdp --replica-group-size 2`, torchft on gloo): 4 workers as 2 groups of 2, each group holding
one copy of the model sharded over its 2 workers. A worker of one group is SIGKILLed
mid-epoch: the group goes whole (its other worker is taken out), the other group never
restarts and trains on alone, the group's replacement heals from the live group's shards,
every id is trained once per epoch, and the run's model exports strict. Both workers of a
group lost at once (their node removed) is tests/test_elastic_ray.py's per-step case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from rt_test_pipelines import ReplicaRecordingPipeline, read_jsonl  # noqa: E402
from test_replicas_ray import committed_ids, processes  # noqa: E402

from raytrain import fit  # noqa: E402
from raytrain.cli import main  # noqa: E402

pytestmark = pytest.mark.ray


def test_a_worker_lost_takes_its_group_out_and_the_other_group_trains_on_then_the_group_heals_back(
    ray_session, tmp_path, make_config
):
    out = tmp_path / "out"
    out.mkdir()
    rows = 900
    cfg = make_config(
        workers="4",
        epochs=3,
        batch_size_per_worker=10,
        lr=0.05,
        warmup_epochs=0,
        fault_tolerance="per-step",
        strategy="fsdp",
        replica_group_size=2,
        name="hsdp",
        log_every_steps=4,
        progress="off",
    )
    # Steps paced at 1 s until the killed worker's replacement trains: its group's two workers
    # are replaced one after the other (~10–30 s each here), then heal and rejoin.
    pipeline = ReplicaRecordingPipeline(str(out), num_rows=rows, crash_at_step=5, step_sleep_s=1.0, kill_replica=3)
    result = fit(pipeline, cfg)

    pids = processes(out)
    assert len(pids[0]) == 1 and len(pids[1]) == 1, pids  # group 0 never restarted
    dead = json.loads((out / "killed-replica3").read_text())["pid"]
    assert pids[3] - {dead}, "worker 3 was replaced"
    assert len(pids[2]) == 2 and len(pids[3]) == 2, pids  # group 1 replaced whole, once
    for epoch, ids in committed_ids(out).items():
        assert sorted(ids) == list(range(rows)), f"epoch {epoch}: not every id exactly once"
    assert sorted(committed_ids(out)) == [0, 1, 2]

    run_dir = Path(result.run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    assert "over 2 replica groups of 2 (fsdp within each)" in events[0]["message"]
    quorum = [e for e in events if e["kind"] == "quorum" and "world_size" in e]
    assert [(e["previous_world_size"], e["world_size"]) for e in quorum][:2] == [(4, 2), (2, 4)], quorum
    assert quorum[0]["message"].startswith("Quorum 4 → 2 workers (2 → 1 replica groups of 2) at step 5")
    assert "a worker was lost, and its group with it; the other groups go on" in quorum[0]["message"]
    assert "a group rejoined, healed from a live peer" in quorum[1]["message"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and 2 in summary["world_sizes"]
    # The group's loss counts once: its other worker, taken out with it, is not counted.
    assert summary["failures_recovered"] == 1, summary

    exported = tmp_path / "exported.pt"
    assert main(["export", str(run_dir), "-o", str(exported)]) == 0
    model = pipeline.build_model(cfg)
    model.load_state_dict(torch.load(exported, weights_only=True), strict=True)


# Scenario stage (docs/testing.md): groups on Ray stay in CI through the test above; their steps
# against one group's are tests/test_hsdp.py's, a sharded checkpoint resumed at another count and
# strategy tests/test_fsdp_ray.py's.
@pytest.mark.scenario
def test_groups_train_as_a_restarting_fsdp_run_and_their_checkpoint_resumes_under_ddp_at_another_count(
    ray_session, tmp_path, make_config
):
    """Without a failure, 2 groups of 2 take the steps 4 fsdp workers take (fp32); the groups'
    checkpoint (DCP shards of the writing group) resumes at 2 workers under ddp and restart."""
    out = tmp_path / "out"
    out.mkdir()
    common = dict(
        workers="4",
        batch_size_per_worker=10,
        lr=0.05,
        warmup_epochs=0,
        strategy="fsdp",
        log_every_steps=1,
        progress="off",
        max_steps=20,  # 15 steps an epoch: across its end
    )
    pipeline = ReplicaRecordingPipeline(str(out), num_rows=600)
    restart = fit(pipeline, make_config(**common, name="restart"))
    groups = fit(pipeline, make_config(**common, name="groups", fault_tolerance="per-step", replica_group_size=2))

    def losses(run_dir: str) -> dict[int, float]:
        rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
        return {row["step"]: row["loss"] for row in rows if "loss" in row and not row.get("epoch_end")}

    healthy = json.loads((Path(groups.run_dir) / "summary.json").read_text())
    assert healthy["checkpoints_skipped"] == 0 and healthy["failures_recovered"] == 0, healthy
    a, b = losses(restart.run_dir), losses(groups.run_dir)
    assert sorted(a) == sorted(b) and len(a) >= 18
    assert max(abs(a[s] - b[s]) / abs(a[s]) for s in a) <= 1e-4, (a, b)

    more = {**common, "workers": "2", "strategy": "ddp", "max_steps": 24}
    resumed = fit(pipeline, make_config(**more, name="groups", resume=True))
    summary = json.loads((Path(resumed.run_dir) / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 24 and summary["world_sizes"][-1] == 2
    events = read_jsonl(Path(resumed.run_dir) / "events.jsonl")
    assert any(e["kind"] == "resize" and "step 20" in e["message"] for e in events), events
    exported = tmp_path / "exported.pt"
    assert main(["export", resumed.run_dir, "-o", str(exported)]) == 0
    pipeline.build_model(None).load_state_dict(torch.load(exported, weights_only=True), strict=True)
