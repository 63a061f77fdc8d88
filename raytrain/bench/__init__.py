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

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, get_args

import psutil

from raytrain.rules import costmodel
from raytrain.rules import batch as rules
from raytrain.config import DEFAULT_STORAGE, ConfigError, TrainConfig
from raytrain.observe.render import figure, markdown_table, plural, text_table
from raytrain.rundir import PROGRESS, RunDir

TEMPLATE_MODULE = "raytrain.baselines.classic_ddp"
BASELINES = ("torchrun", "plain")
Statistic = Literal["median", "best"]
STATISTICS = get_args(Statistic)
BASELINE_TIMEOUT_S = 1800
# Train options bench decides itself (one run per worker count, its own storage layout).
BENCH_OWNED = ("workers", "epochs", "storage", "name", "resume", "checkpoint_every_steps", "max_failures", "timing_warmup_steps")
METHOD = (
    "Steady samples/s: the samples of all workers in the steady steps over rank 0's time in those steps (the "
    "first {warmup} steps of every epoch are warm-up and left out; evaluation, checkpoints and logging between "
    "steps are not timed). Speedup = samples/s at N workers ÷ samples/s at 1 worker; efficiency = speedup ÷ N. "
    "Step split (rank 0, ms per steady step): data wait = cutting the batch and moving it to the device; "
    "communication = forward+backward at N workers − forward+backward at 1 worker (scaled by the per-worker "
    "batch), clipped at 0 — DDP's all-reduce runs inside backward, so this is the part of it not hidden by "
    "compute, plus any slowdown from workers sharing the machine; compute = forward+backward − communication; "
    "optimizer = optimizer step and zero_grad; other = the rest of the step (lr, bookkeeping). "
    "Baselines (raytrain.baselines.classic_ddp) are timed the same way, with the same epochs, per-worker batch, "
    "model, data and DDP flags, and OMP_NUM_THREADS = the CPUs Ray gives each worker, with the study's embedded "
    "Ray stopped (as a user runs them; when the study joined a running Ray, they run beside it and the CPU its "
    "processes took meanwhile is reported). With --repeat R, rounds alternate raytrain-first and "
    "baselines-first and every figure is the {statistic} round of R (best: the fastest, as timeit does — "
    "interference from other work on the machine only ever slows a run down)."
)


class BenchError(RuntimeError):
    """A benchmark run failed; the message says which and where its log is."""


def _names(text: str) -> list[str]:
    """`torchrun,plain` -> ["torchrun", "plain"]."""
    return [name.strip() for name in text.split(",") if name.strip()]


@dataclass(kw_only=True)
class BenchOptions:
    """What `raytrain bench` measures, besides the training options."""

    workers: list[int]
    """Worker counts to run, comma-separated on the command line (e.g. 1,2,4); 1 is always added (speedups are relative to it)."""
    steps: int = 100
    """At least this many steady steps measured at each worker count (default 100)."""
    warmup_steps: int = field(default=3, metadata={"flags": ("--warmup-steps", "--timing-warmup-steps")})
    """Steps left out at the start of every epoch, by raytrain and the baselines (default 3)."""
    baselines: list[str] = field(default_factory=list, metadata={"flags": "--baseline", "repeat": True, "parse": _names, "metavar": "NAME"})
    """`torchrun` and/or `plain` (repeat or comma-separate)."""
    repeat: int = 1
    """Rounds of every configuration (default 1)."""
    statistic: Statistic = "median"
    """Which round stands for a configuration with --repeat: `median` (default) or `best` (the fastest)."""
    link: str | None = None
    """A cost-model link (nvlink, pcie4, ib200, ...: raytrain.rules.costmodel.LINKS): adds a predicted speedup column; with --predict, the ring's link."""
    storage: str = DEFAULT_STORAGE
    """Results go to STORAGE/NAME/ (default ~/raytrain_results)."""
    name: str | None = None
    """Default bench-PIPELINE-YYYYmmdd-HHMMSS."""

    def __post_init__(self) -> None:
        problems = []
        if not self.workers or any(n < 1 for n in self.workers):
            problems.append(("workers", f"got {self.workers}; give worker counts ≥ 1, e.g. --workers 1,2,4"))
        if self.steps < 1:
            problems.append(("steps", f"got {self.steps}; must be a positive number of steps, e.g. --steps 100"))
        if self.repeat < 1:
            problems.append(("repeat", f"got {self.repeat}; must be a positive number of rounds, e.g. --repeat 3"))
        if self.statistic not in STATISTICS:
            problems.append(("statistic", f"got {self.statistic!r}; choose one of {', '.join(STATISTICS)}"))
        if self.warmup_steps < 0:
            problems.append(("warmup_steps", f"got {self.warmup_steps}; must be 0 or more, e.g. --warmup-steps 3"))
        for name in self.baselines:
            if name not in BASELINES:
                problems.append(("baseline", f"got {name!r}; choose from {', '.join(BASELINES)}"))
        if self.link is not None and self.link not in costmodel.LINKS:
            problems.append(("link", f"got {self.link!r}; choose one of {', '.join(costmodel.LINKS)}"))
        if problems:
            raise ConfigError(problems)
        self.workers = sorted({1, *self.workers})
        self.storage = os.path.abspath(os.path.expanduser(self.storage.removeprefix("file://")))


