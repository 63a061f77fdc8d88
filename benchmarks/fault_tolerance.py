"""restart vs per-step fault tolerance on the same run: digits on 3 CPU workers, a fixed global
batch (the same steps whatever the worker count), replica 1 `os._exit`-ed mid-epoch 1.

    python benchmarks/fault_tolerance.py OUT_DIR [--seeds 0,1,2] [--epochs 6] [--kill-step 8]

Per mode: the time replica 0 loses (its training span minus its steps at the run's median
pace, beside the same for the run without a failure), its longest wait between two steps
after the failure, the time until the failed replica is training again, the steps trained
twice, and the final validation loss against runs without a failure over several seeds.

    python benchmarks/fault_tolerance.py OUT_DIR --analyze   # the table again, from OUT_DIR

Per-step recovery under the failure patterns it exists for, each in one per-step run (two
replicas lost in the same step, rank 0 lost, one replica hung with 3 and with 2 replicas,
`--collective-timeout-s 5`): what a surviving replica waits, whether any survivor restarted,
when the lost replicas are back, the run's world sizes and failures.

    python benchmarks/fault_tolerance.py OUT_DIR --patterns [--analyze]

The same failure for a sharded model: fsdp on 4 workers, restart against per-step with 2
replica groups of 2 (`--replica-group-size 2`), worker 1 killed (its group is taken out, the
other trains on), each beside its run without a failure; and the model state a worker holds
against a DDP worker's over the group size.

    python benchmarks/fault_tolerance.py OUT_DIR --sharded [--analyze]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
from ft_pipelines import KilledDigits  # noqa: E402

from raytrain import TrainConfig, fit  # noqa: E402
from raytrain.observe.render import markdown_table  # noqa: E402
from raytrain.rundir import Kind, RunDir  # noqa: E402


def run(out: Path, mode: str, seed: int, kill_step: int | None, args, sharded: bool = False) -> dict:
    """One run of `mode`; `sharded`: fsdp on 4 workers, per-step as 2 replica groups of 2."""
    name = ("sharded-" if sharded else "") + f"{mode}-s{seed}" + ("-kill" if kill_step is not None else "")
    records = out / name / "records"
    records.mkdir(parents=True, exist_ok=True)
    layout = {"workers": "4", "strategy": "fsdp"} if sharded else {"workers": "3"}
    if sharded and mode == "per-step":
        layout["replica_group_size"] = 2
    cfg = TrainConfig(
        **layout,
        epochs=args.epochs,
        global_batch_size=96,
        lr=2e-3,
        warmup_epochs=1,
        seed=seed,
        fault_tolerance=mode,
        checkpoint_every_steps=args.checkpoint_every_steps,
        storage=str(out),
        name=name,
        progress="off",
    )
    started = time.time()
    result = fit(KilledDigits(str(records), kill_step=kill_step, step_sleep_s=args.step_sleep_s), cfg)
    print(f"{name}: {time.time() - started:.0f} s, val_loss {result.metrics['val_loss']:.4f}", flush=True)
    return {
        "name": name,
        "mode": mode,
        "seed": seed,
        "killed": kill_step is not None,
        "run_dir": result.run_dir,
        "records": str(records),
        "val_loss": result.metrics["val_loss"],
    }


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def lost_s(rows: list[dict]) -> float:
    """A replica's training span minus the steady time for its steps: (distinct steps − 1) ×
    the median time from one step to the next, in the same run (a loaded machine's pace)."""
    rows = sorted(rows, key=lambda r: r["time"])
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    steps = len({r["step"] for r in rows})
    return rows[-1]["time"] - rows[0]["time"] - (steps - 1) * statistics.median(gaps)


def stall_s(rows: list[dict], at: float) -> float:
    """The longest wait between two steps of a replica from the failure on, beyond its median."""
    rows = sorted(rows, key=lambda r: r["time"])
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    after = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if b["time"] >= at]
    return max(after, default=0.0) - statistics.median(gaps)


def measure(killed: dict, clean: dict, watched: int = 0, survivor_replicas: tuple[int, ...] = (0, 2)) -> dict:
    """The failure's cost to replica `watched` (a survivor), against the run without it."""
    records, run_dir = Path(killed["records"]), RunDir(killed["run_dir"])
    kill = json.loads((records / "killed-replica1").read_text())
    watched_rows = rows_of(records / f"steps-replica{watched}.jsonl")
    replica1 = [r for r in rows_of(records / "steps-replica1.jsonl") if r["pid"] != kill["pid"]]
    back = min((r["time"] for r in replica1), default=float("nan"))
    if killed["mode"] == "per-step":  # back in the quorum: the line saying it grew
        rejoined = [
            e.time
            for e in run_dir.events()
            if e.kind == Kind.QUORUM and e.extra.get("world_size", 0) > e.extra.get("previous_world_size", 0)
        ]
        back = min(rejoined, default=back)
    survivors = [r for i in survivor_replicas for r in rows_of(records / f"steps-replica{i}.jsonl")]
    counts = Counter(r["step"] for r in watched_rows)
    return {
        "mode": killed["mode"],
        "lost_s": lost_s(watched_rows),
        "clean_lost_s": lost_s(rows_of(Path(clean["records"]) / f"steps-replica{watched}.jsonl")),
        "stall_s": stall_s(watched_rows, kill["time"]),
        "back_s": back - kill["time"],
        "redone": sum(1 for n in counts.values() if n > 1),  # steps the watched replica trained more than once
        "survivors_restarted": len({r["pid"] for r in survivors}) > len(survivor_replicas),
        "val_loss": killed["val_loss"],
        "memory": next((e.extra for e in run_dir.events() if e.kind == Kind.MEMORY), {}),
    }


