"""Per-step fault tolerance on CPU (`--fault-tolerance per-step`, torchft on gloo): a replica
killed mid-epoch; the survivors never restart, every id is trained once per epoch, the
replacement rejoins and the run's files say so."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from rt_test_pipelines import ReplicaRecordingPipeline, read_jsonl  # noqa: E402

from raytrain import TrainConfig, fit  # noqa: E402

pytestmark = pytest.mark.ray


def committed_ids(out: Path) -> dict[int, list[int]]:
    """The ids each epoch trained on in committed steps: per process and step the last record
    (a step that was not committed is taken again by the same process, with the same step)."""
    last: dict[tuple[int, int], dict] = {}
    for path in sorted(out.glob("ids-replica*.jsonl")):
        for row in read_jsonl(path):
            last[(row["pid"], row["step"])] = row
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for row in last.values():
        per_epoch[row["epoch"]].extend(row["ids"])
    return per_epoch


@pytest.mark.parametrize("data", ["memory", "stream"])
def test_a_killed_replica_is_replaced_while_the_survivors_keep_training(ray_session, tmp_path, data):
    """In memory every replica maps the same table; streamed, each reads the blocks it owns in
    the current quorum and re-opens its share when the quorum changes."""
    out = tmp_path / "out"
    out.mkdir()
    rows = 900
    cfg = TrainConfig(
        workers="3",
        epochs=3,
        batch_size_per_worker=10,
        lr=0.05,
        warmup_epochs=0,
        fault_tolerance="per-step",
        storage=str(tmp_path),
        name="ft",
        log_every_steps=4,
        checkpoint_every_steps=0,
        progress="off",
        shuffle_window_rows=0 if data == "memory" else 60,
        data_partitions=12,
    )
    pipeline = ReplicaRecordingPipeline(
        str(out),
        num_rows=rows,
        crash_at_step=6,
        step_sleep_s=0.3,
        kill_replica=1,
        num_blocks=None if data == "memory" else 24,
    )
    result = fit(pipeline, cfg)

    pids: dict[int, set[int]] = defaultdict(set)
    for path in out.glob("ids-replica*.jsonl"):
        for row in read_jsonl(path):
            pids[row["replica"]].add(row["pid"])
    killed = json.loads((out / "killed").read_text())
    assert len(pids[0]) == 1 and len(pids[2]) == 1, pids  # the survivors never restarted
    assert pids[1] - {killed["pid"]}, "the killed replica was replaced"
    for epoch, ids in committed_ids(out).items():
        assert sorted(ids) == list(range(rows)), f"epoch {epoch}: not every id exactly once"
    assert sorted(committed_ids(out)) == [0, 1, 2]

    run_dir = Path(result.run_dir)
    quorum = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "quorum"]
    assert [(e["previous_world_size"], e["world_size"]) for e in quorum][:2] == [(3, 2), (2, 3)], quorum
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["failures_recovered"] >= 1 and 2 in summary["world_sizes"]
    assert (run_dir / "model.pt").exists()
