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
from raytrain.tune.options import SearchSpace, TuneOptions

__all__ = ["SearchSpace", "TuneOptions", "tune"]