def cost_row(label: str, t: dict) -> list:
    """One row of the cost table from `measure`'s figures."""
    return [
        label,
        f"{t['lost_s']:.1f} / {t['clean_lost_s']:.1f}",
        f"{t['stall_s']:.1f}",
        f"{t['back_s']:.1f}",
        t["redone"],
        "yes" if t["survivors_restarted"] else "no",
        f"{t['val_loss']:.4f}",
    ]


def ddp_state_bytes() -> int:
    """The model state a DDP worker of digits holds (parameters, gradients, AdamW's moments),
    after one step in this process: the reference for a sharded worker's."""
    import torch
    import torch.nn.functional as F

    from raytrain.parallel.strategy import state_bytes

    model = KilledDigits("").build_model(None)
    optimizer = torch.optim.AdamW(model.parameters())
    F.cross_entropy(model(torch.zeros(2, 1, 8, 8)), torch.zeros(2, dtype=torch.long)).backward()
    optimizer.step()
    return sum(state_bytes(model, optimizer).values())


def sharded(args) -> int:
    """fsdp on 4 workers: restart against per-step with 2 replica groups of 2 (worker 1, of
    group 0, killed; group 1 survives: replica 2 watched), each beside its run without a
    failure; and the model state a worker holds against a DDP worker's over the group size."""
    runs = saved_or_run(
        args.out / "sharded.json",
        args.analyze,
        lambda: {
            f"{mode}{suffix}": run(args.out, mode, 0, step, args, sharded=True)
            for mode in ("restart", "per-step")
            for suffix, step in (("", None), ("-kill", args.kill_step))
        },
    )
    table = [measure(runs[f"{m}-kill"], runs[m], watched=2, survivor_replicas=(2, 3)) for m in ("restart", "per-step")]
    header = ["fsdp, 4 workers", "replica 2 beyond its steady pace (s): with the failure / without"]
    header += ["its longest wait (s)", "lost worker back after (s)", "steps trained twice", "survivors restarted"]
    header += ["final val_loss"]
    rows = [cost_row("restart" if t["mode"] == "restart" else "per-step, 2 groups of 2", t) for t in table]
    print("\n".join(markdown_table(header, rows, align="right")))
    ddp = ddp_state_bytes()
    for t in table:
        held = max(sum(t["memory"].get(k, [0])[i] for k in ("parameters", "gradients", "optimizer")) for i in (0, 1))
        share = 2 if t["mode"] == "per-step" else 4
        print(
            f"{t['mode']}: a worker holds {held:,} B of model state; a DDP worker {ddp:,} B; "
            f"held / (DDP / {share}) = {held / (ddp / share):.3f}"
        )
    return 0


# name: (workers, replicas killed at the fault step, replica hung at it)
PATTERNS = {
    "one lost": (3, (1,), None),
    "two lost at once": (3, (1, 2), None),
    "rank 0 lost": (3, (0,), None),
    "one hung, 3 replicas": (3, (), 1),
    "one hung, 2 replicas": (2, (), 1),
}
PATTERN_TIMEOUT_S = 5


def run_pattern(out: Path, name: str, args) -> dict:
    workers, killed, hung = PATTERNS[name]
    slug = name.replace(" ", "-").replace(",", "")
    records = out / slug / "records"
    records.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(
        workers=str(workers),
        epochs=args.epochs,
        global_batch_size=96,
        lr=2e-3,
        warmup_epochs=1,
        fault_tolerance="per-step",
        collective_timeout_s=PATTERN_TIMEOUT_S,
        checkpoint_every_steps=args.checkpoint_every_steps,
        storage=str(out),
        name=slug,
        progress="off",
    )
    pipeline = KilledDigits(
        str(records),
        kill_step=args.kill_step if killed else None,
        kill_replicas=killed,
        step_sleep_s=args.step_sleep_s,
        hang_step=args.kill_step if hung is not None else None,
        hang_replica=hung if hung is not None else -1,
    )
    started = time.time()
    result = fit(pipeline, cfg)
    print(f"{name}: {time.time() - started:.0f} s, status {result.summary['status']}", flush=True)
    return {
        "name": name,
        "workers": workers,
        "lost": [*killed, *([hung] if hung is not None else [])],
        "run_dir": result.run_dir,
        "records": str(records),
        "summary": result.summary,
    }


