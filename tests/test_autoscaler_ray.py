"""An elastic run grows as Ray's autoscaler adds nodes (issue 7), on one machine.

The test starts a head of its own (tests/ray_head.py) with no CPUs and Ray's fake
multi-node autoscaler (`RAY_FAKE_CLUSTER=1`, provider `fake_multinode`,
tests/fake_cluster.yaml): every "node" it adds is a local raylet with 1 CPU, 1 at the start
(min_workers) and up to 3. `raytrain train --workers 1:3 --address HEAD` of digits (paced:
rt_test_pipelines:PacedDigitsPipeline) starts on the one node; the run asks Ray for 3 workers,
the autoscaler adds two nodes, and the run resizes to 3 workers and finishes there, every
epoch seen exactly once. The head, its autoscaler and
the raylets of the added nodes are then stopped, and nothing of them may be left; never
`ray stop`, which kills every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ray_head import BIN, running_head

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the head's processes through /proc"),
]

CONFIG = Path(__file__).with_name("fake_cluster.yaml")
WORKER_TYPE = "ray.worker.cpu"
# Ray grows the run some 15-45 s after its workers start: the nodes join within seconds, but
# Train's view of them refreshes every 20 s and raytrain checks for a bigger group every 15 s.
# The run must last longer than that at 1 worker. A pause per step (STEP_SLEEP_S) paces it,
# whatever the machine's speed: an epoch is 45 steps at 1 worker (≥ 18 s), 15 at 3. Once the
# test sees the resize to 3, it lifts the pause (the file `unpaced`): the rest goes at full
# speed. A checkpoint every CHECKPOINT_EVERY steps is where the run can resize.
EPOCHS = 5
CHECKPOINT_EVERY = 5
STEP_SLEEP_S = 0.4
PIPELINE = "rt_test_pipelines:PacedDigitsPipeline"
TESTS = Path(__file__).resolve().parent


def _train_rows() -> int:
    import numpy as np

    from pipelines.digits.pipeline import DATA_FILE, split

    with np.load(DATA_FILE) as data:
        return len(split(len(data["labels"]))[0])


def _worker_nodes(head) -> set[str] | None:
    """Ids of the alive nodes that have CPUs (the head has none), from the state API; None
    when the dashboard does not answer in time (a loaded machine)."""
    try:
        code, body = head.get("/api/v0/nodes?detail=false", head.token)
    except OSError:
        return None
    if code != 200:
        return None
    nodes = json.loads(body)["data"]["result"]["result"]
    return {n["node_id"] for n in nodes if n["state"] == "ALIVE" and n.get("resources_total", {}).get("CPU", 0) > 0}


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _autoscaler_events(head) -> list[str]:
    """The autoscaler's decisions ("Adding 1 node(s) of type ..."), from its log."""
    lines = []
    for log in {path.resolve() for path in Path(head.temp_dir).glob("session_*/logs/monitor.log")}:
        for line in log.read_text(errors="replace").splitlines():
            if ":event_summary:" in line:
                lines.append(f"{line[11:19]} {line.split(':event_summary:', 1)[1]}")
    return lines


def _tail(log) -> str:
    if not log.closed:
        log.flush()
    return Path(log.name).read_text()[-4000:]


