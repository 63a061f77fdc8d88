"""`raytrain tune`: sweep the LR scaling rule × warmup × worker count (× lr) on Ray Tune.

Train V2's pattern (RAY_NOTES, "Tune with Train V2"): a Tune trial is a small driver
function that fits its own `TorchTrainer` through `raytrain.trainer.fit`, so a trial trains
exactly like `raytrain train`; a `TuneReportCallback` forwards rank 0's epoch-end reports.

Resources, so that trials never deadlock: a trial driver holds no CPU, only one unit of the
custom `trial_driver` resource (the embedded Ray is started with it); its TorchTrainer
reserves the workers in a placement group of its own; and `max_concurrent_trials` is sized
so that the running trials' workers always fit the cluster at once. ASHA compares a trial
only with trials of the same worker count (one ASHA per count): an epoch of 8 workers takes
fewer, larger steps than an epoch of 1, so their losses after an epoch are not comparable.

Everything that decides (search space, trial configs, concurrency, ranking) is a pure
function; `tune()` acts.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from raytrain import plan as rules
from raytrain.config import LR_RULES, ConfigError, TrainConfig, parse_workers
from raytrain.pipeline import Pipeline, load_pipeline

SWEPT = ("workers", "lr_scaling", "warmup_epochs", "lr")
MODES = ("min", "max")
TRIAL_DRIVER_RESOURCE = "trial_driver"
# Units of `trial_driver` an embedded Ray offers: far more than trials can run at once
# (the limit is max_concurrent_trials, sized from CPUs/GPUs).
EMBEDDED_TRIAL_DRIVER_SLOTS = 1000
# Trial drivers on a cluster without `trial_driver` reserve this much memory instead:
# Tune needs every trial to reserve something, and a CPU would starve the workers.
FALLBACK_DRIVER_MEMORY = 256 * 2**20
# An embedded Ray may offer up to this many logical CPUs per core (as `raytrain train`
# does for small machines); a trial larger than that cannot fit this machine.
LOCAL_OVERSUBSCRIPTION = 2
# Train's cleaner frees a stopped trial's workers within seconds, slower on a loaded machine:
# wait up to this long for it before removing what is left (the wait ends as soon as none is).
PG_CLEANUP_WAIT_S = 60.0


# -- what to sweep ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class SearchSpace:
    """The swept axes; the grid is their product. None: the run configuration's value.

    `lr` is a grid of learning rates; `lr_range` (LO, HI) instead draws `samples` rates
    log-uniformly for every point of the grid.
    """

    workers: list[int] | None = None
    """Worker counts, each a fixed size (elastic MIN:MAX has no place in a comparison)."""
    lr_scaling: list[str] = field(default_factory=lambda: list(LR_RULES))
    """LR scaling rules: linear, sqrt, none (default: all three)."""
    warmup_epochs: list[float] | None = None
    """Warmup lengths in epochs."""
    lr: list[float] | None = None
    """Base learning rates (for the reference batch), as a grid."""
    lr_range: tuple[float, float] | None = None
    """Draw the base learning rate log-uniformly from [LO, HI] instead of a grid."""
    samples: int = 1
    """Learning rates drawn per grid point with `lr_range`."""

    def __post_init__(self) -> None:
        problems = list(_check_space(self))
        if problems:
            raise ConfigError(problems)


@dataclass(kw_only=True)
class TuneOptions:
    """How trials are compared and scheduled."""

    metric: str = "val_loss"
    """Reported metric that ranks trials and drives early stopping."""
    mode: str = "min"
    """min or max: whether lower or higher `metric` is better."""
    early_stop: bool = True
    """ASHA early stopping (per worker count); False runs every trial to the end."""
    grace_period_epochs: int | None = None
    """ASHA never stops a trial before this many epochs. Default: one epoch after the longest
    warmup (before that, a warming-up trial is judged mid-ramp, at a lower rate than its
    rivals), at most the trials' epochs."""
    reduction_factor: float = 2.0
    """ASHA keeps about 1/this of the trials at each rung."""
    target: float | None = None
    """Target value of `metric`: trials.csv gives each trial's time to reach it."""
    max_concurrent_trials: int | None = None
    """At most this many trials at once; default (and cap): as many as fit the cluster."""

    def __post_init__(self) -> None:
        problems = []
        if not self.metric:
            problems.append(("metric", "is empty; give a reported metric, e.g. --metric val_loss"))
        if self.mode not in MODES:
            problems.append(("mode", f"got {self.mode!r}; choose min (lower is better) or max"))
        if self.grace_period_epochs is not None and self.grace_period_epochs < 1:
            problems.append(("grace_period", f"got {self.grace_period_epochs}; must be at least 1 epoch"))
        if not self.reduction_factor > 1:
            problems.append(("reduction_factor", f"got {self.reduction_factor}; must be more than 1, e.g. 2"))
        if self.target is not None and not math.isfinite(self.target):
            problems.append(("target", f"got {self.target}; give a finite value of --metric, e.g. --target 0.15"))
        if self.max_concurrent_trials is not None and self.max_concurrent_trials < 1:
            problems.append(("max_concurrent_trials", f"got {self.max_concurrent_trials}; must be at least 1"))
        if problems:
            raise ConfigError(problems)

    def better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def reached(self, value: float) -> bool:
        return self.target is not None and (value <= self.target if self.mode == "min" else value >= self.target)


