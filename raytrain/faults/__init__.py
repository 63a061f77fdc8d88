"""Fault tolerance: one module per --fault-tolerance mode, each a mode object with a driver half
and a worker half (`raytrain.faults.restart.RestartMode`, the base), and the one registry of them.

A new mode is a module of its own, its line in `MODES`, and its name with what it asks of the
other sections in `raytrain.config.checks.FAULT_TOLERANCE_MODES`.
"""

from __future__ import annotations

from raytrain import fields
from raytrain.config import TrainConfig
from raytrain.config.checks import FAULT_TOLERANCE_MODES
from raytrain.faults.per_step import PerStepMode
from raytrain.faults.restart import RestartMode

MODES: dict[str, type[RestartMode]] = {"restart": RestartMode, "per-step": PerStepMode}
assert list(MODES) == list(FAULT_TOLERANCE_MODES), "each --fault-tolerance choice has its mode"


def mode_of(cfg: TrainConfig) -> RestartMode:
    """The run's mode, built once by the driver."""
    return MODES[cfg.fault_tolerance](cfg)


def mode_class(name: str | None) -> type[RestartMode]:
    """The mode of --fault-tolerance `name` (None: the default)."""
    return MODES[name or fields.option(TrainConfig, "fault_tolerance").default]
