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
from dataclasses import dataclass
from typing import Any, Sequence

from raytrain.config import TrainConfig, parse_workers
from raytrain.errors import ConfigError
from raytrain.pipeline import dated_name
from raytrain.rules.batch import batch_plan_for, default_reference_batch_size, lr_scale
from raytrain.text import sci
from raytrain.tune.options import SWEPT, SearchSpace, TuneOptions

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
            why = f"got {cfg.workers!r}; a sweep compares fixed worker counts (at least 1)"
            problems.append(("workers", f"{why}: give them, e.g. --workers 1,2,4"))
    if problems:
        raise ConfigError(problems)
    workers = space.workers if space.workers is not None else [cfg.max_workers]
    changes: dict[str, Any] = {"workers": max(workers)}
    if cfg.name is None:
        changes["name"] = dated_name(pipeline_name, "{}-tune")
    if cfg.reference_batch_size is None:
        changes["reference_batch_size"] = default_reference_batch_size(
            max(workers), global_batch_size=cfg.global_batch_size, batch_size_per_worker=cfg.batch_size_per_worker
        )
    return dataclasses.replace(cfg, **changes)


def trial_config(
    base: TrainConfig, point: dict[str, Any], *, name: str | None = None, storage: str | None = None
) -> TrainConfig:
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
    from raytrain.faults import MODES

    points = grid_points(space, base)
    lrs = list(space.lr_range) if space.lr_range else [None]
    problems: list[tuple[str, str]] = []
    for point, lr in itertools.product(points, lrs):
        try:
            trial_config(base, {**point, **({"lr": lr} if lr is not None else {})})
        except ConfigError as exc:
            problems += [p for p in exc.problems if p not in problems]
    if not MODES[base.fault_tolerance].reports_each_epoch:
        why = "got per-step: a sweep's trials report every epoch to Ray Tune, which a per-step run does not"
        problems.append(("fault_tolerance", f"{why}; sweep with --fault-tolerance restart (the default)"))
    if base.epochs is None:
        why = (
            f"got {base.max_steps} without --epochs: a sweep compares its trials at epoch ends (ASHA stops them there)"
        )
        problems.append(("max_steps", f"{why}; give --epochs too (with --max-steps, whichever comes first)"))
    elif options.early_stop and options.grace_period_epochs is not None and options.grace_period_epochs > base.epochs:
        why = f"got {options.grace_period_epochs} epochs, longer than the {base.epochs} epochs of each trial"
        problems.append(("grace_period", f"{why}; lower it or raise --epochs"))
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
