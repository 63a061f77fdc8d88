"""Faults on real hosts: a row per fault × mode.

Two hosts made on this machine (`tests/hosts.py`: a network stack each, interfaces `ens5` and
`eth1`, the hostname on 127.0.1.1, nothing set by hand), two CPUs each; the second host's node
supervised (started again whenever it exits, as systemd's `Restart=always`). An elastic run,
`--workers 2:4`, paced at `--step-s` a step, has one worker on every CPU. Once it has a
checkpoint and trains at 4, the second host meets its fault:

- `partition`: its link down for `--down-s`, then up;
- `frozen`: every process of it stopped for `--down-s`, then continued;
- `lost`: every process of it killed; after `--down-s` it boots again;
- `drain`: a preemption notice first, Ray's drain of its node (reason PREEMPTION, a
  `--notice-s` deadline, as autoscaler v2 or a KubeRay `preStop` hook asks it); at the deadline
  every process of it killed; after `--down-s` it boots again (a new node);
- `sigterm`: the notice as Kubernetes gives it, SIGTERM to one of its training workers (its
  grace `--notice-s`); at the end of the grace every process of it killed, then as `drain`;
- `slow`: its training workers stopped 3/4 of every 0.2 s (SIGSTOP, SIGCONT), as on a slow or
  overloaded host, for `--down-s` or until the run evicts it. With `--evict-stragglers` the run
  has `--evict-stragglers --straggler-steps 5 --straggler-evict-steps 10`; the row adds the
  `straggler` event's host and ratio (`straggler`), seconds from the slowness to it
  (`named_s`) and to the run training without the host (`evicted_s`), and the sizes say
  whether the host came back (it must not).

Each row says: the exit status; the worker counts the run trained with; seconds from the fault
to training again on the host left (`again_s`: the first step recorded after the fault by a
run that had seen the fault: at 2 workers, or per-step a step past the one in flight); the
longest pause between two steps around the fault (`pause_s`, what the survivors waited); the
step indices the fault's restarts took again (`steps_again`; restart mode, from the ids each step
recorded; a growth's restart after the fault's end is not counted); seconds
from the fault's end to training at 4 again (`back_s`); and whether every id was trained exactly
once in every epoch (`exactly_once`), from the ids each step recorded, with the steps a restart
took again counted once.

    python benchmarks/real_hosts.py OUT [--faults partition,frozen,lost,drain,sigterm]
        [--modes restart,per-step,per-step-groups]
        [--ray-defaults]   # the cluster's health checks as Ray's defaults, not raytrain's
        [--evict-stragglers]   # with --faults slow

Needs root (network namespaces); one case takes 2–4 minutes on 2 cores. Writes OUT/rows.json
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from hosts import made_hosts, skip_reason  # noqa: E402
from rt_test_pipelines import read_jsonl  # noqa: E402

ROWS = 960
GLOBAL_BATCH = 48  # 20 steps an epoch


def driver(
    out: Path, mode: str, address: str, epochs: int, step_s: float, timeout_s: float | None, evict: bool = False
) -> int:
    """`mode`: restart, per-step, or per-step-groups (replica groups of 2 workers, fsdp within
    each: HSDP)."""
    from rt_test_pipelines import RecordingPipeline, ReplicaRecordingPipeline

    import raytrain

    records = out / "records"
    records.mkdir(parents=True, exist_ok=True)
    pace = dict(step_sleep_s=step_s, pace_until=str(out / "unpaced"))
    groups = {"replica_group_size": 2, "strategy": "fsdp"} if mode == "per-step-groups" else {}
    mode = "per-step" if groups else mode
    if mode == "per-step":
        pipeline = ReplicaRecordingPipeline(str(records), num_rows=ROWS, crash_at_step=None, **pace)
    else:
        pipeline = RecordingPipeline(str(records), num_rows=ROWS, **pace)
    cfg = raytrain.TrainConfig(
        workers="2:4",
        epochs=epochs,
        global_batch_size=GLOBAL_BATCH,
        lr=0.05,
        warmup_epochs=0,
        checkpoint_every_steps=4,
        log_every_steps=1,
        max_failures=5,
        fault_tolerance=mode,
        storage=str(out),
        name="run",
        address=address,
        progress="off",
        **({"collective_timeout_s": timeout_s} if timeout_s else {}),
        **({"evict_stragglers": True, "straggler_steps": 5, "straggler_evict_steps": 10} if evict else {}),
        **groups,
    )
    try:
        raytrain.fit(pipeline, cfg)
    except Exception as exc:  # noqa: BLE001 - the row says how it ended
        print(f"the run failed: {exc!r}", flush=True)
        return 1
    return 0


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [row for row in read_jsonl(path) if "step" in row and "time_s" in row] if path.exists() else []


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


def trained_ids(records: Path) -> tuple[dict[int, list[int]], list[tuple[float, int]] | None]:
    """The ids each epoch trained, a step taken again counted once: its last taking. Restart
    mode takes again the steps after the checkpoint it resumed from (what came after a step's
    first taking is void); per-step takes again a step that was not committed, in the same
    processes (`tests/test_replicas_ray.committed_ids`). Also, restart mode, each attempt's start
    and the step indices it took again (None per-step)."""
    rows = sorted((row for path in records.glob("ids-*.jsonl") for row in read_jsonl(path)), key=lambda r: r["time"])
    if rows and "pid" in rows[0]:
        from test_replicas_ray import committed_ids

        return committed_ids(records), None
    # The records in attempts: a new one starts at a step already taken (a smaller step, or
    # the same step again by a rank that took it, or at another size). Within an attempt
    # every rank records step s before any records s + 1 (the step's all-reduce is between).
    attempts: list[list[dict]] = [[]]
    top, ranks, size = -1, set(), None
    for row in rows:
        again = row["step"] < top or (row["step"] == top and (row["rank"] in ranks or row["world_size"] != size))
        if again and attempts[-1]:
            attempts.append([])
            top, ranks = -1, set()
        attempts[-1].append(row)
        if row["step"] > top:
            top, ranks, size = row["step"], set(), row["world_size"]
        ranks.add(row["rank"])
    taken: list[dict] = []
    again: list[tuple[float, int]] = []
    for attempt in attempts:  # each voids what earlier ones took from its first step on
        first = min((row["step"] for row in attempt), default=0)
        again.append((attempt[0]["time"], len({row["step"] for row in taken if row["step"] >= first})))
        taken = [row for row in taken if row["step"] < first] + attempt
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for row in taken:
        per_epoch[row["epoch"]].extend(row["ids"])
    return per_epoch, again


def train_worker_pids(host) -> list[int]:
    """The host's Ray Train workers."""
    pids = []
    for pid in host.pids():
        try:
            if b"RayTrainWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in read_jsonl(path) if e.get("kind") == kind] if path.exists() else []


