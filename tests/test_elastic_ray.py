"""Elastic run on a simulated 3-node cluster (ray.cluster_utils.Cluster, its own Ray in a
subprocess): lose a node → continue at 2 workers; a node joins → grow back to 3. At every
size the global batch and the learning rate follow the rules. The run is sharded
(--strategy fsdp): every resize reshards its checkpoint for the new worker count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.rules import schedule

pytestmark = pytest.mark.ray
SCENARIO = Path(__file__).with_name("elastic_scenario.py")


def test_workers_2_to_3_shrinks_on_node_loss_and_grows_back(tmp_path):
    env = {**os.environ, "ELASTIC_STRATEGY": "fsdp"}
    done = subprocess.run(
        [sys.executable, str(SCENARIO), str(tmp_path)], capture_output=True, text=True, timeout=1200, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "timeout" not in result["observed"], result
    summary = result["summary"]
    assert summary["status"] == "finished"
    assert summary["world_sizes"] == [3, 2, 3]
    assert summary["failures_recovered"] == 1  # the node loss; growing is not a failure
    assert summary["samples_seen"] == 12 * 960  # every epoch complete, none repeated

    rows = [json.loads(line) for line in (tmp_path / "elastic" / "metrics.jsonl").read_text().splitlines()]
    assert {row["world_size"] for row in rows} == {2, 3}
    assert all(row["global_batch_size"] == 48 for row in rows)  # fixed global batch at every size
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # the curve continues, no replays
    for row in rows:  # the lr is the same function of samples seen at every size
        expected = schedule.lr_at(
            row["samples_seen"], base_lr=1e-2, peak_lr=3e-2, warmup_samples=960, total_samples=12 * 960
        )
        assert row["lr"] == pytest.approx(expected, rel=1e-9)
    messages = result["events"]
    assert any(m.startswith("global 48 = 3 workers") and "fsdp over the root" in m for m in messages)
    assert any(m.startswith("Resized 3 → 2 workers") and m.endswith("unchanged") for m in messages)
    assert any(m.startswith("Resized 2 → 3 workers") and m.endswith("unchanged") for m in messages)
