"""`raytrain bench`: the scaling study. Throughput, speedup and where the step time goes.

For each worker count the same pipeline and options run through `raytrain.fit` for just
enough epochs to measure `--steps` steady steps; the loop leaves the first steps of every
epoch out (warm-up) and rank 0 splits each steady step into data wait, forward+backward
and optimizer. From those figures:

- speedup(N) = samples/s at N workers / samples/s at 1 worker (so exactly 1 at 1 worker),
  efficiency = speedup / N;
- communication(N) = forward_backward(N) - forward_backward(1) per step, clipped at 0
  (DDP's all-reduce runs inside backward; at 1 worker there is none). The 1-worker figure
  is scaled by the per-worker batch when that changes with N (fixed global batch).
  compute = forward_backward - communication.

Baselines, in the same study: `torchrun` (the classic template, `raytrain.baselines.classic_ddp`,
under `python -m torch.distributed.run` at each worker count) and `plain` (the same script
as one process without torch.distributed), measured the same way; reported as ratios.

The command line (`raytrain bench`) is in `raytrain.cli`; `--predict`, which runs nothing,
in `raytrain.bench.predict`.
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
