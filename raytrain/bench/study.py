"""The study: each worker count run through `raytrain.fit`, the baselines beside it, the report written."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

from raytrain import hooks
from raytrain.bench.baselines import machine_facts, run_template
from raytrain.bench.figures import baseline_rows, epochs_for, pick_run, scaling_rows, steady_steps_per_epoch
from raytrain.bench.options import BENCH_OWNED, BenchError, BenchOptions, PlannedRun
from raytrain.bench.render import METHOD, render_text, write_bench_files
from raytrain.config import TrainConfig
from raytrain.errors import ConfigError
from raytrain.rules.batch import resolve_batch_plan
from raytrain.rundir import PROGRESS, RunDir, Store
from raytrain.text import plural


def run_bench(
    pipeline: str, train_values: dict[str, Any], opts: BenchOptions, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the study, write bench.json, bench.md and scaling.png; return the report.

    With `opts.repeat` > 1 every configuration runs that many times in rounds that
    alternate raytrain-first and baselines-first; each figure is the round picked by
    `opts.statistic` (a loaded machine slows single runs by several times).
    """
    from raytrain.pipeline import dated_name, load_pipeline

    pipe = load_pipeline(pipeline)
    name = opts.name if opts.name is not None else dated_name(pipeline, "bench-{}")
    where = Store.of(opts.storage) / name
    if where.exists("bench.json"):
        raise ConfigError([("name", f"bench {name!r} already exists in {where.parent}; choose another --name")])
    # The study's own files are written here (on an object store: locally, then its report is
    # uploaded); the raytrain runs go to STORAGE/NAME/runs either way.
    with where.write_locally(("bench.json", "bench.md", "scaling.png")) as out:
        report = _study(pipe, pipeline, name, train_values, opts, where, out, echo)
    echo(f"Wrote {where}/bench.json, bench.md and scaling.png")
    return report


def _study(pipe, pipeline: str, name: str, train_values, opts: BenchOptions, where, out: Path, echo) -> dict[str, Any]:
    from raytrain.driver.session import ray_session

    runs_storage = (where / "runs").uri
    base_cfg = bench_config(train_values, opts, workers=max(opts.workers), epochs=1, storage=runs_storage, name="probe")
    grad_bytes, params = gradient_bytes(pipe, base_cfg)
    started = time.time()
    measured: dict[str, dict[int, list[dict[str, Any]]]] = {"raytrain": {}, **{b: {} for b in opts.baselines}}

    def baselines(tag: str) -> None:
        for mode in opts.baselines:
            for run in planned if mode == "torchrun" else planned[:1]:
                measured[mode].setdefault(run.workers, []).append(
                    run_template(pipeline, run, opts, out, mode=mode, tag=tag, echo=echo)
                )

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
                planned = plan_runs(train_values, opts, out, num_rows, runs_storage)
            while blocks and blocks[0][0] == "raytrain":
                tag = blocks.pop(0)[1]
                for run in planned:
                    measured["raytrain"].setdefault(run.workers, []).append(run_raytrain(pipe, run, tag, echo))

    runs = [pick_run(measured["raytrain"][run.workers], opts.statistic) for run in planned]
    chosen = {
        mode: [pick_run(results, opts.statistic) for _, results in sorted(by_n.items())]
        for mode, by_n in measured.items()
        if mode != "raytrain"
    }
    cost = {"precision": base_cfg.precision, "peak_tflops": base_cfg.peak_tflops}
    rows = scaling_rows(runs, grad_bytes, opts.link, base_cfg.ddp.bucket_cap_mb, **cost)
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
        "rounds": {
            mode: {str(n): [r["steady_samples_per_s"] for r in results] for n, results in sorted(by_n.items())}
            for mode, by_n in measured.items()
        },
        "baseline_runs": chosen,
    }
    write_bench_files(out, report)
    echo(render_text(report))
    return report