def _check_space(s: SearchSpace) -> Iterable[tuple[str, str]]:
    if s.workers is not None:
        if not s.workers:
            yield "workers", "is empty; give worker counts, e.g. --workers 1,2,4"
        for n in s.workers:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                yield "workers", f"got {n!r}; each worker count must be a whole number of at least 1, e.g. --workers 1,2,4"
    if not s.lr_scaling:
        yield "lr_scaling", f"is empty; give rules from {', '.join(LR_RULES)}"
    for rule in s.lr_scaling:
        if rule not in LR_RULES:
            yield "lr_scaling", f"got {rule!r}; choose from {', '.join(LR_RULES)}, e.g. --lr-scaling linear,sqrt"
    for w in s.warmup_epochs or []:
        if not (isinstance(w, (int, float)) and 0 <= w < math.inf):
            yield "warmup_epochs", f"got {w!r}; each warmup must be 0 or more epochs, e.g. --warmup-epochs 0,1"
    if s.warmup_epochs is not None and not s.warmup_epochs:
        yield "warmup_epochs", "is empty; give warmup lengths, e.g. --warmup-epochs 0,1"
    if s.lr is not None and s.lr_range is not None:
        yield "lr_range", "cannot be combined with --lr; give a grid (--lr 1e-4,3e-4) or a range (--lr-range 1e-4:1e-2 --samples 4)"
    for lr in s.lr or []:
        if not (isinstance(lr, (int, float)) and 0 < lr < math.inf):
            yield "lr", f"got {lr!r}; each learning rate must be a positive number, e.g. --lr 1e-4,3e-4"
    if s.lr is not None and not s.lr:
        yield "lr", "is empty; give learning rates, e.g. --lr 1e-4,3e-4"
    if s.lr_range is not None:
        low, high = s.lr_range
        if not 0 < low < high < math.inf:
            yield "lr_range", f"got {low:g}:{high:g}; need 0 < LO < HI, e.g. --lr-range 1e-4:1e-2"
    if isinstance(s.samples, bool) or not isinstance(s.samples, int) or s.samples < 1:
        yield "samples", f"got {s.samples!r}; must be a whole number of at least 1"
    elif s.samples > 1 and s.lr_range is None:
        yield "samples", f"got {s.samples} without --lr-range; a grid has nothing to draw: add --lr-range LO:HI or drop --samples"


def parse_list(text: Any, kind: str, option: str) -> list[Any]:
    """`"1,2,4"` -> [1, 2, 4] (`kind` int, float or str); a YAML list or a single value -> a
    list. Duplicates dropped, order kept. Raises ConfigError naming `option` and the bad item."""
    convert, described = _KINDS[kind]
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    values, problems = [], []
    for item in items:
        raw = str(item).strip()
        if not raw:
            problems.append((option, f"has an empty item in {_show(text)}; give a comma-separated list of {described}"))
            continue
        try:
            value = convert(raw)
        except ValueError:
            problems.append((option, f"got {raw!r} in {_show(text)}; give a comma-separated list of {described}"))
            continue
        if value not in values:
            values.append(value)
    if problems:
        raise ConfigError(problems)
    return values


def _int(text: str) -> int:
    if text.lstrip("+").isdigit():
        return int(text)
    raise ValueError(text)


_KINDS: dict[str, tuple[Callable[[str], Any], str]] = {
    "int": (_int, "whole numbers, e.g. 1,2,4"),
    "float": (float, "numbers, e.g. 1e-4,3e-4"),
    "str": (str, "names, e.g. linear,sqrt"),
}


def _show(text: Any) -> str:
    return repr(",".join(map(str, text)) if isinstance(text, (list, tuple)) else str(text))


def parse_search_space(
    *,
    workers: Any = None,
    lr_scaling: Any = None,
    warmup_epochs: Any = None,
    lr: Any = None,
    lr_range: str | None = None,
    samples: int | None = None,
) -> SearchSpace:
    """The command line's axes (comma-separated strings, or lists from YAML) as a SearchSpace.
    Every problem of every axis in one ConfigError."""
    values: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for name, raw, kind in (("workers", workers, "int"), ("lr_scaling", lr_scaling, "str"), ("warmup_epochs", warmup_epochs, "float"), ("lr", lr, "float")):
        if raw is None:
            continue
        if name == "workers" and any(":" in str(item) for item in (raw if isinstance(raw, (list, tuple)) else [raw])):
            problems.append(("workers", f"got {_show(raw)}; a sweep compares fixed worker counts, not elastic MIN:MAX ranges: give counts, e.g. --workers 1,2,4"))
            continue
        try:
            values[name] = parse_list(raw, kind, name)
        except ConfigError as exc:
            problems += exc.problems
    if lr_range is not None:
        parts = str(lr_range).split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            values["lr_range"] = (float(parts[0]), float(parts[1]))
        except ValueError:
            problems.append(("lr_range", f"got {lr_range!r}; give LO:HI, e.g. --lr-range 1e-4:1e-2"))
    if samples is not None:
        values["samples"] = samples
    if problems:
        raise ConfigError(problems)
    return SearchSpace(**values)


# -- the trials ------------------------------------------------------------------------------


def grid_points(space: SearchSpace, cfg: TrainConfig) -> list[dict[str, Any]]:
    """The grid's points in trial order: workers, then rule, warmup, lr (the last varies fastest).
    With `lr_range` the points carry no lr: Tune draws it."""
    workers = space.workers if space.workers is not None else [cfg.max_workers]
    warmups = space.warmup_epochs if space.warmup_epochs is not None else [cfg.warmup_epochs]
    lrs: list[float | None] = [None] if space.lr_range else (space.lr if space.lr is not None else [cfg.lr])
    points = []
    for n, rule, warmup, lr in itertools.product(workers, space.lr_scaling, warmups, lrs):
        point = {"workers": n, "lr_scaling": rule, "warmup_epochs": float(warmup)}
        if lr is not None:
            point["lr"] = float(lr)
        points.append(point)
    return points


