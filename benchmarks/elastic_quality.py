"""Does an elastic run (3 → 2 → 3 workers, fixed global batch, same seed) end where fixed-size
runs end? Runs digits at fixed 2 and 3 workers for several seeds, and the elastic scenario
(tests/elastic_scenario.py with ELASTIC_PIPELINE=digits), then prints the final val losses.

    python benchmarks/elastic_quality.py OUT_DIR [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "--epochs",
    "12",
    "--global-batch-size",
    "48",
    "--lr",
    "2e-3",
    "--warmup-epochs",
    "1",
    "--checkpoint-every-steps",
    "4",
]


def fixed_run(out: Path, workers: int, seed: int) -> float:
    name = f"fixed-w{workers}-s{seed}"
    subprocess.run(
        [
            str(Path(sys.executable).with_name("raytrain")),
            "train",
            "digits",
            "--workers",
            str(workers),
            "--seed",
            str(seed),
            "--storage",
            str(out),
            "--name",
            name,
            *COMMON,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads((out / name / "summary.json").read_text())["final_metrics"]["val_loss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.time()
    fixed = {(w, s): fixed_run(args.out, w, s) for w in (2, 3) for s in seeds}
    env = {**os.environ, "ELASTIC_PIPELINE": "digits", "ELASTIC_EPOCHS": "12", "ELASTIC_LR": "2e-3"}
    subprocess.run(
        [sys.executable, str(REPO / "tests" / "elastic_scenario.py"), str(args.out / "elastic-run")],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    result = json.loads((args.out / "elastic-run" / "result.json").read_text())
    elastic = result["summary"]["final_metrics"]["val_loss"]
    same_seed = [fixed[(w, 0)] for w in (2, 3)]
    spread = list(fixed.values())
    report = {
        "fixed_val_loss": {f"{w} workers, seed {s}": v for (w, s), v in fixed.items()},
        "elastic_val_loss": elastic,
        "elastic_world_sizes": result["summary"]["world_sizes"],
        "seed0_fixed_range": [min(same_seed), max(same_seed)],
        "all_fixed_range": [min(spread), max(spread)],
        "within_fixed_spread": min(spread) <= elastic <= max(spread),
        "observed": result["observed"],
        "wall_time_s": round(time.time() - started, 1),
    }
    print(json.dumps(report, indent=2))
    (args.out / "elastic_quality.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
