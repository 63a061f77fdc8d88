"""DDP performance flags, measured: bucket size, gradient_as_bucket_view, static_graph,
broadcast_buffers, on N CPU workers (gloo), against the defaults.

One embedded Ray for the whole study; one 1-worker run gives the forward+backward time
without communication; then every variant runs at N workers, round-robin for `--rounds`
rounds (so drift in the machine's load spreads over all variants); each figure is the
variant's median round. Usage:

    python benchmarks/ddp_options.py benchmarks.wide_digits:WideDigits --workers 2 --steps 60 --rounds 3 \\
        [--storage DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from raytrain.bench import BenchOptions, bench_config, pick_run, plan_runs, prepare_data, run_raytrain, step_split  # noqa: E402
from raytrain.driver.session import ray_session  # noqa: E402
from raytrain.pipeline import load_pipeline  # noqa: E402

VARIANTS = {
    "defaults (bucket 25 MiB, bucket view on)": {},
    "bucket_cap_mb 1": {"bucket_cap_mb": 1.0},
    "bucket_cap_mb 5": {"bucket_cap_mb": 5.0},
    "bucket_cap_mb 100": {"bucket_cap_mb": 100.0},
    "gradient_as_bucket_view off": {"gradient_as_bucket_view": False},
    "static_graph on": {"static_graph": True},
    "broadcast_buffers off": {"broadcast_buffers": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--statistic", choices=["median", "best"], default="median", help="which round stands for a variant"
    )
    parser.add_argument(
        "--variants",
        help="comma-separated subset of the variant names' first words, e.g. "
        "defaults,bucket_cap_mb,gradient_as_bucket_view",
    )
    parser.add_argument("--storage", default="~/raytrain_results")
    parser.add_argument("--json")
    args = parser.parse_args()

    pipe = load_pipeline(args.pipeline)
    base = dict(pipe.default_config)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    opts = BenchOptions(workers=[args.workers], steps=args.steps, storage=args.storage, name=f"ddp-options-{stamp}")
    out = Path(opts.storage) / opts.name
    wanted = {"defaults", *(args.variants or "").split(",")}
    variants = {name: flags for name, flags in VARIANTS.items() if not args.variants or name.split()[0] in wanted}
    measured: dict[str, list[dict]] = {name: [] for name in variants}
    probe = bench_config(base, opts, workers=args.workers, epochs=1, storage=out / "runs", name="probe")
    with ray_session(probe):
        num_rows = prepare_data(pipe, probe, None)
        one = plan_runs(
            base, BenchOptions(workers=[1], steps=args.steps, storage=args.storage, name=opts.name), out, num_rows
        )[0]
        reference = run_raytrain(pipe, one, "", print)
        for index in range(args.rounds):
            for name, flags in variants.items():
                values = {**base, "ddp": flags}
                run = plan_runs(values, opts, out, num_rows)[-1]
                tag = f"{_slug(name)}-r{index + 1}"
                measured[name].append(run_raytrain(pipe, run, tag, lambda line: print(line, flush=True)))

    fb_1 = 1e3 * reference["phase_time_s"]["forward_backward"] / reference["steady_steps"]
    rows = []
    for name, runs in measured.items():
        run = pick_run(runs, args.statistic)
        split = step_split(run["phase_time_s"], run["steady_time_s"], run["steady_steps"], fb_1)
        rows.append(
            {
                "variant": name,
                "samples_per_s": run["steady_samples_per_s"],
                "rounds": [r["steady_samples_per_s"] for r in runs],
                **split,
            }
        )
    default = rows[0]["samples_per_s"]
    print(
        f"\n{args.pipeline} at {args.workers} workers ({args.statistic} of {args.rounds} rounds); 1 worker: "
        f"{reference['steady_samples_per_s']:,.0f} samples/s, forward+backward {fb_1:.2f} ms"
    )
    print(
        f"| variant | samples/s ({args.statistic}) | vs defaults | step ms | compute | comm | optimizer | rounds "
        "(samples/s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        rounds = ", ".join(f"{x:,.0f}" for x in row["rounds"])
        print(
            f"| {row['variant']} | {row['samples_per_s']:,.0f} | {row['samples_per_s'] / default:.3f} | "
            f"{row['step']:.2f} | "
            f"{row['compute']:.2f} | {row['communication']:.2f} | {row['optimizer']:.2f} | {rounds} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"pipeline": args.pipeline, "workers": args.workers, "one_worker": reference, "rows": rows}, indent=2
            )
        )


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.split("(")[0].strip()).strip("-")


if __name__ == "__main__":
    main()
