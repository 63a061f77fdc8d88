"""The optimizer of a run: the config's choice, or the pipeline's own `build_optimizer`.

raytrain owns the learning rate whatever the optimizer: at every step each parameter group
gets the rate of the rules (scaling rule × warmup × schedule, keyed to samples seen) times the
group's own multiplier — its rate when the optimizer was built, divided by `--lr`. A group built
with `lr=cfg.lr * 0.1` trains at a tenth of the schedule's rate, through scaling, warmup and
resizes; a group built without its own `lr` follows the schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain.config import TrainConfig
from raytrain.errors import ConfigError


def param_groups(model: torch.nn.Module, weight_decay: float, decay_norm_and_bias: bool = True) -> list[dict[str, Any]]:
    """Trainable parameters in groups; without decay on biases and norm weights (tensors of one
    dimension or none) when `decay_norm_and_bias` is False."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_and_bias:
        return [{"params": trainable, "weight_decay": weight_decay}]
    matrices = [p for p in trainable if p.ndim > 1]
    vectors = [p for p in trainable if p.ndim <= 1]
    return [
        g
        for g in ({"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0})
        if g["params"]
    ]


def build_default_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, groups: list[dict[str, Any]] | None = None
) -> torch.optim.Optimizer:
    """--optimizer adamw | sgd | lamb over `groups` (default: `param_groups`), at --lr (raytrain
    sets the rate per step)."""
    if groups is None:
        groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    if cfg.optimizer == "lamb":
        try:
            from pytorch_optimizer import Lamb
        except ImportError:
            raise ConfigError(
                [("optimizer", "lamb comes from the pytorch-optimizer package: pip install 'raytrain[large-batch]'")]
            ) from None
        return Lamb(groups, lr=cfg.lr)
    return torch.optim.AdamW(groups, lr=cfg.lr)


def rate_multipliers(optimizer: torch.optim.Optimizer, base_lr: float) -> list[float]:
    """Each group's rate when built, over --lr: what raytrain multiplies its own rate by."""
    return [float(group.get("lr", base_lr)) / base_lr for group in optimizer.param_groups]


def set_rates(optimizer: torch.optim.Optimizer, lr: float, multipliers: list[float]) -> None:
    for group, multiplier in zip(optimizer.param_groups, multipliers):
        group["lr"] = lr * multiplier


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`AdamW, 2 groups`: what a pipeline's build_optimizer built, for the plan line and config.yaml."""
    groups = len(optimizer.param_groups)
    return f"{type(optimizer).__name__}, {groups} group{'s' if groups != 1 else ''}"