def sweep_base_config(cfg: TrainConfig, space: SearchSpace, pipeline_name: str) -> TrainConfig:
    """What every trial shares: the run options with the name resolved and the reference
    batch frozen once, at the largest worker count (as an elastic `raytrain train` does),
    so that every trial scales the same base lr from the same reference."""
    problems = []
    if cfg.resume:
        problems.append(("resume", "a sweep cannot resume; drop --resume (each sweep is new: choose a new --name)"))
    if space.workers is None:
        low, high = parse_workers(cfg.workers)
        if low != high or high == 0:
            problems.append(("workers", f"got {cfg.workers!r}; a sweep compares fixed worker counts (at least 1): give them, e.g. --workers 1,2,4"))
    if problems:
        raise ConfigError(problems)
    workers = space.workers if space.workers is not None else [cfg.max_workers]
    changes: dict[str, Any] = {"workers": max(workers)}
    if not cfg.name:
        stem = pipeline_name.split(":")[-1].split(".")[-1].lower() or "run"
        changes["name"] = f"{stem}-tune-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.reference_batch_size is None:
        changes["reference_batch_size"] = rules.default_reference_batch_size(
            max(workers), global_batch_size=cfg.global_batch_size, batch_size_per_worker=cfg.batch_size_per_worker
        )
    return dataclasses.replace(cfg, **changes)


def trial_config(base: TrainConfig, point: dict[str, Any], *, name: str | None = None, storage: str | None = None) -> TrainConfig:
    """One trial's TrainConfig: the shared base with the point's values."""
    values = {**base.to_dict(), **point}
    if name is not None:
        values["name"] = name
    if storage is not None:
        values["storage"] = storage
    return TrainConfig.from_dict(values)


def check_trials(base: TrainConfig, space: SearchSpace, options: TuneOptions) -> list[dict[str, Any]]:
    """Build every trial's configuration before anything starts; one ConfigError with every
    distinct problem (e.g. a warmup longer than the run). Returns the grid points."""
    points = grid_points(space, base)
    lrs = list(space.lr_range) if space.lr_range else [None]
    problems: list[tuple[str, str]] = []
    for point, lr in itertools.product(points, lrs):
        try:
            trial_config(base, {**point, **({"lr": lr} if lr is not None else {})})
        except ConfigError as exc:
            problems += [p for p in exc.problems if p not in problems]
    if options.early_stop and options.grace_period_epochs is not None and options.grace_period_epochs > base.epochs:
        problems.append(("grace_period", f"got {options.grace_period_epochs} epochs, longer than the {base.epochs} epochs of each trial; lower it or raise --epochs"))
    if problems:
        raise ConfigError(problems)
    return points


def grace_period(options: TuneOptions, points: list[dict[str, Any]], epochs: int) -> int:
    """ASHA's grace period in epochs: as given, else one epoch after the longest warmup,
    at most `epochs` (then no trial is stopped before its last epoch)."""
    if options.grace_period_epochs is not None:
        return options.grace_period_epochs
    longest = max((p["warmup_epochs"] for p in points), default=0.0)
    return min(epochs, math.ceil(longest) + 1)


def trial_name(index: int, point: dict[str, Any]) -> str:
    """`03-w2-sqrt-wu1-lr1.0e-3`: the trial's run directory under trials/."""
    return f"{index:02d}-w{point['workers']}-{point['lr_scaling']}-wu{point['warmup_epochs']:g}-lr{_sci(point['lr'])}"


def _sci(value: float) -> str:
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# -- resources -------------------------------------------------------------------------------


def trial_cpus(workers: int, cpus_per_worker: float) -> float:
    return workers * cpus_per_worker


def embedded_cpus(largest_trial_cpus: float, cpu_count: int) -> int:
    """Logical CPUs of an embedded Ray for a sweep: the machine's cores, or up to
    LOCAL_OVERSUBSCRIPTION× that when the largest trial (plus 2 for Ray itself) needs it,
    as `raytrain train` oversubscribes a small machine."""
    wanted = math.ceil(largest_trial_cpus) + 2
    return max(cpu_count, min(wanted, LOCAL_OVERSUBSCRIPTION * cpu_count))


def max_concurrent_trials(
    worker_counts: Sequence[int],
    *,
    cpus_per_worker: float,
    cluster_cpus: float,
    use_gpu: bool = False,
    cluster_gpus: float = 0,
    requested: int | None = None,
    where: str = "the cluster",
) -> int:
    """How many trials may run at once so that their workers always fit together.

    Sized for the largest trial (trials of any mix of sizes then fit). Raises ConfigError
    when the largest trial can never fit `where`."""
    largest = max(worker_counts)
    need_cpus = trial_cpus(largest, cpus_per_worker)
    fits = math.floor(cluster_cpus / need_cpus + 1e-9)
    problems = []
    if fits < 1:
        most = math.floor(cluster_cpus / cpus_per_worker + 1e-9)
        problems.append((
            "workers",
            f"got {largest} in {','.join(map(str, worker_counts))}: a trial of {largest} workers × {cpus_per_worker:g} CPU "
            f"needs {need_cpus:g} CPUs, but {where} has {cluster_cpus:g}; drop worker counts above {most} from --workers, "
            "lower --cpus-per-worker, or run on a bigger cluster (--address)",
        ))
    if use_gpu:
        gpu_fits = math.floor(cluster_gpus / largest + 1e-9)
        if gpu_fits < 1:
            problems.append((
                "workers",
                f"got {largest} in {','.join(map(str, worker_counts))}: a trial of {largest} GPU workers needs {largest} GPUs, "
                f"but {where} has {cluster_gpus:g}; drop worker counts above {int(cluster_gpus)} from --workers, or run on "
                "a bigger cluster (--address)",
            ))
        fits = min(fits, gpu_fits)
    if problems:
        raise ConfigError(problems)
    return min(fits, requested) if requested else fits


