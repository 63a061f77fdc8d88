"""Pipelines with one pitfall each, for `raytrain check` (importable on Ray workers: tests/ is
on their PYTHONPATH). Each trains on digits; each differs from the built-in pipeline by
the one thing named."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.digits.pipeline import DigitsPipeline


class SmallCNN(nn.Module):
    def __init__(self, batchnorm: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm2d(8) if batchnorm else nn.Identity()
        self.head = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(images)))


class Clean(DigitsPipeline):
    """No pitfall: a small CNN, mean cross-entropy."""

    default_config = {"epochs": 1, "global_batch_size": 64, "lr": 1e-3, "warmup_epochs": 0}

    def build_model(self, cfg):
        return SmallCNN()

    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["image"]), batch["label"])

    @property
    def name(self) -> str:
        return type(self).__name__


class WithBatchNorm(Clean):
    """A CNN with BatchNorm: each worker normalizes its share by its own statistics."""

    def build_model(self, cfg):
        return SmallCNN(batchnorm=True)


class SummedLoss(Clean):
    """reduction="sum": each worker's loss and gradient shrink with its share."""

    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["image"]), batch["label"], reduction="sum")


class NoisyLoss(Clean):
    """Unseeded noise added to the inputs inside compute_loss: each worker draws its own."""

    def compute_loss(self, model, batch):
        images = batch["image"] + 0.3 * torch.randn_like(batch["image"])
        return F.cross_entropy(model(images), batch["label"])


class StatefulLoss(Clean):
    """A running mean of the loss kept in the pipeline object, which divides the loss: each
    worker's copy follows its own share."""

    def compute_loss(self, model, batch):
        loss = F.cross_entropy(model(batch["image"]), batch["label"])
        previous = getattr(self, "running", None)
        self.running = loss.detach() if previous is None else 0.5 * previous + 0.5 * loss.detach()
        return loss / self.running


class RankAware(Clean):
    """A loss that reads the world size from raytrain.context()."""

    def compute_loss(self, model, batch):
        import raytrain

        return F.cross_entropy(model(batch["image"]), batch["label"]) * raytrain.context().world_size


class WithDropout(Clean):
    """Dropout layers: legitimately random, put in evaluation mode by the check."""

    def build_model(self, cfg):
        model = SmallCNN()
        model.head.insert(3, nn.Dropout(0.5))
        return model