# -- pure: epochs, step split, ratios ------------------------------------------------------


def steady_steps_per_epoch(num_rows: int, global_batch_size: int, warmup_steps: int) -> int:
    return max(0, len(rules.epoch_steps(num_rows, global_batch_size)) - warmup_steps)


def epochs_for(num_rows: int, global_batch_size: int, warmup_steps: int, steps: int) -> int:
    """Fewest epochs that hold `steps` steady steps; ValueError when an epoch has none."""
    per_epoch = steady_steps_per_epoch(num_rows, global_batch_size, warmup_steps)
    if per_epoch == 0:
        raise ValueError(
            f"an epoch of {num_rows} rows at a global batch of {global_batch_size} has no step after the "
            f"{warmup_steps} warm-up steps; lower the batch size or use a larger dataset"
        )
    return math.ceil(steps / per_epoch)


def step_split(phases_s: dict[str, float], steady_time_s: float, steady_steps: int, fb_1worker_ms: float | None, batch_ratio: float = 1.0) -> dict[str, float]:
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


def scaling_rows(runs: list[dict[str, Any]], grad_bytes: int, link: str | None, bucket_mb: float) -> list[dict[str, Any]]:
    """Per worker count: throughput, speedup vs 1 worker, efficiency, step split, prediction."""
    base = next(r for r in runs if r["workers"] == 1)
    fb_1 = 1e3 * base["phase_time_s"].get("forward_backward", 0.0) / base["steady_steps"]
    rows = []
    for run in runs:
        n = run["workers"]
        speedup = run["steady_samples_per_s"] / base["steady_samples_per_s"]
        split = step_split(
            run["phase_time_s"], run["steady_time_s"], run["steady_steps"],
            None if n == 1 else fb_1, run["per_worker_batch"] / base["per_worker_batch"],
        )  # fmt: skip
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
            out.append({
                "baseline": name,
                "workers": n,
                "baseline_samples_per_s": result["steady_samples_per_s"],
                "raytrain_samples_per_s": ours[n],
                "ratio": ours[n] / result["steady_samples_per_s"],
                "threads": result["threads"],
                "ray_beside": result.get("ray_beside"),
                "ray_background_cpu_share": result.get("ray_background_cpu_share"),
            })  # fmt: skip
    return out


# -- the study -------------------------------------------------------------------------


