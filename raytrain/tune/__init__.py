"""`raytrain tune`: sweep the LR scaling rule × warmup × worker count (× lr) on Ray Tune.

Pure, without Ray:
- `options`: what a sweep is asked for — the axes, drawn rates, the sweep's own options;
- `space`: the grid, which points are the same run (the rules at the reference batch), each
  trial's configuration;
- `resources`: what a trial needs and how many run at once.
With Ray:
- `driver`: the Tuner, one ASHA per worker count, the trial function, the placement groups;
- `trials`: each trial's console line, name, error and run;
- `results`: what a sweep leaves — trials.csv, best.yaml, trials.png, the closing table.
"""

from __future__ import annotations

from raytrain.tune.driver import tune
from raytrain.tune.options import SWEPT, SearchSpace, TuneOptions, parse_list, parse_search_space
from raytrain.tune.resources import embedded_cpus, max_concurrent_trials, trial_cpus, trial_driver_resources
from raytrain.tune.results import (
    SUBSTITUTED,
    SweepResult,
    TrialRun,
    best_config,
    best_per_worker_count,
    closing_table,
    mark_stopped,
    plot_trials,
    ranked_trials,
    sweep_rows,
    tied_rules,
    trial_epoch_rows,
    trial_results,
    write_csv,
)
from raytrain.tune.space import (
    SweepRun,
    check_trials,
    grace_period,
    grid_points,
    plan_sweep,
    point_key,
    resolved_run,
    sweep_base_config,
    trial_config,
    trial_name,
)
from raytrain.tune.trials import trial_error

__all__ = [
    "SUBSTITUTED",
    "SWEPT",
    "SweepRun",
    "SearchSpace",
    "SweepResult",
    "TrialRun",
    "TuneOptions",
    "best_config",
    "best_per_worker_count",
    "check_trials",
    "closing_table",
    "embedded_cpus",
    "grace_period",
    "grid_points",
    "mark_stopped",
    "max_concurrent_trials",
    "parse_list",
    "parse_search_space",
    "plan_sweep",
    "plot_trials",
    "point_key",
    "ranked_trials",
    "resolved_run",
    "sweep_base_config",
    "sweep_rows",
    "tied_rules",
    "trial_config",
    "trial_cpus",
    "trial_driver_resources",
    "trial_epoch_rows",
    "trial_error",
    "trial_name",
    "trial_results",
    "tune",
    "write_csv",
]
