"""The one typed configuration tree of a run (`tree`: `TrainConfig`, `DDPConfig`, how YAML,
flags and a pipeline's defaults layer) and its checks (`checks`). Nothing here imports Ray."""

from raytrain.config.tree import (
    DEFAULT_STORAGE,
    LR_RULES,
    DDPConfig,
    TrainConfig,
    comma_numbers,
    key_value,
    merge_layers,
    parse_workers,
)

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