def trial_driver_resources(cluster_resources: dict[str, float]) -> dict[str, float]:
    """What a trial's driver reserves: no CPU (its TorchTrainer's workers take those), one
    unit of `trial_driver` where the cluster offers it, else a little memory."""
    if cluster_resources.get(TRIAL_DRIVER_RESOURCE, 0) >= 1:
        return {"CPU": 0, TRIAL_DRIVER_RESOURCE: 1}
    return {"CPU": 0, "memory": FALLBACK_DRIVER_MEMORY}


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
    from ray import tune

    from raytrain.trainer import fit

    point = {**config["point"], **({"lr": config["lr"]} if "lr" in config else {})}
    cfg = trial_config(TrainConfig.from_dict(job.base), point, name=tune.get_context().get_trial_name(), storage=job.runs_dir)
    fit(job.pipeline, cfg, callbacks=[_report_to_tune(job.metric, job.mode)])


def _report_to_tune(metric: str, mode: str):
    """A TuneReportCallback that forwards epoch-end reports only (mid-epoch checkpoint
    reports carry no validation metrics, and Tune rejects results without `metric`), with a
    non-finite metric (a diverged trial) replaced by the worst finite value: ASHA compares
    with `<`, and a NaN would never be stopped."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class _EpochReports(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            row = dict(metrics[0])
            if metric not in row:
                return
            value = row[metric]
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                row[metric] = sys.float_info.max if mode == "min" else -sys.float_info.max
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
            self._metric, self._mode = options.metric, options.mode
            self.groups: dict[int, AsyncHyperBandScheduler] = {}

        def set_search_properties(self, metric, mode, **spec) -> bool:
            return not (metric and metric != self._metric) and not (mode and mode != self._mode)

        def _group(self, trial) -> AsyncHyperBandScheduler:
            key = trial.config["point"]["workers"]
            if key not in self.groups:
                self.groups[key] = AsyncHyperBandScheduler(
                    time_attr="epoch", metric=options.metric, mode=options.mode, max_t=epochs,
                    grace_period=grace, reduction_factor=options.reduction_factor,
                    brackets=1, stop_last_trials=False,
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

        def on_trial_error(self, tune_controller, trial) -> None:
            self._group(trial).on_trial_remove(tune_controller, trial)

        def on_trial_remove(self, tune_controller, trial) -> None:
            self._group(trial).on_trial_remove(tune_controller, trial)

        def debug_string(self) -> str:
            return "ASHA per worker count: " + "; ".join(f"{k} workers: {g.debug_string()}" for k, g in sorted(self.groups.items()))

    return ASHAPerWorkerCount()


def _console_callback(total: int, epochs: int, options: TuneOptions, echo: Callable[[str], None]):
    """Tune callback (driver side): one line per trial epoch and per trial end; keeps each
    trial's wall time and how it ended."""
    from ray.tune import Callback

    class Console(Callback):
        def __init__(self) -> None:
            self.started: dict[str, float] = {}
            self.ended: dict[str, float] = {}
            self.errors: dict[str, str] = {}
            self.trials: dict[str, Any] = {}  # trial id -> Trial, for the rows of trials.csv

        def on_experiment_end(self, trials, **info):
            self.trials.update((trial.trial_id, trial) for trial in trials)

        def _label(self, trial) -> str:
            return f"[{trial_index(trial) + 1:>{len(str(total))}}/{total} {_describe_point(trial_point(trial))}]"

        def on_trial_start(self, iteration, trials, trial, **info):
            self.started[trial.trial_id] = time.time()
            self.trials[trial.trial_id] = trial

        def on_trial_result(self, iteration, trials, trial, result, **info):
            metrics = "  ".join(f"{k} {result[k]:.4f}" for k in sorted(result) if k.startswith("val_") and isinstance(result[k], (int, float)))
            echo(f"{self._label(trial)} epoch {result.get('epoch')}/{epochs}  {metrics}")

        def on_trial_complete(self, iteration, trials, trial, **info):
            self.ended[trial.trial_id] = time.time()
            last = trial.last_result or {}
            took = self.ended[trial.trial_id] - self.started.get(trial.trial_id, self.ended[trial.trial_id])
            if last.get("epoch", 0) < epochs:
                echo(f"{self._label(trial)} stopped early by ASHA after epoch {last.get('epoch', 0)} ({took:.0f} s)")
            else:
                value = last.get(options.metric)
                shown = f"{options.metric} {value:.4f}" if isinstance(value, (int, float)) else ""
                echo(f"{self._label(trial)} finished: {shown} ({took:.0f} s)")

        def on_trial_error(self, iteration, trials, trial, **info):
            self.ended[trial.trial_id] = time.time()
            message = _first_line(_read_error(trial) or "failed")
            self.errors[trial.trial_id] = message
            echo(f"{self._label(trial)} FAILED: {message} (run files: trials/{_trial_name_creator(trial)}/)")

    return Console()


