"""The one typed configuration tree of a run (`tree`: `TrainConfig`, how YAML, flags and a
pipeline's defaults layer), its sections (`sections`, `optimization`: the fields, one dataclass
per concern, `DDPConfig` among them) and its checks (`checks`). Nothing here imports Ray."""

from raytrain.config.checks import parse_workers
from raytrain.config.optimization import LR_RULES, comma_numbers
from raytrain.config.sections import DEFAULT_STORAGE, DDPConfig, key_value
from raytrain.config.tree import TrainConfig, merge_layers

__all__ = [
    "DEFAULT_STORAGE",
    "LR_RULES",
    "DDPConfig",
    "TrainConfig",
    "comma_numbers",
    "key_value",
    "merge_layers",
    "parse_workers",
]
