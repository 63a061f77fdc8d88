"""The one typed configuration tree of a run.

`TrainConfig` is every knob of a run, composed of its sections (`raytrain.config.sections`,
`raytrain.config.optimization`: each field with its meaning and unit, its text the flag's
`--help`), and how the layers of options merge (`merge_layers`). `TrainConfig` checks itself in
`__post_init__` and raises one `ConfigError` listing every problem, each naming the option, the
value received and the fix. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from raytrain import fields
from raytrain.config.checks import did_you_mean, problems_of
from raytrain.config.optimization import OptimizationSection
from raytrain.config.sections import (
    ClusterSection,
    DataSection,
    DDPConfig,
    FaultToleranceSection,
    ObserveSection,
    RunSection,
    StorageSection,
    StrategySection,
    WatchSection,
)
from raytrain.errors import ConfigError

# The sections in the order --help lists them (a dataclass takes the fields of its last base first).
SECTIONS = (
    DataSection,
    OptimizationSection,
    StrategySection,
    FaultToleranceSection,
    StorageSection,
    ObserveSection,
    WatchSection,
    ClusterSection,
    RunSection,
)


@dataclass(kw_only=True)
class TrainConfig(
    RunSection,
    ClusterSection,
    WatchSection,
    ObserveSection,
    StorageSection,
    FaultToleranceSection,
    StrategySection,
    OptimizationSection,
    DataSection,
):
    """Everything a `raytrain train` run needs to know; README.md, 'Command line', says how to give it.

    Its fields are those of its sections (`raytrain.config.sections`,
    `raytrain.config.optimization`), each a flat name: `cfg.lr`, `TrainConfig(lr=...)`, a YAML
    key `lr:`, the flag `--lr`."""

    def __post_init__(self) -> None:
        if isinstance(self.ddp, Mapping):
            self.ddp = _build(DDPConfig, dict(self.ddp), prefix="ddp.")
        if not isinstance(self.ddp, DDPConfig):
            why = f"got {self.ddp!r} ({type(self.ddp).__name__}); expected a mapping of DDP flags, e.g. ddp: "
            raise ConfigError([("ddp", why + "{bucket_cap_mb: 25}")])
        self.fill_defaults()
        problems = problems_of(self, SECTIONS)
        if problems:
            raise ConfigError(problems)
        self.settle_storage()

    def own_problems(self) -> Iterable[tuple[str, str]]:
        """Every section's own problems, section by section (each section's `own_problems` would
        otherwise be the first base's alone); those across sections: `checks.across_sections`."""
        for section in SECTIONS:
            yield from section.own_problems(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Build from a plain mapping (YAML); unknown keys are errors with a suggestion."""
        return _build(cls, dict(values))


def exclusive_pairs() -> list[set[str]]:
    """The knobs of which a layer that names one replaces the other below it: each field marked
    `instead_of` another, with it."""
    return [
        {option.name, option.metadata["instead_of"]}
        for option in fields.options(TrainConfig)
        if "instead_of" in option.metadata
    ]


def merge_layers(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; `ddp.x` flags and `ddp: {x: ..}` mappings merge into one ddp mapping."""
    merged: dict[str, Any] = {}
    for layer in layers:
        # A layer that sets one knob of a pair replaces the other from the layers below
        # (`--global-batch-size` overrides a pipeline's `batch_size_per_worker`; `--max-steps`
        # alone its `epochs`); one layer that sets both keeps both.
        given = {key.replace("-", "_") for key in layer}
        for pair in exclusive_pairs():
            knobs = pair & given
            if len(knobs) == 1:
                merged.pop(*(pair - knobs), None)
        for key, value in layer.items():
            key = key.replace("-", "_")
            if key.startswith("ddp."):
                merged.setdefault("ddp", {})[key[4:]] = value
            elif key == "ddp" and isinstance(value, dict):
                merged.setdefault("ddp", {}).update(value)
            elif key == "pipeline_args" and _pairs(value):
                merged.setdefault("pipeline_args", {}).update(dict(value))
            else:
                merged[key] = value
    return merged


def _pairs(value: Any) -> bool:
    """A mapping, or (key, value) pairs (repeated --pipeline-arg): what merges key by key.
    Anything else is left for the type check to name."""
    if isinstance(value, dict):
        return True
    return isinstance(value, list) and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in value)


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    values = {str(key): value for key, value in values.items()}
    unknown = [key for key in values if key.replace("-", "_") not in names]
    if unknown:
        known = ", ".join(names)
        raise ConfigError(
            [(prefix + k, f"unknown option{did_you_mean(k.replace('-', '_'), names)}; known: {known}") for k in unknown]
        )
    return cls(**{key.replace("-", "_"): value for key, value in values.items()})
