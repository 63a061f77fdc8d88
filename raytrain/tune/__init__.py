"""`raytrain tune`: sweep the LR scaling rule × warmup × worker count (× lr) on Ray Tune.

`options`, `space` and `resources` are pure (no Ray); `driver`, `trials` and `results` run and
report the sweep (docs/architecture.md maps them)."""

from __future__ import annotations

from raytrain.tune.driver import tune
from raytrain.tune.options import SearchSpace, TuneOptions

__all__ = ["SearchSpace", "TuneOptions", "tune"]
