"""The Ray side of `raytrain tune`: the Tuner, one ASHA per worker count, the trial
function, and the resources that keep trials from deadlocking.

Train V2's pattern (RAY_NOTES, "Tune with Train V2"): a Tune trial is a small driver
function that fits its own `TorchTrainer` through `raytrain.driver.run.fit`, so a trial trains
exactly like `raytrain train`; a `TuneReportCallback` forwards rank 0's epoch-end reports.

Resources, so that trials never deadlock: a trial driver holds no CPU, only one unit of the
custom `trial_driver` resource (the embedded Ray is started with it); its TorchTrainer
reserves the workers in a placement group of its own; and `max_concurrent_trials` is sized
so that the running trials' workers always fit the cluster at once. ASHA compares a trial
only with trials of the same worker count (one ASHA per count): an epoch of 8 workers takes
fewer, larger steps than an epoch of 1, so their losses after an epoch are not comparable.

What decides lives in `space` (pure), what a sweep is asked for in `options`, what it needs in
`resources`; what the driver reads of each trial in `trials`; what the sweep leaves, in `results`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from raytrain.config import TrainConfig
from raytrain.environ import scoped_env
from raytrain.errors import ConfigError
from raytrain.observe.trackers import log_level
from raytrain.pipeline import Pipeline, load_pipeline
from raytrain.rules.head import EMBEDDED_TRIAL_DRIVER_SLOTS, TRIAL_DRIVER_RESOURCE
from raytrain.rundir.storage import Store
from raytrain.text import is_number, sci
from raytrain.tune.options import SearchSpace, TuneOptions
from raytrain.tune.resources import (
    embedded_cpus,
    max_concurrent_trials,
    trial_cpus,
    trial_driver_resources,
)
from raytrain.tune.results import SUBSTITUTED, SweepResult, sweep_rows, write_sweep_files
from raytrain.tune.space import (
    SweepRun,
    check_trials,
    grace_period,
    plan_sweep,
    sweep_base_config,
    trial_config,
)
from raytrain.tune.trials import console_callback, trial_error, trial_index, trial_name_creator, trial_run

# Train's cleaner frees a stopped trial's workers within seconds, slower on a loaded machine:
# wait up to this long for it before removing what is left (the wait ends as soon as none is).
PG_CLEANUP_WAIT_S = 60.0


# -- the trial (runs in a Tune trial actor) --------------------------------------------------


@dataclass
class _TrialJob:
    """What every trial driver needs; shipped to the trial actors by tune.with_parameters."""

    pipeline: Any  # the spec string (importable on workers) or a Pipeline instance
    base: dict[str, Any]
    runs_dir: str
    metric: str
    mode: str


def _run_trial(config: dict[str, Any], job: _TrialJob) -> None:
    from ray import tune as ray_tune

    from raytrain.driver.run import fit

    point = {**config["point"], **({"lr": config["lr"]} if "lr" in config else {})}
    cfg = trial_config(
        TrainConfig.from_dict(job.base), point, name=ray_tune.get_context().get_trial_name(), storage=job.runs_dir
    )
    fit(job.pipeline, cfg, callbacks=[_report_to_tune(job.metric, job.mode)])


def _report_to_tune(metric: str, mode: str):
    """A TuneReportCallback that forwards epoch-end reports only (mid-epoch checkpoint
    reports carry no validation metrics, and Tune rejects results without `metric`), with a
    non-finite metric (a diverged trial) replaced by the worst finite value: ASHA compares
    with `<`, and a NaN would never be stopped. Such a report says so (SUBSTITUTED), so that
    the results read the metric as missing, as the run's metrics.jsonl has it."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class _EpochReports(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            row = dict(metrics[0])
            if metric not in row:
                return
            if not is_number(row[metric]):
                row[metric] = sys.float_info.max if mode == "min" else -sys.float_info.max
                row[SUBSTITUTED] = metric
            super().after_report(run_context, [row], checkpoint)

    return _EpochReports()


# -- scheduling (driver) ---------------------------------------------------------------------


