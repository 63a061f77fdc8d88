"""What `raytrain bench` measures, besides the training options, and its checks."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from raytrain.config import DEFAULT_STORAGE, TrainConfig
from raytrain.config.checks import EMPTY_NAME
from raytrain.errors import ConfigError, RunFailed
from raytrain.rules import costmodel
from raytrain.rules.batch import BatchPlan
from raytrain.rundir.storage import is_uri

TEMPLATE_MODULE = "raytrain.baselines.classic_ddp"
BASELINES = ("torchrun", "plain")
Statistic = Literal["median", "best"]
STATISTICS = get_args(Statistic)
BASELINE_TIMEOUT_S = 1800
# Train options bench decides itself (one run per worker count, its own storage layout).
BENCH_OWNED = tuple(
    "workers epochs max_steps storage name resume checkpoint_every_steps max_failures timing_warmup_steps".split()
)


class BenchError(RunFailed):
    """A benchmark run failed; the message says which and where its log is."""


def _names(text: str) -> list[str]:
    """`torchrun,plain` -> ["torchrun", "plain"]."""
    return [name.strip() for name in text.split(",") if name.strip()]


@dataclass(kw_only=True)
class BenchOptions:
    """What `raytrain bench` measures, besides the training options."""

    workers: list[int]
    """Worker counts to run, comma-separated on the command line (e.g. 1,2,4); 1 is always added (speedups are relative
    to it)."""
    steps: int = 100
    """At least this many steady steps measured at each worker count (default 100)."""
    warmup_steps: int = field(default=3, metadata={"flags": ("--warmup-steps", "--timing-warmup-steps")})
    """Steps left out at the start of every epoch, by raytrain and the baselines (default 3)."""
    baselines: list[str] = field(
        default_factory=list, metadata={"flags": "--baseline", "repeat": True, "parse": _names, "metavar": "NAME"}
    )
    """`torchrun` and/or `plain` (repeat or comma-separate)."""
    repeat: int = 1
    """Rounds of every configuration (default 1)."""
    statistic: Statistic = "median"
    """Which round stands for a configuration with --repeat: `median` (default) or `best` (the fastest)."""
    link: str | None = None
    """A cost-model link (nvlink, pcie4, ib200, ...: raytrain.rules.costmodel.LINKS): adds a predicted speedup column;
    with --predict, the ring's link."""
    storage: str = DEFAULT_STORAGE
    """Results go to STORAGE/NAME/ (default ~/raytrain_results)."""
    name: str | None = field(default=None, metadata={"text": True})
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
        if self.name is not None and not self.name.strip():
            problems.append(("name", f"got {self.name!r}; {EMPTY_NAME} (bench-PIPELINE-DATE-TIME)"))
        if self.link is not None and self.link not in costmodel.LINKS:
            problems.append(("link", f"got {self.link!r}; choose one of {', '.join(costmodel.LINKS)}"))
        if problems:
            raise ConfigError(problems)
        self.workers = sorted({1, *self.workers})
        if not is_uri(self.storage):  # an object store's URI stays one
            self.storage = os.path.abspath(os.path.expanduser(self.storage.removeprefix("file://")))


def worker_counts(text: str, option: str = "workers") -> list[int]:
    """`1,2,4` -> [1, 2, 4]; ConfigError naming `option` otherwise."""
    try:
        return [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ConfigError([(option, f"got {text!r}; give comma-separated integers, e.g. --workers 1,2,4")]) from None


@dataclass
class PlannedRun:
    """One worker count of the study: its config (epochs chosen for the steady steps asked)."""

    workers: int
    cfg: TrainConfig
    batch: BatchPlan
    epochs: int
    steady_steps: int
    num_rows: int
    out: Path