def plan_runs(
    train_values: dict[str, Any], opts: BenchOptions, out: Path, num_rows: int, runs_storage: Any = None
) -> list[PlannedRun]:
    runs_storage = runs_storage or out / "runs"
    planned = []
    for n in opts.workers:
        probe = bench_config(train_values, opts, workers=n, epochs=1, storage=runs_storage, name=f"w{n}")
        plan = resolve_batch_plan(
            n, global_batch_size=probe.global_batch_size, batch_size_per_worker=probe.batch_size_per_worker
        )
        try:
            epochs = epochs_for(num_rows, plan.global_batch_size, opts.warmup_steps, opts.steps)
        except ValueError as exc:
            raise ConfigError([("steps", str(exc))]) from None
        cfg = bench_config(train_values, opts, workers=n, epochs=epochs, storage=runs_storage, name=f"w{n}")
        steady = epochs * steady_steps_per_epoch(num_rows, plan.global_batch_size, opts.warmup_steps)
        planned.append(
            PlannedRun(workers=n, cfg=cfg, batch=plan, epochs=epochs, steady_steps=steady, num_rows=num_rows, out=out)
        )
    return planned


def bench_config(
    train_values: dict[str, Any], opts: BenchOptions, *, workers: int, epochs: int, storage: "Path | str", name: str
) -> TrainConfig:
    values = {k: v for k, v in train_values.items() if k not in BENCH_OWNED}
    # A failure spoils a measurement: none is recovered (run_raytrain refuses a run that
    # recovered one; per-step mode needs room for one replacement to start at all).
    from raytrain.faults import mode_class  # imports Ray: the CLI's parser imports this module

    failures = mode_class(values.get("fault_tolerance")).min_failures
    values.update(workers=workers, epochs=epochs, storage=str(storage), name=name, max_failures=failures)
    values["time_phases"] = True
    if values.get("warmup_steps") is None:
        values["warmup_epochs"] = min(float(values.get("warmup_epochs") or 1.0), float(epochs))
    values["timing_warmup_steps"] = opts.warmup_steps
    return TrainConfig.from_dict(values)


def gradient_bytes(pipe, cfg: TrainConfig) -> tuple[int, int]:
    """Bytes of one set of gradients (trainable parameters) and the parameter count."""
    model = hooks.call(pipe, "build_model", cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in trainable), sum(p.numel() for p in trainable)


def prepare_data(pipe, cfg: TrainConfig, out: Path | None, verbose: bool = False) -> int:
    """Read the training rows (as every raytrain worker does); save them for the baselines
    under OUT/baselines/train.npz when `out` is given. Returns the row count."""
    import logging

    import numpy as np

    from raytrain.data import shards
    from raytrain.data.checks import Schema, load_table
    from raytrain.data.sources import build_datasets, read_probe
    from raytrain.observe.trackers import log_level
    from raytrain.sampled import Sampled

    with log_level("ray.data", logging.INFO if verbose else logging.ERROR):
        dataset = build_datasets(pipe, cfg)["train"]
        if isinstance(dataset, Sampled):
            if out is not None:
                why = "the pipeline's training set is sampled (raytrain.Sampled): the baselines walk a table of rows"
                raise ConfigError([("baseline", f"{why}; bench it without --baseline")])
            return dataset.rows_per_epoch  # an epoch of draws
        if out is None:
            return dataset.count()
        units = shards.split(dataset)
        units = units if not isinstance(units, str) else shards.split(dataset.materialize())
        schema = Schema.of(read_probe(units, "train", skip_nan_rows=False))
        columns = load_table(units, "train", schema, skip_nan_rows=False)["columns"]
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
    if result.summary.get("failures_recovered"):
        raise BenchError(
            f"a worker of the {what} run failed and was replaced during the measurement ({result.run_dir}/"
            "events.jsonl): its timings are not steady; run the bench again"
        )
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
        "flops_per_sample": progress.get("flops_per_sample"),
        "device_name": progress.get("device_name"),
        "goodput": (result.summary.get("goodput") or {}).get("goodput"),
        "run_dir": result.run_dir,
    }
    echo(f"bench: {what}: {measured['steady_samples_per_s']:,.0f} samples/s steady")
    return measured
