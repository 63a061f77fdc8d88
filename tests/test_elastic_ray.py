"""Elastic runs on a simulated cluster (ray.cluster_utils.Cluster, its own Ray in a
subprocess), each losing a node and getting one back.

- Restarting, 3 nodes of 1 worker: lose a node → continue at 2 workers; a node joins → grow
  back to 3. At every size the global batch and the learning rate follow the rules. The run
  is sharded (--strategy fsdp): every resize reshards its checkpoint for the new worker count.
- Per-step in replica groups of 2 (fsdp within each), one group per node of 2 CPUs: one
  group's node goes (both its workers at once) and no other node has room, so the group waits
  while the other trains on alone, never restarted; a node joins and the group starts again,
  heals from the live group and rejoins. Every id is trained once per epoch throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_replicas_ray import committed_ids, processes

from raytrain.rules import schedule

pytestmark = pytest.mark.ray
SCENARIO = Path(__file__).with_name("elastic_scenario.py")


def test_workers_2_to_3_leaves_a_drained_node_at_a_checkpoint_and_grows_back(tmp_path):
    """The node is drained (a preemption notice, 30 s deadline) before it goes: the run checkpoints
    at the next sync, restarts without it from that step (no step lost or taken twice), is not
    charged a failure, and grows back when a node joins."""
    summary, events = _shrinks_and_grows_back(tmp_path, drain=True)
    assert summary["failures_recovered"] == 0 and summary["preemptions"] == 1, summary
    notice = next(e for e in events if e["kind"] == "preempted")
    assert notice["checkpoint_step"] == notice["step"] and notice["reason"] == "drain", notice
    assert 0 < notice["deadline"] - notice["time"] <= 30, notice
    assert notice["message"].startswith("Preemption notice for rank ") and len(notice["ranks"]) == 1, notice
    shrink = next(e for e in events if e["kind"] == "resize" and e["world_size"] == 2)
    assert shrink["step"] == notice["step"]  # restarted from the notice's checkpoint: nothing redone


# Scenario stage (docs/testing.md): a node lost without notice stays in CI through per-step's
# tests (tests/test_replicas_ray.py, tests/test_hsdp_ray.py) and the real hosts' stage.
@pytest.mark.scenario
def test_workers_2_to_3_shrinks_on_node_loss_and_grows_back(tmp_path):
    summary, _ = _shrinks_and_grows_back(tmp_path, drain=False)
    assert summary["failures_recovered"] == 1  # the node loss; growing is not a failure


def _shrinks_and_grows_back(tmp_path, drain: bool):
    env = {**os.environ, "ELASTIC_STRATEGY": "fsdp", "ELASTIC_DRAIN": "1" if drain else "0"}
    done = subprocess.run(
        [sys.executable, str(SCENARIO), str(tmp_path)], capture_output=True, text=True, timeout=1200, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "timeout" not in result["observed"], result
    summary = result["summary"]
    assert summary["status"] == "finished"
    assert summary["world_sizes"] == [3, 2, 3]
    assert summary["samples_seen"] == 12 * 960  # every epoch complete, none repeated

    rows = [json.loads(line) for line in (tmp_path / "elastic" / "metrics.jsonl").read_text().splitlines()]
    assert {row["world_size"] for row in rows} == {2, 3}
    assert all(row["global_batch_size"] == 48 for row in rows)  # fixed global batch at every size
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # the curve continues, no replays
    for row in rows:  # the lr is the same function of samples seen at every size
        expected = schedule.LRSchedule("cosine", 3e-2, 1e-2, warmup_samples=960, total_samples=12 * 960).lr(
            row["samples_seen"]
        )
        assert row["lr"] == pytest.approx(expected, rel=1e-9)
    messages = result["events"]
    assert any(m.startswith("global 48 = 3 workers") and "fsdp over the root" in m for m in messages)
    assert any(m.startswith("Resized 3 → 2 workers") and m.endswith("unchanged") for m in messages)
    assert any(m.startswith("Resized 2 → 3 workers") and m.endswith("unchanged") for m in messages)
    return summary, [json.loads(line) for line in (tmp_path / "elastic" / "events.jsonl").read_text().splitlines()]


# Scenario stage (docs/testing.md): per-step recovery, a group out and healed, and a node lost and
# taken back stay in CI through tests/test_replicas_ray.py, tests/test_hsdp_ray.py and the test above.
@pytest.mark.scenario
def test_per_step_groups_a_group_without_room_waits_while_the_other_trains_then_rejoins(tmp_path):
    env = {**os.environ, "ELASTIC_GROUPS": "1", "ELASTIC_EPOCHS": "8"}
    done = subprocess.run(
        [sys.executable, str(SCENARIO), str(tmp_path)], capture_output=True, text=True, timeout=1200, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "timeout" not in result["observed"] and "error" not in result, result
    summary = result["summary"]
    assert summary["status"] == "finished"
    assert summary["world_sizes"] == [4, 2, 4]  # 2 groups, 1 while group 1 had no node, 2 again
    assert summary["failures_recovered"] == 1  # the node's loss; the group's return is none
    assert summary["samples_seen"] == 8 * 960

    records = tmp_path / "records"
    # Which group the removed node held is Ray's choice (ranks are ordered by node): that
    # group's two workers started again, once; the other group's never restarted.
    started = {rank: len(pids) for rank, pids in processes(records).items()}
    assert started in ({0: 1, 1: 1, 2: 2, 3: 2}, {0: 2, 1: 2, 2: 1, 3: 1}), started
    per_epoch = committed_ids(records)
    assert sorted(per_epoch) == list(range(8))
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(960)), f"epoch {epoch}: not every id exactly once"
    messages = result["events"]
    lost = next(m for m in messages if m.startswith("Quorum 4 → 2 workers (2 → 1 replica groups of 2)"))
    assert "a worker was lost, and its group with it; the other groups go on" in lost
    assert any(m.startswith("Quorum 2 → 4 workers (1 → 2 replica groups of 2)") for m in messages)
    assert not any(m.startswith(("Resized", "Restarted")) for m in messages)  # nobody restarted
