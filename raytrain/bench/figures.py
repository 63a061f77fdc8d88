"""Pure figures of the study: epochs to run, the step-time split, speedups, ratios to the baselines."""

from __future__ import annotations

import math
from typing import Any

from raytrain.rules import costmodel, flops, steps


def steady_steps_per_epoch(num_rows: int, global_batch_size: int, warmup_steps: int) -> int:
    return max(0, len(steps.epoch_steps(num_rows, global_batch_size)) - warmup_steps)


def epochs_for(num_rows: int, global_batch_size: int, warmup_steps: int, steps: int) -> int:
    """Fewest epochs that hold `steps` steady steps; ValueError when an epoch has none."""
    per_epoch = steady_steps_per_epoch(num_rows, global_batch_size, warmup_steps)
    if per_epoch == 0:
        raise ValueError(
            f"an epoch of {num_rows} rows at a global batch of {global_batch_size} has no step after the "
            f"{warmup_steps} warm-up steps; lower the batch size or use a larger dataset"
        )
    return math.ceil(steps / per_epoch)


def step_split(
    phases_s: dict[str, float],
    steady_time_s: float,
    steady_steps: int,
    fb_1worker_ms: float | None,
    batch_ratio: float = 1.0,
) -> dict[str, float]:
    """Milliseconds per steady step: data wait, compute, communication, optimizer, other.

    `fb_1worker_ms` is forward+backward per step at 1 worker (None: this is the 1-worker
    run); `batch_ratio` = this run's per-worker batch / the 1-worker run's.
    """
    per_step = {k: 1e3 * v / steady_steps for k, v in phases_s.items()}
    step_ms = 1e3 * steady_time_s / steady_steps
    fb = per_step.get("forward_backward", 0.0)
    comm = 0.0 if fb_1worker_ms is None else max(0.0, fb - fb_1worker_ms * batch_ratio)
    data, optimizer = per_step.get("data_wait", 0.0), per_step.get("optimizer", 0.0)
    return {
        "step": step_ms,
        "data_wait": data,
        "compute": fb - comm,
        "communication": comm,
        "optimizer": optimizer,
        "other": max(0.0, step_ms - data - fb - optimizer),
    }


def scaling_rows(
    runs: list[dict[str, Any]],
    grad_bytes: int,
    link: str | None,
    bucket_mb: float,
    *,
    precision: str = "fp32",
    peak_tflops: float | None = None,
) -> list[dict[str, Any]]:
    """Per worker count: throughput, speedup vs 1 worker, efficiency, step split, the cost
    view (FLOPs per sample, achieved FLOP/s per worker, MFU: `raytrain.rules.flops`),
    prediction."""
    base = next(r for r in runs if r["workers"] == 1)
    fb_1 = 1e3 * base["phase_time_s"].get("forward_backward", 0.0) / base["steady_steps"]
    rows = []
    for run in runs:
        n = run["workers"]
        speedup = run["steady_samples_per_s"] / base["steady_samples_per_s"]
        ratio = run["per_worker_batch"] / base["per_worker_batch"]
        split = step_split(
            run["phase_time_s"], run["steady_time_s"], run["steady_steps"], None if n == 1 else fb_1, ratio
        )
        row = {
            "workers": n,
            "global_batch_size": run["global_batch_size"],
            "per_worker_batch": run["per_worker_batch"],
            "epochs": run["epochs"],
            "steady_steps": run["steady_steps"],
            "steady_samples_per_s": run["steady_samples_per_s"],
            "speedup": speedup,
            "efficiency": speedup / n,
            "split_ms": split,
            "implied_bandwidth_GBps": costmodel.implied_bandwidth_GBps(n, grad_bytes, split["communication"] / 1e3),
            "run_dir": run["run_dir"],
            "goodput": run.get("goodput"),  # the run's kept step time over its wall time (startup included)
            "cost": flops.cost_view(
                run.get("flops_per_sample"),
                run["steady_samples_per_s"],
                n,
                run.get("device_name") or "",
                precision,
                peak_tflops,
            ),
        }
        if link:
            row["predicted_speedup"] = costmodel.predict(
                gpus=n, step_time_s=base_step_s(base), grad_bytes=grad_bytes, link=link, bucket_mb=bucket_mb
            ).speedup
        rows.append(row)
    return rows


def base_step_s(run: dict[str, Any]) -> float:
    return run["steady_time_s"] / run["steady_steps"]


def baseline_rows(rows: list[dict[str, Any]], baselines: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """raytrain / baseline throughput at each worker count a baseline ran."""
    ours = {row["workers"]: row["steady_samples_per_s"] for row in rows}
    out = []
    for name, results in baselines.items():
        for result in results:
            n = result["world_size"]
            out.append(
                {
                    "baseline": name,
                    "workers": n,
                    "baseline_samples_per_s": result["steady_samples_per_s"],
                    "raytrain_samples_per_s": ours[n],
                    "ratio": ours[n] / result["steady_samples_per_s"],
                    "threads": result["threads"],
                    "ray_beside": result.get("ray_beside"),
                    "ray_background_cpu_share": result.get("ray_background_cpu_share"),
                }
            )
    return out


def pick_run(results: list[dict[str, Any]], statistic: str = "median") -> dict[str, Any]:
    """The round standing for a configuration: the median throughput (the lower of the middle
    two for an even count) or the best."""
    ordered = sorted(results, key=lambda r: r["steady_samples_per_s"])
    return ordered[-1] if statistic == "best" else ordered[(len(ordered) - 1) // 2]