def _scheduler(options: TuneOptions, epochs: int, grace: int):
    from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler, TrialScheduler

    if not options.early_stop:
        return FIFOScheduler()

    class ASHAPerWorkerCount(FIFOScheduler):
        """One ASHA (keyed to epochs) per worker count: a trial competes only with trials of
        its own size. A trial that reports its last epoch is never stopped: it is finishing
        (writing model.pt and summary.json), and stopping it would lose them."""

        def __init__(self) -> None:
            super().__init__()
            self.groups: dict[int, AsyncHyperBandScheduler] = {}

        metric = property(lambda self: options.metric)  # Tune checks that results carry it

        def set_search_properties(self, metric, mode, **spec) -> bool:
            return not (metric and metric != options.metric) and not (mode and mode != options.mode)

        def _group(self, trial) -> AsyncHyperBandScheduler:
            key = trial.config["point"]["workers"]
            if key not in self.groups:
                self.groups[key] = AsyncHyperBandScheduler(
                    time_attr="epoch",
                    metric=options.metric,
                    mode=options.mode,
                    max_t=epochs,
                    grace_period=grace,
                    reduction_factor=options.reduction_factor,
                    brackets=1,
                    stop_last_trials=False,
                )
            return self.groups[key]

        def on_trial_add(self, tune_controller, trial) -> None:
            self._group(trial).on_trial_add(tune_controller, trial)

        def on_trial_result(self, tune_controller, trial, result) -> str:
            decision = self._group(trial).on_trial_result(tune_controller, trial, result)
            if decision == TrialScheduler.STOP and result.get("epoch", 0) >= epochs:
                return TrialScheduler.CONTINUE
            return decision

        def on_trial_complete(self, tune_controller, trial, result) -> None:
            self._group(trial).on_trial_complete(tune_controller, trial, result)

        def on_trial_remove(self, tune_controller, trial) -> None:
            self._group(trial).on_trial_remove(tune_controller, trial)

        on_trial_error = on_trial_remove

        def debug_string(self) -> str:
            return "ASHA per worker count: " + "; ".join(
                f"{k} workers: {g.debug_string()}" for k, g in sorted(self.groups.items())
            )

    return ASHAPerWorkerCount()


# -- the sweep (driver) ----------------------------------------------------------------------


def tune(
    pipeline: "str | Pipeline",
    cfg: TrainConfig | None = None,
    space: SearchSpace | None = None,
    options: TuneOptions | None = None,
    *,
    echo: Callable[[str], None] | None = None,
) -> SweepResult:
    """Sweep `space` for `pipeline`, every trial a `raytrain train` run with `cfg`'s options.

    Grid points that resolve to the same trial configuration (the rules at the reference
    batch) run once and share the run's results in trials.csv. Raises ConfigError (bad
    configuration or a trial that cannot fit; nothing started). Writes trials.csv, best.yaml
    and trials.png under STORAGE/NAME/."""
    import ray

    from raytrain.data.sources import build_datasets
    from raytrain.driver.session import ray_session, resolve_gpu

    echo = echo or (lambda line: None)
    options = options or TuneOptions()
    space = space or SearchSpace()
    pipe = load_pipeline(pipeline)
    spec = pipeline if isinstance(pipeline, str) else pipe.name
    base = sweep_base_config(cfg or TrainConfig(**pipe.default_config), space, spec)
    points = check_trials(base, space, options)
    runs = plan_sweep(base, points)
    sweep = Store.of(base.storage) / base.name
    if sweep.list():
        raise ConfigError([("name", f"sweep {base.name!r} already exists in {sweep.parent}; choose another --name")])
    worker_counts = sorted({p["workers"] for p in points})

    num_cpus = _embedded_ray_cpus(base, worker_counts)  # a trial too big for this machine fails here
    started = time.time()
    # The sweep's own files are written here (on an object store: locally, then uploaded).
    with sweep.write_locally() as sweep_dir:
        with ray_session(base, num_cpus=num_cpus, resources={TRIAL_DRIVER_RESOURCE: EMBEDDED_TRIAL_DRIVER_SLOTS}):
            use_gpu = resolve_gpu(base)
            resources = ray.cluster_resources()
            total = len(runs) * space.samples
            concurrency = min(
                total,
                max_concurrent_trials(
                    worker_counts,
                    cpus_per_worker=base.cpus_per_worker,
                    cluster_cpus=resources.get("CPU", 0),
                    use_gpu=use_gpu,
                    cluster_gpus=resources.get("GPU", 0),
                    requested=options.max_concurrent_trials,
                ),
            )
            _check_metric_source(pipe, base, options, build_datasets)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            _write_sweep_yaml(sweep_dir, spec, base, space, options, points, runs, concurrency)
            echo(_describe_sweep(spec, base, space, options, points, runs, concurrency, resources, use_gpu, sweep))
            pgs_before = _placement_groups()
            tuner, console = _build_tuner(
                pipeline, base, space, options, runs, concurrency, resources, sweep, total, echo
            )
            # The console gets raytrain's lines, not Tune's: Tune's new output engine prints its own
            # banner and table even at verbose=0 (the legacy one stays silent), and Tune logs each
            # failed trial's whole traceback, which raytrain reports as one line (the cause and the
            # run directory; the traceback stays in tune/<trial>/error.txt). -v keeps Tune's logs.
            quiet = log_level("ray.tune", logging.CRITICAL) if not base.verbose else contextlib.nullcontext()
            with scoped_env({"RAY_AIR_NEW_OUTPUT": "0"}), quiet:
                tuner.fit()
            leaked = _free_leaked_placement_groups(pgs_before, echo)
            wall = time.time() - started
            trials = [trial_run(t, base.epochs, console) for t in sorted(console.trials.values(), key=trial_index)]
            rows, curves = sweep_rows(trials, runs, points, options, sweep, base.epochs)
        result = write_sweep_files(spec, base, options, rows, curves, sweep_dir, wall, leaked, echo, str(sweep))
    best = (sweep / "best.yaml").public_uri if result.best_config_path else None
    return dataclasses.replace(result, sweep_dir=sweep.public_uri, best_config_path=best)