def run_bench(pipeline: str, train_values: dict[str, Any], opts: BenchOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the study, write bench.json, bench.md and scaling.png; return the report.

    With `opts.repeat` > 1 every configuration runs that many times in rounds that
    alternate raytrain-first and baselines-first; each figure is the round picked by
    `opts.statistic` (a loaded machine slows single runs by several times).
    """
    from raytrain.pipeline import load_pipeline
    from raytrain.driver.run import ray_session

    pipe = load_pipeline(pipeline)
    name = opts.name or f"bench-{pipeline.split(':')[-1].split('.')[-1].lower()}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(opts.storage) / name
    if (out / "bench.json").exists():
        raise ConfigError([("name", f"bench {name!r} already exists in {opts.storage}; choose another --name")])
    base_cfg = bench_config(train_values, opts, workers=max(opts.workers), epochs=1, storage=out / "runs", name="probe")
    grad_bytes, params = gradient_bytes(pipe, base_cfg)
    started = time.time()
    measured: dict[str, dict[int, list[dict[str, Any]]]] = {"raytrain": {}, **{b: {} for b in opts.baselines}}

    def baselines(tag: str) -> None:
        for mode in opts.baselines:
            for run in planned if mode == "torchrun" else planned[:1]:
                measured[mode].setdefault(run.workers, []).append(run_template(pipeline, run, opts, out, mode=mode, tag=tag, echo=echo))

    # Rounds alternate raytrain-first and baselines-first, so drift in the machine's load
    # hits both alike. raytrain runs on its embedded Ray (started once per stretch of
    # raytrain runs); the baselines run with that Ray stopped, as a user runs them.
    blocks: list[tuple[str, str]] = []
    for index in range(opts.repeat):
        tag = f"r{index + 1}" if opts.repeat > 1 else ""
        pair = [("raytrain", tag), ("baselines", tag)] if opts.baselines else [("raytrain", tag)]
        blocks += pair if index % 2 == 0 else pair[::-1]
    planned: list[PlannedRun] = []
    while blocks:
        if blocks[0][0] == "baselines":
            baselines(blocks.pop(0)[1])
            continue
        with ray_session(base_cfg):
            if not planned:
                num_rows = prepare_data(pipe, base_cfg, out if opts.baselines else None, verbose=base_cfg.verbose)
                planned = plan_runs(train_values, opts, out, num_rows)
            while blocks and blocks[0][0] == "raytrain":
                tag = blocks.pop(0)[1]
                for run in planned:
                    measured["raytrain"].setdefault(run.workers, []).append(run_raytrain(pipe, run, tag, echo))

    runs = [pick_run(measured["raytrain"][run.workers], opts.statistic) for run in planned]
    chosen = {
        mode: [pick_run(results, opts.statistic) for _, results in sorted(by_n.items())] for mode, by_n in measured.items() if mode != "raytrain"
    }
    rows = scaling_rows(runs, grad_bytes, opts.link, base_cfg.ddp.bucket_cap_mb)
    report = {
        "pipeline": pipeline,
        "name": name,
        "date": time.strftime("%Y-%m-%d"),
        "command": "raytrain " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "raytrain" else None,
        "machine": machine_facts(),
        "train_options": {k: v for k, v in base_cfg.to_dict().items() if k not in BENCH_OWNED},
        "steps": opts.steps,
        "warmup_steps": opts.warmup_steps,
        "repeat": opts.repeat,
        "statistic": opts.statistic,
        "num_train_rows": planned[0].num_rows,
        "params": params,
        "grad_bytes": grad_bytes,
        "link": opts.link,
        "wall_time_s": round(time.time() - started, 1),
        "method": METHOD.format(warmup=opts.warmup_steps, statistic=opts.statistic),
        "results": rows,
        "baselines": baseline_rows(rows, chosen),
        "rounds": {mode: {str(n): [r["steady_samples_per_s"] for r in results] for n, results in sorted(by_n.items())} for mode, by_n in measured.items()},
        "baseline_runs": chosen,
    }
    write_bench_files(out, report)
    echo(render_text(report))
    echo(f"Wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'scaling.png'}")
    return report


def pick_run(results: list[dict[str, Any]], statistic: str = "median") -> dict[str, Any]:
    """The round standing for a configuration: the median throughput (the lower of the middle
    two for an even count) or the best."""
    ordered = sorted(results, key=lambda r: r["steady_samples_per_s"])
    return ordered[-1] if statistic == "best" else ordered[(len(ordered) - 1) // 2]


@dataclass
class PlannedRun:
    """One worker count of the study: its config (epochs chosen for the steady steps asked)."""

    workers: int
    cfg: TrainConfig
    batch: rules.BatchPlan
    epochs: int
    steady_steps: int
    num_rows: int
    out: Path


def plan_runs(train_values: dict[str, Any], opts: BenchOptions, out: Path, num_rows: int) -> list[PlannedRun]:
    planned = []
    for n in opts.workers:
        probe = bench_config(train_values, opts, workers=n, epochs=1, storage=out / "runs", name=f"w{n}")
        batch = rules.resolve_batch_plan(n, global_batch_size=probe.global_batch_size, batch_size_per_worker=probe.batch_size_per_worker)
        try:
            epochs = epochs_for(num_rows, batch.global_batch_size, opts.warmup_steps, opts.steps)
        except ValueError as exc:
            raise ConfigError([("steps", str(exc))]) from None
        cfg = bench_config(train_values, opts, workers=n, epochs=epochs, storage=out / "runs", name=f"w{n}")
        steady = epochs * steady_steps_per_epoch(num_rows, batch.global_batch_size, opts.warmup_steps)
        planned.append(PlannedRun(workers=n, cfg=cfg, batch=batch, epochs=epochs, steady_steps=steady, num_rows=num_rows, out=out))
    return planned


def bench_config(train_values: dict[str, Any], opts: BenchOptions, *, workers: int, epochs: int, storage: Path, name: str) -> TrainConfig:
    values = {k: v for k, v in train_values.items() if k not in BENCH_OWNED}
    values.update(workers=workers, epochs=epochs, storage=str(storage), name=name, max_failures=0, time_phases=True)
    values["warmup_epochs"] = min(float(values.get("warmup_epochs", 1.0)), float(epochs))
    values["timing_warmup_steps"] = opts.warmup_steps
    return TrainConfig.from_dict(values)


def gradient_bytes(pipe, cfg: TrainConfig) -> tuple[int, int]:
    """Bytes of one set of gradients (trainable parameters) and the parameter count."""
    model = pipe.build_model(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in trainable), sum(p.numel() for p in trainable)


def prepare_data(pipe, cfg: TrainConfig, out: Path | None, verbose: bool = False) -> int:
    """Read the training rows (as every raytrain worker does); save them for the baselines
    under OUT/baselines/train.npz when `out` is given. Returns the row count."""
    import logging

    import numpy as np

    from raytrain.data import shards
    from raytrain.data.checks import Schema, load_table
    from raytrain.driver.run import build_datasets, read_probe

    data_logger = logging.getLogger("ray.data")
    level = data_logger.level
    data_logger.setLevel(logging.INFO if verbose else logging.ERROR)
    try:
        dataset = build_datasets(pipe, cfg)["train"]
        if out is None:
            return dataset.count()
        units = shards.split(dataset)
        units = units if not isinstance(units, str) else shards.split(dataset.materialize())
        schema = Schema.of(read_probe(units, "train", skip_nan_rows=False))
        columns = load_table(units, "train", schema, skip_nan_rows=False)["columns"]
    finally:
        data_logger.setLevel(level)
    (out / "baselines").mkdir(parents=True, exist_ok=True)
    np.savez(out / "baselines" / "train.npz", **columns)
    return len(next(iter(columns.values())))


def run_raytrain(pipe, run: PlannedRun, tag: str, echo) -> dict[str, Any]:
    from raytrain.driver.run import fit

    cfg = dataclasses.replace(run.cfg, name=f"w{run.workers}" + (f"-{tag}" if tag else ""))
    what = f"raytrain on {plural(run.workers, 'worker')}" + (f" ({tag})" if tag else "")
    echo(f"bench: {what}: {run.batch.describe()}; {plural(run.epochs, 'epoch')}, {run.steady_steps} steady steps")
    result = fit(pipe, cfg)
    progress = RunDir(result.run_dir).progress()
    if progress is None:
        raise BenchError(f"the {what} run left no {PROGRESS} in {result.run_dir}: its timings are unknown")
    measured = {
        "workers": run.workers,
        "global_batch_size": run.batch.global_batch_size,
        "per_worker_batch": run.batch.per_worker_max,
        "epochs": run.epochs,
        "steady_steps": progress.steady_steps or run.steady_steps,
        "steady_samples": progress.get("steady_samples"),
        "steady_time_s": progress.get("steady_time_s"),
        "steady_samples_per_s": progress.steady_samples_per_s,
        "phase_time_s": progress.get("phase_time_s"),
        "run_dir": result.run_dir,
    }
    echo(f"bench: {what}: {measured['steady_samples_per_s']:,.0f} samples/s steady")
    return measured


def run_template(pipeline: str, run: PlannedRun, opts: BenchOptions, out: Path, *, mode: str, tag: str, echo) -> dict[str, Any]:
    """The classic template with `run`'s config and epochs: under torchrun at `run`'s worker
    count, or (`mode="plain"`) as one process without torch.distributed."""
    from raytrain.driver.run import driver_pythonpath, free_port

    workers = run.workers
    folder = out / "baselines"
    name = f"{mode}-w{workers}" + (f"-{tag}" if tag else "")
    config_path = folder / f"{name}.config.json"
    config_path.write_text(json.dumps(run.cfg.to_dict()))
    args = [
        "-m", TEMPLATE_MODULE, "--pipeline", pipeline, "--data", str(folder / "train.npz"), "--config", str(config_path),
        "--epochs", str(run.epochs), "--warmup-steps", str(opts.warmup_steps), "--out", str(folder / f"{name}.json"),
    ]  # fmt: skip
    if mode == "plain":
        command = [sys.executable, *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(workers),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args,
        ]  # fmt: skip
    # Ray gives each worker OMP_NUM_THREADS = its whole CPUs; the template gets the same.
    threads = max(1, int(run.cfg.cpus_per_worker))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": driver_pythonpath()}
    what = f"{mode} baseline on {workers} process{'es' if workers > 1 else ''}" + (f" ({tag})" if tag else "")
    echo(f"bench: {what}, {plural(threads, 'thread')} each")
    log = folder / f"{name}.log"
    background = BackgroundCPU()
    with open(log, "w") as handle:
        try:
            code = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=BASELINE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = None
    ray_share = background.share()
    import ray

    ray_beside = "running" if ray.is_initialized() else "stopped"
    if code != 0 or not (folder / f"{name}.json").exists():
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        raise BenchError(f"the {what} {'timed out' if code is None else f'exited with {code}'}: {tail}\nLog: {log}")
    result = json.loads((folder / f"{name}.json").read_text())
    result["ray_beside"] = ray_beside  # "running": a Ray the study did not start (e.g. --address)
    result["ray_background_cpu_share"] = ray_share if ray_beside == "running" else None
    echo(f"bench: {what}: {result['steady_samples_per_s']:,.0f} samples/s steady")
    return result


class BackgroundCPU:
    """CPU taken by this process's descendants (the embedded Ray's processes) from now until
    `share()`, as a share of one CPU; None when there are none (Ray is not a child of this
    process: a joined cluster)."""

    def __init__(self) -> None:
        self.processes = psutil.Process().children(recursive=True)
        self.start_cpu, self.start = _cpu_seconds(self.processes), time.perf_counter()

    def share(self) -> float | None:
        if not self.processes:
            return None
        return (_cpu_seconds(self.processes) - self.start_cpu) / max(1e-9, time.perf_counter() - self.start)


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += times.user + times.system
    return total


def machine_facts() -> dict[str, Any]:
    import ray
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "load_average_at_end": [round(x, 2) for x in load] if load else None,
    }


# -- outputs ----------------------------------------------------------------------------


def write_bench_files(out: Path, report: dict[str, Any]) -> None:
    """OUT/bench.json, bench.md and scaling.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(bench_markdown(report))
    plot_scaling(report, out / "scaling.png")


