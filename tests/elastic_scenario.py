"""An elastic run on a simulated cluster: lose a node, then get one back.

Run as a script (its own Ray cluster, so not inside the shared test Ray):
    python tests/elastic_scenario.py OUT_DIR
By default 3 nodes of 1 CPU, --workers 2:3, restarting; ELASTIC_GROUPS=1: 2 nodes of 2 CPUs,
--workers 2:4, per-step recovery in replica groups of 2 (one group per node). ELASTIC_DRAIN=1:
the node is drained first (a preemption notice, reason PREEMPTION, a 30 s deadline), and removed
once the run has left it.
Writes OUT_DIR/result.json with the run's summary and what the driver observed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


DRAIN_DEADLINE_S = 30  # the notice a drain gives (ELASTIC_DRAIN=1)


def wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout_s} s for {what}")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main(out: Path) -> None:
    import os

    import ray
    from ray.cluster_utils import Cluster
    from rt_test_pipelines import RecordingPipeline, ReplicaRecordingPipeline, SlowDigitsPipeline

    import raytrain
    from raytrain.driver.session import free_port

    dashboard_port = free_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port,
        },
    )
    # ELASTIC_GROUPS=1: per-step recovery in replica groups of 2 (fsdp within each), one group
    # per node of 2 CPUs, --workers 2:4; otherwise one worker per node, --workers 2:3.
    groups = os.environ.get("ELASTIC_GROUPS") == "1"
    drain = os.environ.get("ELASTIC_DRAIN") == "1"  # a drain notice before the node goes
    node_cpus = 2 if groups else 1
    nodes = [cluster.add_node(num_cpus=node_cpus) for _ in range(2 if groups else 3)]
    pythonpath = os.pathsep.join(sys.path)
    ray.init(
        address=cluster.address,
        runtime_env={
            "env_vars": {"PYTHONPATH": pythonpath, "RAY_API_SERVER_ADDRESS": os.environ["RAY_API_SERVER_ADDRESS"]}
        },
        logging_level="ERROR",
    )
    records = out / "records"
    records.mkdir(parents=True, exist_ok=True)
    per_step = dict(fault_tolerance="per-step", replica_group_size=2) if groups else {}
    cfg = raytrain.TrainConfig(
        workers="2:4" if groups else "2:3",
        epochs=int(os.environ.get("ELASTIC_EPOCHS", "12")),
        global_batch_size=48,
        lr=float(os.environ.get("ELASTIC_LR", "1e-2")),
        warmup_epochs=1,
        checkpoint_every_steps=4,
        log_every_steps=1,
        max_failures=5,
        strategy="fsdp" if groups else os.environ.get("ELASTIC_STRATEGY", "ddp"),
        storage=str(out),
        name="elastic",
        **per_step,
    )
    small, full = (2, 4) if groups else (2, 3)
    # A restarting run resizes from a checkpoint; under per-step the survivors' quorum changes.
    resized = "quorum" if groups else "resize"
    run_dir = out / "elastic"
    # Steps are paced until the driver has seen both resizes; then the rest of the run goes
    # at full speed (the pauses only make room for the resizes, nothing after them needs one).
    # The pace bounds how long the resizes may take: 240 steps of at least 1 s, room for both
    # on a loaded machine, where each restarts a worker group.
    unpaced = out / "unpaced"
    observed: dict = {}
    result_box: dict = {}

    def train() -> None:
        try:
            if os.environ.get("ELASTIC_PIPELINE") == "digits":
                pipeline = SlowDigitsPipeline(step_sleep_s=1.0, pace_until=str(unpaced))
            else:  # under per-step, records that name each worker's process
                recording = ReplicaRecordingPipeline if groups else RecordingPipeline
                pipeline = recording(str(records), num_rows=960, step_sleep_s=1.0, pace_until=str(unpaced))
            result_box["summary"] = raytrain.fit(pipeline, cfg).summary
        except Exception as exc:  # reported in result.json
            result_box["error"] = repr(exc)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        observed["to_first_plan_s"] = wait_for(
            lambda: any(e["kind"] == "plan" for e in events(run_dir)), 240, "the first plan"
        )
        observed["first_world_size"] = next(e["world_size"] for e in events(run_dir) if e["kind"] == "plan")
        # The node goes once there is a checkpoint to resize from (a loss before it is a restart).
        wait_for(lambda: any(run_dir.glob("checkpoint_*")), 240, "the first checkpoint")
        removed_at = time.time()
        if drain:  # a preemption notice first: the run leaves the node at a step boundary
            drain_node = [str(Path(sys.executable).with_name("ray")), "drain-node", "--address", cluster.address]
            notice = subprocess.run(
                [*drain_node, "--node-id", nodes[-1].node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                 "--reason-message", "spot reclaim", "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            observed["drain"] = notice.stderr[-2000:] if notice.returncode else "accepted"
            wait_for(lambda: any(e["kind"] == "preempted" for e in events(run_dir)), 60, "the preemption notice")
            observed["notice_s"] = round(time.time() - removed_at, 1)
        else:
            cluster.remove_node(nodes[-1])
        observed["shrink_s"] = wait_for(
            lambda: any(e["kind"] == resized and e["world_size"] == small for e in events(run_dir)),
            240,
            f"the resize to {small}",
        )
        if drain:  # the node is taken (before its deadline: the run has left it)
            cluster.remove_node(nodes[-1])
        time.sleep(5)
        added_at = time.time()
        cluster.add_node(num_cpus=node_cpus)
        observed["grow_s"] = wait_for(
            lambda: any(e["kind"] == resized and e["world_size"] == full for e in events(run_dir)[1:]),
            240,
            f"the resize back to {full}",
        )
    except TimeoutError as exc:
        observed["timeout"] = str(exc)
    finally:
        unpaced.touch()
    thread.join(timeout=600)
    if "shrink_s" in observed:
        observed["recovery_s"] = _first_row_after(run_dir, removed_at, world_size=small)
    if "grow_s" in observed:
        observed["regrow_first_step_s"] = _first_row_after(run_dir, added_at, world_size=full)
    result = {"observed": observed, **result_box, "events": [e["message"] for e in events(run_dir)]}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    ray.shutdown()
    cluster.shutdown()


def _first_row_after(run_dir: Path, since: float, world_size: int) -> float | None:
    """Seconds from `since` to the first metrics row (one per step) at `world_size`."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    later = [row["time_s"] for row in rows if row["time_s"] > since and row["world_size"] == world_size]
    return round(min(later) - since, 1) if later else None


if __name__ == "__main__":
    main(Path(sys.argv[1]))
