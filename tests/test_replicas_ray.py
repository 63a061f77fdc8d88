"""Per-step fault tolerance on CPU (`--fault-tolerance per-step`, torchft on gloo): a replica
killed mid-epoch, two lost at once, one hung, replicas that start together; the survivors never
restart, every id is trained once per epoch, the replacements rejoin and the run's files say so."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from rt_test_pipelines import ReplicaRecordingPipeline, read_jsonl  # noqa: E402

from raytrain import fit  # noqa: E402
from raytrain.cli import main  # noqa: E402

pytestmark = pytest.mark.ray


def committed_ids(out: Path) -> dict[int, list[int]]:
    """The ids each epoch trained on in committed steps: per process and step the last record
    (a step that was not committed is taken again by the same process, with the same step), of
    the quorum that took the step last (a process taken out inside a step it never committed,
    with its group, left a record of that step's earlier quorum)."""
    last: dict[tuple[int, int], dict] = {}
    for path in sorted(out.glob("ids-replica*.jsonl")):
        for row in read_jsonl(path):
            last[(row["pid"], row["step"])] = row
    final: dict[tuple[int, int], dict] = {}  # (epoch, step): its latest record
    for row in last.values():
        key = (row["epoch"], row["step"])
        if key not in final or row["time"] > final[key]["time"]:
            final[key] = row
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for row in last.values():
        if row["world_size"] == final[(row["epoch"], row["step"])]["world_size"]:
            per_epoch[row["epoch"]].extend(row["ids"])
    return per_epoch


# Streamed, in the scenario stage (docs/testing.md): the memory case keeps the kill in CI, and the
# streamed rows of a changing quorum are tests/test_replicas.py's and tests/test_data.py's.
@pytest.mark.parametrize("data", ["memory", pytest.param("stream", marks=pytest.mark.scenario)])
def test_a_killed_replica_is_replaced_while_the_survivors_keep_training(ray_session, tmp_path, data, make_config):
    """In memory every replica maps the same table; streamed, each reads the blocks it owns in
    the current quorum and re-opens its share when the quorum changes."""
    out = tmp_path / "out"
    out.mkdir()
    rows = 900
    cfg = make_config(
        workers="3",
        epochs=3,
        batch_size_per_worker=10,
        lr=0.05,
        warmup_epochs=0,
        fault_tolerance="per-step",
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
    killed = json.loads((out / "killed-replica1").read_text())
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


# The failure patterns per-step recovery exists for, through the command line as a user runs
# it (exit status, event lines, summary.json). Small: 600 rows, 0.3 s steps, 2 epochs.
PIPELINE = "rt_test_pipelines:ReplicaFaultsPipeline"


def train(tmp_path: Path, name: str, workers: int, *pipeline_args: str, extra: tuple[str, ...] = ()) -> int:
    args = ["train", PIPELINE, "--workers", str(workers), "--epochs", "2", "--batch-size-per-worker", "10"]
    args += ["--lr", "0.05", "--warmup-epochs", "0", "--fault-tolerance", "per-step", "--max-failures", "3"]
    args += ["--log-every-steps", "4", "--progress", "off", "--storage", str(tmp_path), "--name", name]
    for value in (f"out_dir={tmp_path / 'out'}", *pipeline_args):
        args += ["--pipeline-arg", value]
    return main([*args, *extra])


def run_files(run_dir: Path) -> tuple[dict, list[dict]]:
    return json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "events.jsonl")


def processes(out: Path) -> dict[int, set[int]]:
    """The processes that trained as each replica (Ray Train rank)."""
    pids: dict[int, set[int]] = defaultdict(set)
    for path in out.glob("ids-replica*.jsonl"):
        for row in read_jsonl(path):
            pids[row["replica"]].add(row["pid"])
    return pids


def assert_every_id_once_per_epoch(out: Path, rows: int, epochs: int) -> None:
    per_epoch = committed_ids(out)
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(rows)), f"epoch {epoch}: not every id exactly once"