def table_lines(report: dict[str, Any]) -> list[list[str]]:
    predicted = report.get("link") is not None
    header = ["workers", "global batch", "samples/s", "speedup", "efficiency", "step ms", "data wait", "compute", "comm", "optimizer", "other"]
    if predicted:
        header.append(f"predicted ({report['link']})")
    lines = [header]
    for row in report["results"]:
        s = row["split_ms"]
        line = [
            str(row["workers"]), str(row["global_batch_size"]), f"{row['steady_samples_per_s']:,.0f}", f"{row['speedup']:.2f}×",
            f"{row['efficiency']:.0%}", f"{s['step']:.2f}", f"{s['data_wait']:.2f}", f"{s['compute']:.2f}",
            f"{s['communication']:.2f}", f"{s['optimizer']:.2f}", f"{s['other']:.2f}",
        ]  # fmt: skip
        if predicted:
            line.append(f"{row['predicted_speedup']:.2f}×")
        lines.append(line)
    return lines


def baseline_lines(report: dict[str, Any]) -> list[list[str]]:
    lines = [["baseline", "workers", "baseline samples/s", "raytrain samples/s", "raytrain / baseline", "Ray meanwhile"]]
    for b in report["baselines"]:
        lines.append([
            b["baseline"], str(b["workers"]), f"{b['baseline_samples_per_s']:,.0f}", f"{b['raytrain_samples_per_s']:,.0f}",
            f"{b['ratio']:.3f}", _ray_beside(b),
        ])  # fmt: skip
    return lines


