"""`--checkpoint-every auto` against fixed intervals of half and twice its choice, with
failures injected at a known rate (docs/fault-tolerance.md, *Goodput*).

    python benchmarks/goodput_auto.py OUT_DIR [--mtbf-s 30] [--steps 2500] [--seeds 0]

A small MLP on 2 CPU workers over one long epoch (only the interval decides when to save),
paced to about 25 ms a step; rank 0's process dies after an exponential time of training with
mean --mtbf-s (`ft_pipelines.PoissonFailures`: the n-th death drawn from (seed, n), the same
failure process for every contender). First `auto`, told the true rate (`--mtbf-hours` =
--mtbf-s per node; this machine is one node); then fixed `--checkpoint-every-steps` at half and
twice the interval auto settled on. Per contender: goodput (summary.json), wall time, failures,
checkpoints, goodput against auto's, and the part of the loss the interval decides: the
loop's stall at saves plus the steps redone after failures (the recovery itself, a restart of
the worker group, does not depend on the interval, and its run-to-run spread of several
seconds is the noise of the goodput figure). Daly's model says auto's should be the best.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
from ft_pipelines import PoissonFailures  # noqa: E402

from raytrain import TrainConfig, fit  # noqa: E402
from raytrain.observe.render import markdown_table  # noqa: E402


def run(out: Path, name: str, mtbf_s: float, seed: int, steps: int, **interval) -> dict:
    records = out / name
    records.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(
        workers=2,
        global_batch_size=64,
        max_steps=steps,
        epochs=1,
        warmup_epochs=0,
        max_failures=100,
        log_every_steps=20,
        storage=str(out / "runs"),
        name=name,
        **interval,
    )
    summary = fit(PoissonFailures(str(records), mtbf_s=mtbf_s, seed=seed), cfg).summary
    events = (out / "runs" / name / "events.jsonl").read_text().splitlines()
    lines = [json.loads(e)["message"] for e in events if "Checkpoint interval" in e]
    return {"summary": summary, "interval_lines": lines}


def settled_interval(lines: list[str]) -> int:
    """The interval auto held last ("Checkpoint interval A → B steps" or "... B steps")."""
    last = re.findall(r"Checkpoint interval (?:[\d,]+ → )?([\d,]+) steps", lines[-1])
    return int(last[0].replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mtbf-s", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--seeds", default="0")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        auto = run(
            args.out, f"auto-s{seed}", args.mtbf_s, seed, args.steps,
            checkpoint_every="auto", mtbf_hours=args.mtbf_s / 3600, checkpoint_min_steps=10,
        )  # fmt: skip
        n = settled_interval(auto["interval_lines"])
        print("\n".join(auto["interval_lines"]), flush=True)
        contenders = {"auto": auto}
        for label, every in ((f"fixed {max(1, n // 2)} (half)", max(1, n // 2)), (f"fixed {2 * n} (twice)", 2 * n)):
            contenders[label] = run(
                args.out, f"every{every}-s{seed}", args.mtbf_s, seed, args.steps, checkpoint_every_steps=every
            )
        base = auto["summary"]["goodput"]["goodput"]
        for label, result in contenders.items():
            s, g = result["summary"], result["summary"]["goodput"]
            rows.append(
                [
                    seed, label, f"{g['goodput']:.3f}", f"{g['goodput'] / base:.3f}", f"{s['wall_time_s']:.0f}",
                    g["failures"], g["checkpoints"], f"{g['checkpoint_stall_s']:.1f}", f"{g['recovery_s']:.0f}",
                    f"{g['redone_s']:.1f}", f"{g['checkpoint_stall_s'] + g['redone_s']:.1f}",
                ]
            )  # fmt: skip
    header = ["seed", "interval", "goodput", "vs auto", "wall s", "failures", "checkpoints", "stall s", "recovery s"]
    table = "\n".join(markdown_table([*header, "redone s", "stall + redone s"], rows))
    print(table)
    (args.out / "goodput_auto.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
