"""What a sweep is asked for: the axes (`SearchSpace`, from comma-separated lists), drawn learning rates
(`LrDraws`) and the sweep's own options (`TuneOptions`), each checked with the fix named."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from raytrain.config import LR_RULES
from raytrain.errors import ConfigError

SWEPT = ("workers", "lr_scaling", "warmup_epochs", "lr")
MODES = ("min", "max")


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
                yield (
                    "workers",
                    f"got {n!r}; each worker count must be a whole number of at least 1, e.g. --workers 1,2,4",
                )
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
        fix = "give a grid (--lr 1e-4,3e-4) or a range (--lr-range 1e-4:1e-2 --samples 4)"
        yield "lr_range", f"cannot be combined with --lr; {fix}"
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
        fix = "add --lr-range LO:HI or drop --samples"
        yield "samples", f"got {s.samples} without --lr-range; a grid has nothing to draw: {fix}"


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
    for name, raw, kind in (
        ("workers", workers, "int"),
        ("lr_scaling", lr_scaling, "str"),
        ("warmup_epochs", warmup_epochs, "float"),
        ("lr", lr, "float"),
    ):
        if raw is None:
            continue
        if name == "workers" and any(":" in str(item) for item in (raw if isinstance(raw, (list, tuple)) else [raw])):
            why = f"got {_show(raw)}; a sweep compares fixed worker counts, not elastic MIN:MAX ranges"
            problems.append(("workers", f"{why}: give counts, e.g. --workers 1,2,4"))
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