def _ray_beside(b: dict[str, Any]) -> str:
    if b.get("ray_beside") != "running":
        return "stopped"
    share = b.get("ray_background_cpu_share")
    return "running" + ("" if share is None else f", {share:.0%} of a CPU")


def render_text(report: dict[str, Any]) -> str:
    text = f"Scaling of {report['pipeline']} (ms per step, rank 0; {report['grad_bytes'] / 1e6:.2f} MB of gradients):\n" + _text(table_lines(report))
    if report["baselines"]:
        text += "\n\n" + _text(baseline_lines(report))
    return text


def _text(lines: list[list[str]]) -> str:
    return "\n".join(text_table(lines[0], lines[1:]))


def _markdown(lines: list[list[str]]) -> str:
    return "\n".join(markdown_table(lines[0], lines[1:], align="right"))


def bench_markdown(report: dict[str, Any]) -> str:
    opts = report["train_options"]
    ddp = ", ".join(f"{k}={v}" for k, v in opts["ddp"].items())
    parts = [
        f"# raytrain bench: {report['pipeline']} ({report['date']})",
        "",
        f"Command: `{report['command']}`" if report["command"] else "Command: (Python API)",
        "",
        f"Machine: {report['machine']['cpus']} CPUs, GPU {report['machine']['gpu'] or 'none'}, torch {report['machine']['torch']}, "
        f"ray {report['machine']['ray']}; load average at the end {report['machine']['load_average_at_end']}.",
        f"Model: {report['params']:,} trainable parameters, {report['grad_bytes'] / 1e6:.2f} MB of gradients. "
        f"Precision {opts['precision']}; DDP {ddp}. {report['num_train_rows']:,} training rows; "
        f"at least {report['steps']} steady steps per worker count.",
        "",
        "## Scaling (ms per steady step on rank 0)",
        "",
        _markdown(table_lines(report)),
        "",
    ]
    if report["baselines"]:
        parts += ["## Baselines (same model, data, per-worker batch and warm-up)", "", _markdown(baseline_lines(report)), ""]
    if report.get("repeat", 1) > 1:
        parts += [f"## Rounds (steady samples/s; each figure above is the {report.get('statistic', 'median')} round of {report['repeat']})", ""]
        for mode, by_n in report["rounds"].items():
            parts += [f"- {mode}: " + "; ".join(f"{plural(int(n), 'worker')}: " + ", ".join(f"{x:,.0f}" for x in xs) for n, xs in by_n.items())]
        parts += [""]
    implied = [f"{r['workers']} workers: {r['implied_bandwidth_GBps']:.2f} GB/s" for r in report["results"] if r.get("implied_bandwidth_GBps")]
    parts += ["## Method", "", report["method"], ""]
    if implied:
        parts += [f"All-reduce bus bandwidth implied by the communication estimate: {'; '.join(implied)}.", ""]
    if report.get("link"):
        parts += [
            f"Predicted speedup: `raytrain.rules.costmodel` on link {report['link']} from the 1-worker step time and the gradient size "
            "(ring all-reduce 2(N−1)/N × bytes / bandwidth, minus the part hidden under backward).",
            "",
        ]
    return "\n".join(parts)