def measure_pattern(run: dict) -> dict:
    records, run_dir = Path(run["records"]), RunDir(run["run_dir"])
    faults = [json.loads(path.read_text()) for path in records.glob("*-replica*") if path.suffix != ".jsonl"]
    at = min(fault["time"] for fault in faults)
    survivors = [i for i in range(run["workers"]) if i not in run["lost"]]
    rows = {i: rows_of(records / f"steps-replica{i}.jsonl") for i in range(run["workers"])}
    regrown = [
        e.time
        for e in run_dir.events()
        if e.kind == Kind.QUORUM and e.extra.get("world_size") == run["workers"] and e.time > at
    ]
    return {
        "name": run["name"],
        "stall_s": max(stall_s(rows[i], at) for i in survivors),
        "survivors_restarted": any(len({r["pid"] for r in rows[i]}) > 1 for i in survivors),
        "back_s": (min(regrown) - at) if regrown else float("nan"),
        "world_sizes": run["summary"]["world_sizes"],
        "failures_recovered": run["summary"]["failures_recovered"],
        "status": run["summary"]["status"],
    }


def saved_or_run(path: Path, analyze: bool, make):
    """The runs saved at `path` (--analyze), else `make()`'s on a local Ray, saved there."""
    if analyze:
        return json.loads(path.read_text())
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        runs = make()
    finally:
        ray.shutdown()
    path.write_text(json.dumps(runs, indent=2) + "\n")
    return runs


def patterns(args) -> int:
    runs = saved_or_run(
        args.out / "patterns.json", args.analyze, lambda: [run_pattern(args.out, name, args) for name in PATTERNS]
    )
    table = [measure_pattern(run) for run in runs]
    header = ["pattern", "a survivor's longest wait (s)", "survivors restarted", "all back after (s)"]
    header += ["world sizes", "failures recovered", "status"]
    rows = [
        [
            t["name"],
            f"{t['stall_s']:.1f}",
            "yes" if t["survivors_restarted"] else "no",
            f"{t['back_s']:.1f}",
            " → ".join(map(str, t["world_sizes"])),
            t["failures_recovered"],
            t["status"],
        ]
        for t in table
    ]
    print("\n".join(markdown_table(header, rows, align="right")))
    print(
        "\na survivor's longest wait: its longest time between two steps from the fault on, beyond its median; "
        f"--collective-timeout-s {PATTERN_TIMEOUT_S}; all back after: from the fault until the quorum is whole again"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--kill-step", type=int, default=8)
    parser.add_argument("--checkpoint-every-steps", type=int, default=10)
    parser.add_argument("--step-sleep-s", type=float, default=0.2)
    parser.add_argument("--analyze", action="store_true", help="no runs: the table from OUT_DIR/fault_tolerance.json")
    parser.add_argument("--patterns", action="store_true", help="per-step only: the failure patterns (PATTERNS)")
    parser.add_argument("--sharded", action="store_true", help="fsdp: restart against per-step replica groups")
    args = parser.parse_args()
    if args.patterns:
        return patterns(args)
    if args.sharded:
        return sharded(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.analyze:
        saved = json.loads((args.out / "fault_tolerance.json").read_text())
        clean, killed = saved["clean"], saved["killed"]
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
        try:
            clean = {
                mode: [run(args.out, mode, seed, None, args) for seed in seeds] for mode in ("restart", "per-step")
            }
            killed = {mode: run(args.out, mode, seeds[0], args.kill_step, args) for mode in ("restart", "per-step")}
        finally:
            ray.shutdown()
    losses = [r["val_loss"] for runs in clean.values() for r in runs]
    table = [measure(killed[mode], clean[mode][0]) for mode in ("restart", "per-step")]
    print(
        "\n".join(
            markdown_table(
                [
                    "mode",
                    "replica 0 beyond its steady pace (s): with the failure / without",
                    "its longest wait (s)",
                    "failed replica back after (s)",
                    "steps trained twice",
                    "survivors restarted",
                    "final val_loss",
                ],
                [cost_row(t["mode"], t) for t in table],
                align="right",
            )
        )
    )
    print(
        "\nbeyond its steady pace: replica 0's training span minus its steps at that run's median step time (epoch "
        "ends and load count too; "
        f"the run without a failure: seed {seeds[0]}, same mode); "
        "its longest wait: the longest time between two of its steps from the failure on, beyond the median"
    )
    print(
        f"without a failure, {len(losses)} runs (seeds {args.seeds}, both modes): val_loss {min(losses):.4f} … "
        f"{max(losses):.4f}, "
        f"mean {statistics.mean(losses):.4f}"
    )
    (args.out / "fault_tolerance.json").write_text(
        json.dumps({"clean": clean, "killed": killed, "table": table}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