def trial_index(trial) -> int:
    """0-based position in the grid, from Tune's trial id (`<experiment>_00003`)."""
    return int(str(trial.trial_id).rsplit("_", 1)[-1])


def trial_point(trial) -> dict[str, Any]:
    return {**trial.config["point"], **({"lr": trial.config["lr"]} if "lr" in trial.config else {})}


def _trial_name_creator(trial) -> str:
    return trial_name(trial_index(trial), trial_point(trial))


def _describe_point(point: dict[str, Any]) -> str:
    return f"{point['workers']}w {point['lr_scaling']} warmup {point['warmup_epochs']:g} lr {_sci(point['lr'])}"


def _read_error(trial) -> str | None:
    """The trial's exception as Tune stored it (a RunFailed from fit, wrapped by Ray)."""
    with contextlib.suppress(Exception):
        error = trial.get_pickled_error()
        if error is not None:
            return str(error)
    with contextlib.suppress(Exception):
        if trial.error_file and os.path.exists(trial.error_file):
            return Path(trial.error_file).read_text()
    return None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    useful = [line[line.index("The run failed"):] for line in lines if "The run failed" in line]
    return (useful or lines[-1:] or ["failed"])[0][:400]


# -- the sweep (driver) ----------------------------------------------------------------------


@dataclass
class SweepResult:
    """What `tune()` returns."""

    sweep_dir: str
    trials: list[dict[str, Any]]
    """One row per trial, as in trials.csv."""
    best: dict[str, Any] | None
    """The winning row (best final metric among finished trials); None if none finished."""
    best_per_workers: dict[int, dict[str, Any]]
    best_config_path: str | None
    wall_time_s: float
    leaked_placement_groups: int


def tune(
    pipeline: "str | Pipeline",
    cfg: TrainConfig | None = None,
    space: SearchSpace | None = None,
    options: TuneOptions | None = None,
    *,
    echo: Callable[[str], None] | None = None,
) -> SweepResult:
    """Sweep `space` for `pipeline`, every trial a `raytrain train` run with `cfg`'s options.

    Raises ConfigError (bad configuration or a trial that cannot fit; nothing started).
    Writes trials.csv, best.yaml and trials.png under STORAGE/NAME/."""
    import ray

    from raytrain.trainer import build_datasets, ray_session, resolve_gpu, write_yaml

    echo = echo or (lambda line: None)
    options = options or TuneOptions()
    space = space or SearchSpace()
    pipe = load_pipeline(pipeline)
    spec = pipeline if isinstance(pipeline, str) else pipe.name
    base = sweep_base_config(cfg or TrainConfig(**pipe.default_config), space, spec)
    points = check_trials(base, space, options)
    sweep_dir = Path(base.storage) / base.name
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        raise ConfigError([("name", f"sweep {base.name!r} already exists in {base.storage}; choose another --name")])
    worker_counts = sorted({p["workers"] for p in points})

    num_cpus = _embedded_ray_cpus(base, worker_counts)  # a trial too big for this machine fails here
    started = time.time()
    with ray_session(base, num_cpus=num_cpus, resources={TRIAL_DRIVER_RESOURCE: EMBEDDED_TRIAL_DRIVER_SLOTS}):
        use_gpu = resolve_gpu(base)
        resources = ray.cluster_resources()
        total = len(points) * space.samples
        concurrency = min(total, max_concurrent_trials(
            worker_counts, cpus_per_worker=base.cpus_per_worker, cluster_cpus=resources.get("CPU", 0), use_gpu=use_gpu,
            cluster_gpus=resources.get("GPU", 0), requested=options.max_concurrent_trials,
        ))
        _check_metric_source(pipe, base, options, build_datasets)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_yaml(sweep_dir / "sweep.yaml", {
            "pipeline": spec, "space": dataclasses.asdict(space), "options": dataclasses.asdict(options),
            "grace_period_epochs": grace_period(options, points, base.epochs), "max_concurrent_trials": concurrency,
            "trial_config": base.to_dict(),
        })
        echo(_describe_sweep(spec, base, space, options, points, total, concurrency, resources, use_gpu, sweep_dir))
        pgs_before = _placement_groups()
        tuner, console = _build_tuner(pipeline, base, space, options, points, concurrency, resources, sweep_dir, total, echo)
        with _quiet_tune(base.verbose):
            tuner.fit()
        leaked = _free_leaked_placement_groups(pgs_before, echo)
        wall = time.time() - started
        rows = [_trial_row(t, base, options, sweep_dir, console) for t in sorted(console.trials.values(), key=trial_index)]
    return _write_outputs(spec, base, options, rows, sweep_dir, wall, leaked, echo)


def _embedded_ray_cpus(base: TrainConfig, worker_counts: list[int]) -> int | None:
    """Logical CPUs for an embedded Ray (None when joining one), checked against the largest
    trial before anything starts."""
    import ray

    if ray.is_initialized() or base.address or os.environ.get("RAY_ADDRESS"):
        return None
    cores = os.cpu_count() or 1
    num_cpus = embedded_cpus(trial_cpus(max(worker_counts), base.cpus_per_worker), cores)
    if base.gpu is not True:  # GPU runs are sized by GPUs, known once Ray is up
        max_concurrent_trials(worker_counts, cpus_per_worker=base.cpus_per_worker, cluster_cpus=num_cpus,
                              where=f"this machine's embedded Ray ({num_cpus} logical CPUs on {cores} cores)")
    return num_cpus


