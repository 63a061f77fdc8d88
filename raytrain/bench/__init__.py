"""`raytrain bench`: the scaling study. Throughput, speedup and where the step time goes.

Each worker count runs through `raytrain.fit` for just enough epochs to measure `--steps`
steady steps, and the baselines (the torchrun template, `raytrain.baselines.classic_ddp`, and
the same script as one plain process) run and are timed the same way. How every figure is
computed is `raytrain.bench.render.METHOD`, which bench.md prints; `--predict`, which runs
nothing, is `raytrain.bench.predict`.
"""

from raytrain.bench.figures import (
    baseline_rows,
    epochs_for,
    pick_run,
    scaling_rows,
    steady_steps_per_epoch,
    step_split,
)
from raytrain.bench.options import BENCH_OWNED, BenchError, BenchOptions, PlannedRun, worker_counts
from raytrain.bench.study import bench_config, plan_runs, prepare_data, run_bench, run_raytrain

__all__ = [
    "BENCH_OWNED",
    "BenchError",
    "BenchOptions",
    "PlannedRun",
    "baseline_rows",
    "bench_config",
    "epochs_for",
    "pick_run",
    "plan_runs",
    "prepare_data",
    "run_bench",
    "run_raytrain",
    "scaling_rows",
    "steady_steps_per_epoch",
    "step_split",
    "worker_counts",
]