def _write_sweep_yaml(sweep_dir, spec, base, space, options, points, runs, concurrency) -> None:
    from raytrain.rundir import write_yaml

    write_yaml(
        sweep_dir / "sweep.yaml",
        {
            "pipeline": spec,
            "space": dataclasses.asdict(space),
            "options": dataclasses.asdict(options),
            "grace_period_epochs": grace_period(options, points, base.epochs),
            "max_concurrent_trials": concurrency,
            "shared_runs": {run.name: run.rule_names for run in runs if run.shared},
            "trial_config": base.to_dict(),
        },
    )


def _embedded_ray_cpus(base: TrainConfig, worker_counts: list[int]) -> int | None:
    """Logical CPUs for an embedded Ray (None when joining one), checked against the largest
    trial before anything starts."""
    from raytrain.driver.session import will_embed_ray

    if not will_embed_ray(base):
        return None
    cores = os.cpu_count() or 1
    num_cpus = embedded_cpus(trial_cpus(max(worker_counts), base.cpus_per_worker), cores)
    if base.gpu is not True:  # GPU runs are sized by GPUs, known once Ray is up
        max_concurrent_trials(
            worker_counts,
            cpus_per_worker=base.cpus_per_worker,
            cluster_cpus=num_cpus,
            where=f"this machine's embedded Ray ({num_cpus} logical CPUs on {cores} cores)",
        )
    return num_cpus


def _check_metric_source(pipe: Pipeline, base: TrainConfig, options: TuneOptions, build_datasets) -> None:
    if options.metric.startswith("val_") and "val" not in build_datasets(pipe, base):
        why = (
            f"got {options.metric!r}, but pipeline {pipe.name} has no 'val' dataset; use --metric loss, or add a 'val' "
            "dataset to the pipeline"
        )
        raise ConfigError([("metric", why)])