def _check_metric_source(pipe: Pipeline, base: TrainConfig, options: TuneOptions, build_datasets) -> None:
    if options.metric.startswith("val_") and "val" not in build_datasets(pipe, base):
        raise ConfigError([("metric", f"got {options.metric!r}, but pipeline {pipe.name} has no 'val' dataset; use --metric loss, or add a 'val' dataset to the pipeline")])


def _build_tuner(pipeline, base, space, options, points, concurrency, resources, sweep_dir, total, echo):
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    job = _TrialJob(pipeline=pipeline, base=base.to_dict(), runs_dir=str(sweep_dir / "trials"), metric=options.metric, mode=options.mode)
    trainable = tune.with_resources(tune.with_parameters(_run_trial, job=job), trial_driver_resources(resources))
    param_space: dict[str, Any] = {"point": tune.grid_search(points)}
    if space.lr_range:
        param_space["lr"] = tune.loguniform(*space.lr_range)
    console = _console_callback(total, base.epochs, options, echo)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            scheduler=_scheduler(options, base.epochs, grace_period(options, points, base.epochs)),
            # Tune ignores max_concurrent_trials when given a search algorithm: the limit goes here.
            search_alg=BasicVariantGenerator(random_state=base.seed, max_concurrent=concurrency),
            num_samples=space.samples,
            trial_name_creator=_trial_name_creator,
            trial_dirname_creator=_trial_name_creator,
        ),
        run_config=tune.RunConfig(name="tune", storage_path=str(sweep_dir), verbose=0, callbacks=[console]),
    )
    return tuner, console


@contextlib.contextmanager
def _quiet_tune(verbose: bool):
    """The console gets raytrain's lines, not Tune's: Tune's new output engine prints its own
    banner and table even at verbose=0 (the legacy one stays silent), and Tune logs each failed
    trial's whole traceback, which raytrain reports as one line (the cause and the run
    directory; the traceback stays in tune/<trial>/error.txt). -v keeps Tune's logs."""
    import logging

    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    tune_logger = logging.getLogger("ray.tune")
    level = tune_logger.level
    if not verbose:
        tune_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        tune_logger.setLevel(level)
        if before is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


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
        echo(f"Note: {len(held)} placement group(s) of stopped trials outlived them and were removed now (is the Ray dashboard up? Train's cleaner needs it).")
    return len(held)


# -- results -----------------------------------------------------------------------------


def _trial_row(trial, base, options, sweep_dir, console) -> dict[str, Any]:
    point = trial_point(trial)
    name = trial_name(trial_index(trial), point)
    run_dir = sweep_dir / "trials" / name
    reported = (trial.last_result or {}).get("epoch", 0) or 0
    if trial.status == "ERROR":
        status = "failed"
    elif trial.status != "TERMINATED":
        status = str(trial.status).lower()  # never ran: the sweep was interrupted
    elif reported < base.epochs:
        status = "stopped"
    else:
        status = "finished"
    # A stopped trial may have trained on for a moment before it was stopped: its result is
    # what ASHA judged, the epochs reported to Tune.
    horizon = reported if status == "stopped" else base.epochs
    started = console.started.get(trial.trial_id)
    ended = console.ended.get(trial.trial_id)
    if status == "stopped":
        mark_stopped(run_dir, trial_config(base, point, name=name, storage=str(run_dir.parent)), reported, started, ended)
    summary = trial_summary(run_dir, options, horizon)
    row = {
        "trial": name,
        "workers": point["workers"],
        "lr_scaling": point["lr_scaling"],
        "warmup_epochs": point["warmup_epochs"],
        "lr": point["lr"],
        **summary.pop("metrics"),
        "status": status,
        **summary,
        "wall_time_s": round(ended - started, 1) if started and ended else None,
        "error": (console.errors.get(trial.trial_id) or _first_line(_read_error(trial) or "failed")) if status == "failed" else "",
        "run_dir": str(run_dir),
    }
    return row


def mark_stopped(run_dir: Path, cfg: TrainConfig, epoch: int, started: float | None, ended: float | None) -> None:
    """A trial stopped by ASHA ends with its actor and Train controller killed: its run has no
    summary.json, or one that records the kill as a failure ("actor died"). Say what happened."""
    from raytrain.trainer import write_summary

    path = run_dir / "summary.json"
    with contextlib.suppress(OSError, ValueError):
        if not path.exists():
            write_summary(run_dir, cfg, None, RuntimeError("stopped by ASHA"), started or time.time())
            if started and ended:
                summary = json.loads(path.read_text())
                summary["wall_time_s"] = round(ended - started, 3)
                path.write_text(json.dumps(summary, indent=2) + "\n")
        summary = json.loads(path.read_text())
        summary.pop("error", None)
        summary.update(status="stopped", stopped_by="ASHA", stopped_after_epoch=epoch)
        path.write_text(json.dumps(summary, indent=2) + "\n")