def plot_scaling(report: dict[str, Any], path: Path) -> None:
    """Speedup vs workers against the linear ideal (Agg canvas: no display, no pyplot state)."""
    workers = [r["workers"] for r in report["results"]]
    top = max(workers)
    fig = figure(6, 4.2, dpi=110)
    ax = fig.add_subplot()
    ax.plot([1, top], [1, top], "--", color="gray", label="linear (ideal)")
    ax.plot(workers, [r["speedup"] for r in report["results"]], "o-", color="tab:blue", label="raytrain (measured)")
    torchrun = {b["workers"]: b["baseline_samples_per_s"] for b in report["baselines"] if b["baseline"] == "torchrun"}
    if 1 in torchrun and len(torchrun) > 1:
        xs = sorted(torchrun)
        ax.plot(xs, [torchrun[n] / torchrun[1] for n in xs], "s:", color="tab:orange", label="torchrun template (measured)")
    if report.get("link"):
        ax.plot(workers, [r["predicted_speedup"] for r in report["results"]], "^-.", color="tab:green", label=f"cost model ({report['link']})")
    for r in report["results"]:
        ax.annotate(f"{r['efficiency']:.0%}", (r["workers"], r["speedup"]), textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.set_xlabel("workers")
    ax.set_ylabel("speedup vs 1 worker")
    ax.set_xticks(workers)
    ax.set_xlim(0.8, top + 0.2)
    ax.set_ylim(0, top * 1.1)
    ax.set_title(f"raytrain bench: {report['pipeline']} ({report['date']})")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def worker_counts(text: str, option: str = "workers") -> list[int]:
    """`1,2,4` -> [1, 2, 4]; ConfigError naming `option` otherwise."""
    try:
        return [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ConfigError([(option, f"got {text!r}; give comma-separated integers, e.g. --workers 1,2,4")]) from None