def _build_tuner(pipeline, base, space, options, runs: list[SweepRun], concurrency, resources, sweep, total, echo):
    from ray import tune as ray_tune
    from ray.tune.search import BasicVariantGenerator

    job = _TrialJob(
        pipeline=pipeline,
        base=base.to_dict(),
        runs_dir=(sweep / "trials").uri,
        metric=options.metric,
        mode=options.mode,
    )
    trainable = ray_tune.with_resources(
        ray_tune.with_parameters(_run_trial, job=job), trial_driver_resources(resources)
    )
    # One Tune trial per distinct run: Tune's trial number is the run's index.
    param_space: dict[str, Any] = {"point": ray_tune.grid_search([run.point for run in runs])}
    if space.lr_range:
        param_space["lr"] = ray_tune.loguniform(*space.lr_range)
    console = console_callback(total, base.epochs, options, runs, echo)
    points = [p for run in runs for p in run.points]
    tuner = ray_tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=ray_tune.TuneConfig(
            scheduler=_scheduler(options, base.epochs, grace_period(options, points, base.epochs)),
            # Tune ignores max_concurrent_trials when given a search algorithm: the limit goes here.
            search_alg=BasicVariantGenerator(random_state=base.seed, max_concurrent=concurrency),
            num_samples=space.samples,
            trial_name_creator=trial_name_creator,
            trial_dirname_creator=trial_name_creator,
        ),
        # Tune's own records go under the sweep, through the same file system as the run files.
        run_config=ray_tune.RunConfig(name="tune", **sweep.ray_storage(), verbose=0, callbacks=[console]),
    )
    return tuner, console


def _placement_groups() -> dict[str, str]:
    from ray.util import placement_group_table

    return {pg_id: info.get("state", "") for pg_id, info in placement_group_table().items()}


def _free_leaked_placement_groups(before: dict[str, str], echo: Callable[[str], None]) -> int:
    """Placement groups created during the sweep and still held after it: Train's cleaner
    frees a stopped trial's worker group within seconds (it needs the dashboard, RAY_NOTES);
    whatever is left after PG_CLEANUP_WAIT_S is removed here, and counted."""
    import ray
    from ray.util.placement_group import PlacementGroup

    deadline = time.monotonic() + PG_CLEANUP_WAIT_S
    while True:
        held = [pg for pg, state in _placement_groups().items() if pg not in before and state not in ("REMOVED",)]
        if not held or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for pg_id in held:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    if held:
        echo(
            f"Note: {len(held)} placement group(s) of stopped trials outlived them and were removed now (is the Ray "
            "dashboard up? Train's cleaner needs it)."
        )
    return len(held)


def _describe_sweep(spec, base, space, options, points, runs, concurrency, resources, use_gpu, sweep_dir) -> str:
    axes = [
        "workers " + ",".join(str(w) for w in sorted({p["workers"] for p in points})),
        "lr_scaling " + ",".join(space.lr_scaling),
        "warmup " + ",".join(f"{w:g}" for w in sorted({p["warmup_epochs"] for p in points})),
        (
            f"lr log-uniform {sci(space.lr_range[0])}..{sci(space.lr_range[1])} × {space.samples} per point"
            if space.lr_range
            else "lr " + ",".join(sci(lr) for lr in sorted({p["lr"] for p in points}))
        ),
    ]
    total = len(points) * space.samples
    shared = [run for run in runs if run.shared]
    sharing = (
        f" ({len(runs) * space.samples} runs: "
        + ", ".join(
            f"{run.rule_names} at {run.point['workers']} w, warmup {run.point['warmup_epochs']:g}, lr "
            f"{sci(run.point['lr'])}"
            for run in shared[:3]
        )
        + (f" and {len(shared) - 3} more" if len(shared) > 3 else "")
        + " give the same rate and share one run)"
        if shared
        else ""
    )
    batch = (
        f"global batch {base.global_batch_size}"
        if base.global_batch_size
        else f"{base.batch_size_per_worker} per worker"
    )
    grace = grace_period(options, points, base.epochs)
    stopping = (
        f"ASHA on {options.metric} ({options.mode}) per worker count from epoch {grace}, reduction "
        f"{options.reduction_factor:g}"
        + (
            " (= --epochs: no trial will be stopped early; raise --epochs or lower --grace-period)"
            if grace >= base.epochs
            else ""
        )
        if options.early_stop
        else "no early stopping"
    )
    unit = f"{resources.get('GPU', 0):g} GPUs" if use_gpu else f"{resources.get('CPU', 0):g} CPUs"
    return (
        f"raytrain tune: {base.name} — {total} trials of {spec}{sharing}: {' × '.join(axes)}\n"
        f"Every trial: {base.epochs} epoch{'s' if base.epochs != 1 else ''}, seed {base.seed}, {batch}, reference "
        f"batch {base.reference_batch_size}; {stopping}\n"
        f"{concurrency} trial(s) at a time on {unit}; sweep directory {sweep_dir}"
    )


__all__ = ["tune", "trial_error"]