def slowed(host, run_dir: Path, down_s: float) -> tuple[float, float]:
    """The host's training workers stopped 3/4 of every 0.2 s for `down_s`, or until the run
    evicts it; returns when the slowness began and ended."""
    import contextlib

    with contextlib.ExitStack() as stack:
        for pid in train_worker_pids(host):
            stack.enter_context(host.slow(pid, duty=0.25, period_s=0.2))
        began = time.time()
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: events(run_dir, "evicted"), down_s, "an eviction")
    return began, time.time()


def noticed(host, head_address: str, fault: str, notice_s: float) -> float:
    """A preemption notice for `host`: its node drained (reason PREEMPTION, `notice_s` deadline), or
    SIGTERM to one of its training workers (grace `notice_s`); returns when it was given."""
    import signal

    at = time.time()
    if fault == "sigterm":
        os.kill(train_worker_pids(host)[0], signal.SIGTERM)
        return at
    find = (
        "import ray; ray.init(address=%r, logging_level='ERROR'); "
        "print(next(n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] == %r))"
    )
    found = host.run([sys.executable, "-c", find % (head_address, host.address)], timeout=120)
    if found.returncode:
        raise RuntimeError(f"the host's node id: {found.stderr[-2000:]}")
    at = time.time()
    drained = host.run(
        [str(Path(sys.executable).with_name("ray")), "drain-node", "--address", head_address,
         "--node-id", found.stdout.split()[-1], "--reason", "DRAIN_NODE_REASON_PREEMPTION",
         "--reason-message", "spot reclaim", "--deadline-remaining-seconds", str(int(notice_s))],
        timeout=60,
    )  # fmt: skip
    if drained.returncode:
        raise RuntimeError(f"ray drain-node failed: {drained.stderr[-2000:]}")
    return at