def trial_summary(run_dir: Path, options: TuneOptions, horizon: int) -> dict[str, Any]:
    """From a trial's metrics.jsonl and events.jsonl: final and best (by `metric`) validation
    metrics within the first `horizon` epochs, and the training time to `target`."""
    from raytrain.trainer import read_jsonl

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("epoch_end") and r.get("epoch", 0) <= horizon]
    events = read_jsonl(run_dir / "events.jsonl")
    start = next((e["time"] for e in events if e.get("kind") == "plan"), None)
    names = sorted({k for r in rows for k in r if k.startswith("val_")} | {options.metric})
    scored = [r for r in rows if _finite(r.get(options.metric))]
    best = None
    for r in scored:
        if best is None or options.better(r[options.metric], best[options.metric]):
            best = r
    final = rows[-1] if rows else {}
    metrics = {f"final_{n}": final.get(n) for n in names}
    metrics.update({f"best_{n}": (best or {}).get(n) for n in names})
    hit = next((r for r in scored if options.reached(r[options.metric])), None)
    return {
        "metrics": metrics,
        "best_epoch": best["epoch"] if best else None,
        "epochs": final.get("epoch", 0),
        "global_batch_size": final.get("global_batch_size"),
        "epochs_to_target": hit["epoch"] if hit else None,
        "time_to_target_s": round(hit["time_s"] - start, 2) if hit and start else None,
    }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def rank_rows(rows: list[dict[str, Any]], options: TuneOptions) -> list[dict[str, Any]]:
    """Finished trials, best first: with a target, the fewest epochs to reach it first; then
    the best final metric."""
    key = f"final_{options.metric}"
    done = [r for r in rows if r["status"] == "finished" and _finite(r.get(key))]
    sign = 1 if options.mode == "min" else -1
    return sorted(done, key=lambda r: (r.get("epochs_to_target") or math.inf if options.target is not None else 0, sign * r[key]))


def best_per_worker_count(rows: list[dict[str, Any]], options: TuneOptions) -> dict[int, dict[str, Any]]:
    best: dict[int, dict[str, Any]] = {}
    for row in rank_rows(rows, options):
        best.setdefault(row["workers"], row)
    return dict(sorted(best.items()))


def best_config(spec: str, base: TrainConfig, row: dict[str, Any]) -> dict[str, Any]:
    """The winning trial's configuration for `raytrain train --config`: `pipeline:` first,
    no name (a new run) and no resume."""
    values = trial_config(base, {k: row[k] for k in SWEPT}).to_dict()
    for key in ("name", "resume", "address", "verbose"):
        values.pop(key, None)
    return {"pipeline": spec, **values}


def _write_outputs(spec, base, options, rows, sweep_dir, wall, leaked, echo) -> SweepResult:
    from raytrain.trainer import write_yaml

    write_csv(sweep_dir / "trials.csv", rows)
    ranked = rank_rows(rows, options)
    best = min(ranked, key=lambda r: (1 if options.mode == "min" else -1) * r[f"final_{options.metric}"]) if ranked else None
    best_path = None
    if best is not None:
        best_path = sweep_dir / "best.yaml"
        write_yaml(best_path, best_config(spec, base, best))
    plot_trials(sweep_dir / "trials.png", rows, base.epochs, options)
    per_workers = best_per_worker_count(rows, options)
    for line in closing_table(rows, per_workers, best, options, wall, sweep_dir, best_path):
        echo(line)
    return SweepResult(
        sweep_dir=str(sweep_dir),
        trials=rows,
        best=best,
        best_per_workers=per_workers,
        best_config_path=str(best_path) if best_path else None,
        wall_time_s=round(wall, 1),
        leaked_placement_groups=leaked,
    )


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Columns: the trial and its swept values, the final then the best metrics, the rest."""
    seen: list[str] = []
    for row in rows:
        seen += [k for k in row if k not in seen]
    metrics = sorted(k for k in seen if k.startswith("final_")) + sorted(k for k in seen if k.startswith("best_") and k != "best_epoch")
    lead = ["trial", *SWEPT]
    columns = lead + metrics + [k for k in seen if k not in lead and k not in metrics]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})


def closing_table(rows, per_workers, best, options, wall, sweep_dir, best_path) -> list[str]:
    """The console's last lines: per worker count, the best (rule, warmup) and its time to target."""
    metric = options.metric
    counts = {s: sum(r["status"] == s for r in rows) for s in ("finished", "stopped", "failed")}
    target = f"; target {metric} {'≤' if options.mode == 'min' else '≥'} {options.target:g}" if options.target is not None else ""
    ranking = "fewest epochs to target, then " if options.target is not None else ""
    lines = [
        "",
        f"Best per worker count ({ranking}final {metric}, {options.mode}; finished trials{target}):",
        f"  {'workers':>7}  {'lr_scaling':<16}  {'warmup':>6}  {'lr':>7}  {metric:>10}  {'time to target':<18}",
    ]
    for workers in sorted({r["workers"] for r in rows}):
        row = per_workers.get(workers)
        if row is None:
            lines.append(f"  {workers:>7}  no trial finished")
            continue
        lines.append(
            f"  {workers:>7}  {tied_rules(rows, row, metric):<16}  {row['warmup_epochs']:>6g}  {_sci(row['lr']):>7}  "
            f"{row[f'final_{metric}']:>10.4f}  {_target_text(row, options):<18}"
        )
    lines.append(
        f"{len(rows)} trials in {wall:.0f} s: {counts['finished']} finished, {counts['stopped']} stopped early by ASHA, "
        f"{counts['failed']} failed. Files in {sweep_dir}: trials.csv, trials.png" + (", best.yaml" if best_path else "")
    )
    if best is not None:
        lines.append(
            f"Best: {_workers(best['workers'])}, {best['lr_scaling']}, warmup {best['warmup_epochs']:g}, lr {_sci(best['lr'])} "
            f"({metric} {best[f'final_{metric}']:.4f}); train it: raytrain train --config {best_path}"
        )
    else:
        lines.append("No trial finished: no best.yaml. See trials.csv (status, error) and the trials/ run directories.")
    return lines


