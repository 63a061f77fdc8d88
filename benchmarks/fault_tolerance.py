"""restart vs per-step fault tolerance on the same run: digits on 3 CPU workers, a fixed global
batch (the same steps whatever the worker count), replica 1 `os._exit`-ed mid-epoch 1.

    python benchmarks/fault_tolerance.py OUT_DIR [--seeds 0,1,2] [--epochs 6] [--kill-step 8]

Per mode: the time replica 0 loses (its training span minus its steps at the run's median
pace, beside the same for the run without a failure), its longest wait between two steps
after the failure, the time until the failed replica is training again, the steps trained
twice, and the final validation loss against runs without a failure over several seeds.

    python benchmarks/fault_tolerance.py OUT_DIR --analyze   # the table again, from OUT_DIR
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


def run(out: Path, mode: str, seed: int, kill_step: int | None, args) -> dict:
    name = f"{mode}-s{seed}" + ("-kill" if kill_step is not None else "")
    records = out / name / "records"
    records.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(
        workers="3",
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


def measure(killed: dict, clean: dict) -> dict:
    records, run_dir = Path(killed["records"]), RunDir(killed["run_dir"])
    kill = json.loads((records / "killed").read_text())
    replica0 = rows_of(records / "steps-replica0.jsonl")
    replica1 = [r for r in rows_of(records / "steps-replica1.jsonl") if r["pid"] != kill["pid"]]
    back = min((r["time"] for r in replica1), default=float("nan"))
    if killed["mode"] == "per-step":  # back in the quorum: the line saying it grew
        rejoined = [
            e.time
            for e in run_dir.events()
            if e.kind == Kind.QUORUM and e.extra.get("world_size", 0) > e.extra.get("previous_world_size", 0)
        ]
        back = min(rejoined, default=back)
    survivors = [r for i in (0, 2) for r in rows_of(records / f"steps-replica{i}.jsonl")]
    counts = Counter(r["step"] for r in replica0)
    return {
        "mode": killed["mode"],
        "lost_s": lost_s(replica0),
        "clean_lost_s": lost_s(rows_of(Path(clean["records"]) / "steps-replica0.jsonl")),
        "stall_s": stall_s(replica0, kill["time"]),
        "back_s": back - kill["time"],
        "redone": sum(1 for n in counts.values() if n > 1),  # steps replica 0 trained more than once
        "survivors_restarted": len({r["pid"] for r in survivors}) > 2,
        "val_loss": killed["val_loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--kill-step", type=int, default=8)
    parser.add_argument("--checkpoint-every-steps", type=int, default=10)
    parser.add_argument("--step-sleep-s", type=float, default=0.2)
    parser.add_argument("--analyze", action="store_true", help="no runs: the table from OUT_DIR/fault_tolerance.json")
    args = parser.parse_args()
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
                [
                    [
                        t["mode"],
                        f"{t['lost_s']:.1f} / {t['clean_lost_s']:.1f}",
                        f"{t['stall_s']:.1f}",
                        f"{t['back_s']:.1f}",
                        t["redone"],
                        "yes" if t["survivors_restarted"] else "no",
                        f"{t['val_loss']:.4f}",
                    ]
                    for t in table
                ],
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