def slow_figures(run_dir: Path, began: float) -> dict:
    """The straggler named (its host and ratio), and how long after the slowness began it was
    named and the run trained without the host."""
    with_host = [m for m in metrics(run_dir) if m["time_s"] > began]
    named, evicted = events(run_dir, "straggler"), events(run_dir, "evicted")
    row: dict = {"straggler": None, "named_s": None, "evicted_s": None}
    if named:
        row["straggler"] = f"rank {named[0]['rank']} on {named[0]['host']}, {named[0]['step_ratio']:.1f}×"
        row["named_s"] = round(named[0]["time"] - began, 1)
    if evicted:
        after = [m for m in with_host if m["time_s"] > evicted[0]["time"] and m["world_size"] < 4]
        row["evicted_s"] = round(after[0]["time_s"] - began, 1) if after else None
        row["evicted_host"] = evicted[0]["host"]
    return row


def case(out: Path, fault: str, mode: str, args: argparse.Namespace) -> dict:
    from raytrain.driver.session import NODE_HEALTH_CONFIG

    out.mkdir(parents=True, exist_ok=True)
    row: dict = {"fault": fault, "mode": mode}
    with made_hosts(out, 2) as hosts:
        hosts.env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), hosts.env["PYTHONPATH"]])
        hosts.start_ray(num_cpus=2, supervised=True, system_config=None if args.ray_defaults else NODE_HEALTH_CONFIG)
        command = [sys.executable, __file__, "--driver", str(out), mode, hosts.head_address, str(args.epochs)]
        command += ["--step-s", str(args.step_s)]
        command += ["--collective-timeout-s", str(args.collective_timeout_s)] if args.collective_timeout_s else []
        command += ["--evict"] if getattr(args, "evict_stragglers", False) else []
        run = hosts[0].popen(command, log=out / "driver.log")
        run_dir = out / "run"
        try:
            wait_for(
                lambda: any(run_dir.glob("checkpoint_*")) and any(m["world_size"] == 4 for m in metrics(run_dir)),
                300,
                "a checkpoint and a step at 4 workers",
            )
            time.sleep(2 * args.step_s)
            victim = hosts[1]
            if fault == "slow":
                fault_at, ended_at = slowed(victim, run_dir, args.down_s)
            elif fault in ("drain", "sigterm"):
                fault_at = noticed(victim, hosts.head_address, fault, args.notice_s)
                time.sleep(args.notice_s)
                victim.lose()  # taken at the deadline
                time.sleep(args.down_s)
                ended_at = victim.boot()
            else:
                start, end = {"partition": (victim.cut, victim.heal), "frozen": (victim.freeze, victim.thaw)}.get(
                    fault, (victim.lose, victim.boot)
                )
                fault_at = start()
                time.sleep(args.down_s)
                ended_at = end()
            try:
                if not events(run_dir, "evicted"):  # an evicted host is never taken back
                    wait_for(
                        lambda: any(m["time_s"] > ended_at and m["world_size"] == 4 for m in metrics(run_dir)),
                        args.back_wait_s,
                        "training at 4 again",
                    )
            except TimeoutError as exc:
                row["note"] = str(exc)
        except TimeoutError as exc:
            row["note"] = str(exc)
            fault_at = ended_at = None
        finally:
            (out / "unpaced").touch()
        try:
            row["exit"] = run.wait(timeout=600)
        except subprocess.TimeoutExpired:
            run.kill()
            row["exit"] = "hung"
        row["node_starts"] = len(hosts[1].starts)
        for i, host in enumerate(hosts.hosts):  # the nodes' logs, before their temp dirs go
            logs = Path(host.temp_dir) / "session_latest" / "logs"
            shutil.copytree(logs, out / f"logs-{i}", dirs_exist_ok=True, ignore_dangling_symlinks=True)
    row["fault_at"], row["ended_at"] = fault_at, ended_at
    if fault == "slow" and fault_at is not None:
        row.update(slow_figures(run_dir, fault_at))
    steps = metrics(run_dir)
    sizes: list[int] = []
    for m in steps:
        if not sizes or sizes[-1] != m["world_size"]:
            sizes.append(m["world_size"])
    row["sizes"] = "→".join(map(str, sizes))
    if fault_at is not None:
        before = [m for m in steps if m["time_s"] <= fault_at]
        last_step = before[-1]["step"] if before else 0
        after = [m for m in steps if m["time_s"] > fault_at]
        again = [m for m in after if (m["world_size"] < 4 if mode == "restart" else m["step"] > last_step + 1)]
        row["again_s"] = round(again[0]["time_s"] - fault_at, 1) if again else None
        times = [m["time_s"] for m in steps if fault_at - 30 < m["time_s"] < (again[0]["time_s"] + 1 if again else 0)]
        row["pause_s"] = round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 1)
        back = [m for m in steps if m["time_s"] > ended_at and m["world_size"] == 4]
        row["back_s"] = round(back[0]["time_s"] - ended_at, 1) if back else None
    per_epoch, attempts = trained_ids(out / "records")
    if attempts is not None and fault_at is not None:  # the fault's restarts, not a growth's after it
        row["steps_again"] = sum(n for started, n in attempts if fault_at <= started <= ended_at)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    complete = sorted(per_epoch)[: summary.get("epochs", len(per_epoch))]
    row["exactly_once"] = bool(complete) and all(sorted(per_epoch[e]) == list(range(ROWS)) for e in complete)
    row["status"] = summary.get("status")
    return row


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--driver":
        parser = argparse.ArgumentParser(prog="real_hosts.py --driver")
        parser.add_argument("out", type=Path)
        parser.add_argument("mode")
        parser.add_argument("address")
        parser.add_argument("epochs", type=int)
        parser.add_argument("--step-s", type=float, default=0.5)
        parser.add_argument("--collective-timeout-s", type=float)
        parser.add_argument("--evict", action="store_true")
        a = parser.parse_args(sys.argv[2:])
        return driver(a.out, a.mode, a.address, a.epochs, a.step_s, a.collective_timeout_s, a.evict)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--faults", default="partition,frozen,lost")
    parser.add_argument("--modes", default="restart,per-step", help="restart, per-step, per-step-groups (HSDP)")
    parser.add_argument("--down-s", type=float, default=60.0, help="how long the fault lasts")
    parser.add_argument("--notice-s", type=float, default=30.0, help="drain, sigterm: the notice's deadline")
    parser.add_argument("--step-s", type=float, default=0.5, help="each step's pace until the run is back at 4")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--back-wait-s", type=float, default=180.0, help="the longest wait for 4 workers again")
    parser.add_argument("--collective-timeout-s", type=float, help="the run's --collective-timeout-s")
    parser.add_argument("--ray-defaults", action="store_true", help="Ray's own node health checks")
    parser.add_argument("--evict-stragglers", action="store_true", help="with --faults slow: the run evicts it")
    args = parser.parse_args()
    if skip_reason():
        print(f"cannot make hosts here: {skip_reason()}", file=sys.stderr)
        return 2
    rows = []
    for mode in args.modes.split(","):
        for fault in args.faults.split(","):
            started = time.monotonic()
            row = case(args.out / f"{mode}-{fault}", fault, mode, args)
            row["case_s"] = round(time.monotonic() - started)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "rows.json").write_text(json.dumps(rows, indent=2))
    keys = ["fault", "mode", "exit", "sizes", "again_s", "pause_s", "back_s", "steps_again", "exactly_once"]
    keys += ["node_starts", "case_s"]
    if "slow" in args.faults:
        keys[4:7] = ["straggler", "named_s", "evicted_s"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
