"""The cost of `raytrain check` against a 1-epoch run: wall time of the two commands, end to end.

    python benchmarks/check_time.py --rounds 3 [--workers 2] [--json out.json]

Each round runs, as fresh processes and in alternating order,

- `raytrain train digits --workers N --epochs 1 --storage TMP` and
- `raytrain check digits --workers N`

and times each from just before the process starts to its exit (both start their own
embedded Ray). The target (issue 27): the check in under twice the 1-epoch run's time.
Printed: every round's figures, the median of each and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(command: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    raytrain = [sys.executable, "-c", "import sys; from raytrain.cli import main; sys.exit(main())"]
    figures: dict[str, list[float]] = {"train": [], "check": []}
    with tempfile.TemporaryDirectory(prefix="check-time-") as storage:
        commands = {
            "train": [*raytrain, "train", "digits", "--workers", str(args.workers), "--epochs", "1"],
            "check": [*raytrain, "check", "digits", "--workers", str(args.workers)],
        }
        for index in range(args.rounds):
            order = ["train", "check"] if index % 2 == 0 else ["check", "train"]
            for name in order:
                extra = ["--storage", storage, "--name", f"r{index}"] if name == "train" else []
                figures[name].append(timed(commands[name] + extra))
            print(
                f"round {index + 1}: train {figures['train'][-1]:.1f} s, check {figures['check'][-1]:.1f} s", flush=True
            )
    train, check = statistics.median(figures["train"]), statistics.median(figures["check"])
    print(
        f"median of {args.rounds}: train digits --epochs 1 {train:.1f} s, check digits {check:.1f} s; "
        f"check / train = {check / train:.2f} (target < 2)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({**figures, "ratio_of_medians": check / train}, indent=2) + "\n")


if __name__ == "__main__":
    main()