def test_elastic_run_grows_as_the_autoscaler_adds_nodes(tmp_path):
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(CONFIG.read_text())
    validate_config(config)  # the schema; `ray up` would not take this provider anyway
    assert config["available_node_types"][WORKER_TYPE]["min_workers"] == 1
    assert config["available_node_types"][WORKER_TYPE]["max_workers"] == 3

    storage, name = tmp_path / "storage", "grow"
    run_dir = storage / name
    t0 = time.monotonic()

    def phase(what: str) -> None:
        print(f"{time.monotonic() - t0:6.1f} s  {what}")

    fake_cluster = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    with running_head(tmp_path, num_cpus=0, env=fake_cluster, autoscaling_config=config) as head:
        phase(f"head ready at {head.gcs_address}")
        # The run starts once the min_workers node is up. (Started earlier, it could find no
        # CPU at all, wait, and then start with every node the autoscaler has added meanwhile.)
        seen: dict[str, float] = {}  # worker node id -> when first seen alive
        deadline = time.monotonic() + 120
        while not seen:
            assert time.monotonic() < deadline, f"no worker node after 120 s: {_autoscaler_events(head)}"
            seen = dict.fromkeys(_worker_nodes(head) or (), time.monotonic())
            time.sleep(0.5)
        phase(f"worker node {min(seen)[-5:]} alive (min_workers)")
        log = open(tmp_path / "train.log", "w")
        unpaced = tmp_path / "unpaced"
        cmd = [
            str(BIN / "raytrain"),
            "train",
            PIPELINE,
            "--pipeline-arg",
            f"step_sleep_s={STEP_SLEEP_S}",
            "--pipeline-arg",
            f"pace_until={unpaced}",
            "--workers",
            "1:3",
            "--epochs",
            str(EPOCHS),
            "--checkpoint-every-steps",
            str(CHECKPOINT_EVERY),
            "--progress",
            "plain",
            "--address",
            head.gcs_address,
            "--storage",
            str(storage),
            "--name",
            name,
        ]
        # The driver joins the head as a client; it is not one of the head's processes. Its
        # workers import the pipeline from the driver's path (tests/ on it).
        pythonpath = os.pathsep.join([str(TESTS.parent), str(TESTS), head.cli_env.get("PYTHONPATH", "")])
        train = subprocess.Popen(
            cmd,
            env={**head.cli_env, "PYTHONPATH": pythonpath},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        most_alive, reported = len(seen), set()
        try:
            deadline = time.monotonic() + 480
            while train.poll() is None:
                assert time.monotonic() < deadline, f"raytrain still running after 480 s:\n{_tail(log)}"
                alive = _worker_nodes(head) or set()
                for node in sorted(alive - seen.keys()):
                    seen[node] = time.monotonic()
                    phase(f"worker node {node[-5:]} alive ({len(alive)} alive)")
                most_alive = max(most_alive, len(alive))
                for event in _events(run_dir):
                    key = (event["kind"], event.get("world_size"), event.get("step"))
                    if event["kind"] in ("plan", "resize", "done") and key not in reported:
                        reported.add(key)
                        phase(event["message"])
                    if event["kind"] == "resize" and event.get("world_size") == 3 and not unpaced.exists():
                        unpaced.touch()
                        phase("grown to 3: the pause per step lifted")
                time.sleep(1)
        finally:
            unpaced.touch()
            if train.poll() is None:
                train.kill()
            train.wait()
            log.close()
        phase(f"raytrain exited with {train.returncode}")
        assert train.returncode == 0, _tail(log)

        # The autoscaler's own view (what `ray status` prints): it added the nodes (one for
        # min_workers, two for the run), and they are still up (idle ones go after a minute).
        events = _autoscaler_events(head)
        for line in events:
            print(f"        autoscaler: {line}")
        added = [re.search(rf"Adding (\d+) node\(s\) of type {re.escape(WORKER_TYPE)}", line) for line in events]
        assert sum(int(m.group(1)) for m in added if m) >= 3, events
        code, body = head.get("/api/cluster_status?format=1", head.token)
        status = json.loads(body or b"{}").get("data", {}).get("clusterStatus") or ""
        active = re.search(rf"^\s*(\d+) {re.escape(WORKER_TYPE)}\s*$", status.split("Pending:", 1)[0], re.M)
        assert code == 200 and active and int(active.group(1)) >= 3, (code, status)
        # The head's raylet and one per added node: all of them must be gone after the stop.
        raylets = [cmd for cmd in head.processes().values() if "/raylet/raylet " in cmd]
        assert len(raylets) >= 4, raylets
        phase("checked the autoscaler's status")

    phase("head and its nodes stopped")
    # Three nodes alive at once, all of the fake provider (its node ids count up from the
    # head's ...00000). On a loaded machine there can be a fourth for a while: a node that
    # took over 30 s to register counts as a failed launch and is launched again, but the
    # late one still joins.
    assert most_alive >= 3 and all(node[:-5] == FAKE_HEAD_NODE_ID[:-5] for node in seen), seen
    summary = json.loads((run_dir / "summary.json").read_text())
    sizes = summary["world_sizes"]
    assert summary["status"] == "finished", summary
    assert summary["epochs"] == EPOCHS
    assert sizes[0] < 3 and sizes[-1] == 3 and sizes == sorted(sizes), summary
    assert summary["failures_recovered"] == 0  # growing is not a failure
    assert summary["samples_seen"] == EPOCHS * _train_rows()  # every epoch complete, none repeated

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    world = [row["world_size"] for row in rows]
    assert world == sorted(world) and world[0] < 3 and world[-1] == 3, world
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), steps  # the curve continues, no replays
    assert any(e["kind"] == "resize" and e["world_size"] == 3 for e in _events(run_dir))
