"""The sweep's space, pure: the axes and options, the grid, which points are the same run,
each trial's configuration and the resources it needs. No Ray here: every decision of a
sweep is unit-tested without one (tests/test_tune.py).

Two grid points are the same run when they resolve to the same trial configuration: the
same workers, batch, schedule and seed, and the same effective peak rate. At the reference
batch (1 worker with `--batch-size-per-worker`) the three scaling rules give the same peak,
so `linear`, `sqrt` and `none` are one run there; `plan_sweep` plans it once and says which
points it stands for.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from raytrain.rules.batch import batch_plan_for, default_reference_batch_size, lr_scale
from raytrain.config import LR_RULES, TrainConfig, parse_workers
from raytrain.errors import ConfigError
from raytrain.observe.render import sci

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
class LrDraws:
    """How `raytrain tune` draws learning rates instead of taking --lr's grid."""

    lr_range: str | None = field(default=None, metadata={"metavar": "LO:HI"})
    """Draw the base learning rate log-uniformly from [LO, HI] instead of --lr."""
    samples: int | None = field(default=None, metadata={"metavar": "N"})
    """With --lr-range: learning rates drawn per grid point (default 1)."""


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
        changes["reference_batch_size"] = default_reference_batch_size(
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
    if base.fault_tolerance == "per-step":
        problems.append(("fault_tolerance", "got per-step: a sweep's trials report every epoch to Ray Tune, which a per-step run does not; sweep with --fault-tolerance restart (the default)"))
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
    return f"{index:02d}-w{point['workers']}-{point['lr_scaling']}-wu{point['warmup_epochs']:g}-lr{sci(point['lr'])}"


# -- which points are the same run -------------------------------------------------------


def point_key(point: dict[str, Any]) -> tuple:
    """A grid point as a hashable key, in SWEPT order (a drawn lr is part of it when present)."""
    return tuple(point.get(name) for name in SWEPT)


def resolved_run(cfg: TrainConfig) -> str:
    """What a trial's training depends on, as one comparable text: its configuration with the
    scaling rule replaced by the peak rate it gives at the trial's global batch (the rule is
    only a way to that rate: lr × f(global / reference)), without the run's name."""
    plan = batch_plan_for(cfg, cfg.max_workers)
    peak = cfg.lr * lr_scale(cfg.lr_scaling, plan.global_batch_size, cfg.reference_batch_size)
    values = {k: v for k, v in cfg.to_dict().items() if k not in ("lr_scaling", "name")}
    values["peak_lr"] = float(f"{peak:.12g}")  # sqrt(1) and 1/1 agree; rounding only absorbs float noise
    return json.dumps(values, sort_keys=True, default=str)


@dataclass
class SweepRun:
    """One distinct run of the sweep and every grid point it stands for (`points[0]` is the
    one it runs as: the first in grid order)."""

    index: int
    """Position among the sweep's runs: Tune's trial number, the prefix of the run's name."""
    points: list[dict[str, Any]]

    @property
    def point(self) -> dict[str, Any]:
        return self.points[0]

    @property
    def name(self) -> str:
        return trial_name(self.index, self.point)

    @property
    def shared(self) -> bool:
        return len(self.points) > 1

    @property
    def rule_names(self) -> str:
        """`linear=sqrt=none`: the scaling rules of the points this run stands for."""
        return "=".join(dict.fromkeys(p["lr_scaling"] for p in self.points))


def plan_sweep(base: TrainConfig, points: list[dict[str, Any]]) -> list[SweepRun]:
    """The distinct runs of the grid, in grid order: points that resolve to the same trial
    configuration (`resolved_run`) are planned once, same run, same seed. Points without an
    lr (Tune draws it from `lr_range`) are each their own run: their draws differ."""
    runs: list[SweepRun] = []
    by_key: dict[str, SweepRun] = {}
    for point in points:
        key = resolved_run(trial_config(base, point)) if "lr" in point else None
        if key is not None and key in by_key:
            by_key[key].points.append(point)
            continue
        run = SweepRun(index=len(runs), points=[point])
        runs.append(run)
        if key is not None:
            by_key[key] = run
    return runs


def runs_by_point(runs: Sequence[SweepRun]) -> dict[tuple, SweepRun]:
    """Every planned point's key -> the run it shares."""
    return {point_key(p): run for run in runs for p in run.points}


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