def tied_rules(rows: list[dict[str, Any]], row: dict[str, Any], metric: str) -> str:
    """`linear=sqrt=none` when finished trials of the same count, warmup and lr ended on the
    same `metric` as `row` (at the reference batch the rules coincide: same run, same seed)."""
    same = [
        r["lr_scaling"] for r in rows
        if r["status"] == "finished" and (r["workers"], r["warmup_epochs"], r["lr"]) == (row["workers"], row["warmup_epochs"], row["lr"])
        and _finite(r.get(f"final_{metric}")) and abs(r[f"final_{metric}"] - row[f"final_{metric}"]) <= 1e-9 * max(1.0, abs(row[f"final_{metric}"]))
    ]
    return "=".join(dict.fromkeys([row["lr_scaling"], *same]))


def _workers(count: int) -> str:
    return f"{count} worker{'s' if count != 1 else ''}"


def _target_text(row: dict[str, Any], options: TuneOptions) -> str:
    if options.target is None:
        return "— (no --target)"
    if row.get("epochs_to_target") is None:
        return "not reached"
    seconds = row.get("time_to_target_s")
    return (f"{seconds:.1f} s" if seconds is not None else "?") + f" (epoch {row['epochs_to_target']})"


def plot_trials(path: Path, rows: list[dict[str, Any]], epochs: int, options: TuneOptions) -> None:
    """Validation `metric` per trial vs epoch: one panel per worker count, colour = lr
    scaling rule, line style = warmup, marker = base lr; a trial stopped by ASHA ends with ×.
    Drawn on matplotlib's Agg canvas directly (no pyplot, no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from raytrain.trainer import read_jsonl

    counts = sorted({r["workers"] for r in rows}) or [1]
    fig = Figure(figsize=(4.2 * len(counts) + 1.5, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(counts), sharey=True, squeeze=False)
    colors = {"linear": "tab:blue", "sqrt": "tab:orange", "none": "tab:green"}
    warmups = sorted({r["warmup_epochs"] for r in rows})
    styles = dict(zip(warmups, ["-", "--", ":", "-."] * 4))
    lrs = sorted({r["lr"] for r in rows})
    markers = dict(zip(lrs, "osD^vP*X<>" * (len(lrs) // 10 + 1)))
    positive = True
    for ax, workers in zip(axes[0], counts):
        for row in (r for r in rows if r["workers"] == workers):
            horizon = row["epochs"] or 0
            points = [
                (m["epoch"], m[options.metric])
                for m in read_jsonl(Path(row["run_dir"]) / "metrics.jsonl")
                if m.get("epoch_end") and m.get("epoch", 0) <= horizon and _finite(m.get(options.metric))
            ]
            if not points:
                continue
            xs, ys = zip(*points)
            positive = positive and min(ys) > 0
            label = f"{row['lr_scaling']}, warmup {row['warmup_epochs']:g}" + (f", lr {_sci(row['lr'])}" if len(lrs) > 1 else "")
            ax.plot(xs, ys, styles[row["warmup_epochs"]], color=colors.get(row["lr_scaling"]), marker=markers[row["lr"]], markersize=4, label=label)
            if row["status"] == "stopped":
                ax.plot(xs[-1:], ys[-1:], "x", color="black", markersize=8)
        if options.target is not None:
            ax.axhline(options.target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(_workers(workers))
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0.8, epochs + 0.2)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, handlelength=3)
    axes[0][0].set_ylabel(options.metric)
    if positive:
        axes[0][0].set_yscale("log")
    fig.suptitle(f"{options.metric} per trial (× = stopped by ASHA)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _describe_sweep(spec, base, space, options, points, total, concurrency, resources, use_gpu, sweep_dir) -> str:
    axes = [
        "workers " + ",".join(str(w) for w in sorted({p["workers"] for p in points})),
        "lr_scaling " + ",".join(space.lr_scaling),
        "warmup " + ",".join(f"{w:g}" for w in sorted({p["warmup_epochs"] for p in points})),
        (f"lr log-uniform {_sci(space.lr_range[0])}..{_sci(space.lr_range[1])} × {space.samples} per point" if space.lr_range
         else "lr " + ",".join(_sci(lr) for lr in sorted({p["lr"] for p in points}))),
    ]
    batch = f"global batch {base.global_batch_size}" if base.global_batch_size else f"{base.batch_size_per_worker} per worker"
    grace = grace_period(options, points, base.epochs)
    stopping = (
        f"ASHA on {options.metric} ({options.mode}) per worker count from epoch {grace}, reduction {options.reduction_factor:g}"
        + (" (= --epochs: no trial will be stopped early; raise --epochs or lower --grace-period)" if grace >= base.epochs else "")
        if options.early_stop else "no early stopping"
    )
    unit = f"{resources.get('GPU', 0):g} GPUs" if use_gpu else f"{resources.get('CPU', 0):g} CPUs"
    return (
        f"raytrain tune: {base.name} — {total} trials of {spec}: {' × '.join(axes)}\n"
        f"Every trial: {base.epochs} epoch{'s' if base.epochs != 1 else ''}, seed {base.seed}, {batch}, reference batch {base.reference_batch_size}; {stopping}\n"
        f"{concurrency} trial(s) at a time on {unit}; sweep directory {sweep_dir}"
    )


__all__ = [
    "SearchSpace",
    "SweepResult",
    "TuneOptions",
    "best_config",
    "embedded_cpus",
    "grid_points",
    "max_concurrent_trials",
    "parse_search_space",
    "tune",
]