def test_two_replicas_lost_at_once_rank_0_among_them_are_replaced_while_the_third_trains_on(ray_session, tmp_path):
    """As on a lost node: replicas 0 and 2 die in the same step. Ray Train 2.60's controller
    failed this with a ControllerError (raytrain.faults.replacement); now the third trains on
    alone, both are replaced and rejoin, and nothing restarts from a checkpoint."""
    (tmp_path / "out").mkdir()
    code = train(tmp_path, "two", 3, "kill_at_step=6", "kill_replicas=0,2", extra=("--checkpoint-every-steps", "0"))
    assert code == 0

    out = tmp_path / "out"
    pids = processes(out)
    assert len(pids[1]) == 1, pids  # the survivor never restarted
    for replica in (0, 2):
        killed = json.loads((out / f"killed-replica{replica}").read_text())["pid"]
        assert pids[replica] - {killed}, f"replica {replica} was replaced"
    assert_every_id_once_per_epoch(out, 600, 2)

    summary, events = run_files(tmp_path / "two")
    quorum = [(e["previous_world_size"], e["world_size"]) for e in events if e["kind"] == "quorum"]
    assert quorum[0] == (3, 1) and quorum[-1][1] == 3, quorum  # both lost in one quorum, both back
    assert not [e for e in events if e["kind"] == "restore"], "nothing restarted from a checkpoint"
    assert summary["status"] == "finished" and summary["failures_recovered"] == 1
    assert summary["world_sizes"][:2] == [3, 1] and summary["world_sizes"][-1] == 3


# Scenario stage (docs/testing.md): a stalled rank named within the timeout is
# tests/test_faults_ray.py's in CI; the per-step stall watch and its grace, tests/test_replicas.py's.
@pytest.mark.scenario
def test_a_hung_replica_leaves_and_the_other_trains_on_within_the_timeout_and_its_grace(ray_session, tmp_path):
    """Two replicas, one stuck in a step (it still heartbeats). torchft's lighthouse forms no
    quorum of one out of two live replicas, so the survivor waits until the stuck one leaves:
    --collective-timeout-s, then the stuck one's grace (10 s at these step times); before, the
    survivor timed out first and both restarted from step 0."""
    timeout_s = 5
    (tmp_path / "out").mkdir()
    code = train(
        tmp_path,
        "hang",
        2,
        "hang_at_step=6",
        "hang_replica=1",
        extra=("--collective-timeout-s", str(timeout_s), "--checkpoint-every-steps", "0"),
    )
    assert code == 0

    out = tmp_path / "out"
    pids = processes(out)
    assert len(pids[0]) == 1, pids  # the survivor never restarted
    hung = json.loads((out / "hung-replica1").read_text())["pid"]
    assert pids[1] - {hung}, "the hung replica was replaced"
    assert_every_id_once_per_epoch(out, 600, 2)
    survivor = sorted(read_jsonl(out / "ids-replica0.jsonl"), key=lambda row: row["time"])
    longest_wait_s = max(b["time"] - a["time"] for a, b in zip(survivor, survivor[1:]))
    assert longest_wait_s < timeout_s + 30, longest_wait_s  # docs/fault-tolerance.md's promise

    summary, events = run_files(tmp_path / "hang")
    stall = [e for e in events if e["kind"] == "stall"]
    assert len(stall) == 1 and stall[0]["replica"] == 1 and stall[0]["step"] == 6, stall
    assert "the others go on" in stall[0]["message"]
    quorum = [(e["previous_world_size"], e["world_size"]) for e in events if e["kind"] == "quorum"]
    assert quorum == [(2, 1), (1, 2)], quorum
    assert not [e for e in events if e["kind"] == "restore"], "nothing restarted from a checkpoint"
    assert summary["status"] == "finished" and summary["failures_recovered"] == 1
    assert summary["world_sizes"] == [2, 1, 2]


def test_replicas_starting_together_wait_for_each_other_on_a_fresh_start_and_on_a_resume(ray_session, tmp_path):
    """Replica 1 builds 6 s slower (a slow restore). Before, replica 0 started alone and trained
    steps at half the global batch, and a resume listed world sizes [2, 1, 2]. Now both wait
    until every replica is restored: each step of both invocations has both replicas."""
    (tmp_path / "out").mkdir()
    slow = ("build_sleep_s=6", "slow_replica=1", "num_rows=200", "step_sleep_s=0")
    assert train(tmp_path, "together", 2, *slow, extra=("--epochs", "1", "--checkpoint-every-steps", "4")) == 0
    first, _ = run_files(tmp_path / "together")
    resumed = main(["train", "--resume", "--name", "together", "--storage", str(tmp_path), "--epochs", "2"])
    assert resumed == 0

    summary, events = run_files(tmp_path / "together")
    assert first["world_sizes"] == [2] and summary["world_sizes"] == [2]
    assert not [e for e in events if e["kind"] == "quorum"], "no replica trained alone"
    records = [row for path in (tmp_path / "out").glob("ids-replica*.jsonl") for row in read_jsonl(path)]
    assert {row["world_size"] for row in records} == {2}
    assert_every_id_once_per_epoch(tmp_path / "out", 200, 2)
    assert summary["status"] == "finished" and summary["epochs"] == 2
