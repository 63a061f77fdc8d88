"""The raytrain port of examples/sgd_recipe/original.py: the same network, data and recipe.

    raytrain train examples.sgd_recipe.pipeline:SGDRecipe --workers 2

Where each line of the original went (docs/porting.md has the two side by side):
DistributedSampler and set_epoch → raytrain's order, new every epoch; the per-rank batch →
--global-batch-size 128 (the optimizer sees 128 whatever the worker count); SGD, Nesterov,
no decay on norms and biases → the config below; the LambdaLR warmup and step decay →
warmup_epochs, warmup_start_factor, schedule "step" with lr_milestones, keyed to samples;
per-sample crop and flip in __getitem__ → transform_batch on the worker, seeded by
(seed, epoch, step, rank); rank-0 printing and the JSON result → run files and summary.json.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import raytrain
from examples.sgd_recipe.model import ResNetLite
from examples.sgd_recipe.original import (
    GAMMA,
    LABEL_SMOOTHING,
    LR,
    MILESTONES,
    MOMENTUM,
    WARMUP_EPOCHS,
    WARMUP_START,
    WEIGHT_DECAY,
)
from pipelines.digits.pipeline import load_arrays, split, to_dataset


class SGDRecipe(raytrain.Pipeline):
    default_config = {
        "epochs": 10,
        "global_batch_size": 128,
        "reference_batch_size": 128,
        "lr": LR,
        "lr_scaling": "linear",
        "optimizer": "sgd",
        "momentum": MOMENTUM,
        "nesterov": True,
        "weight_decay": WEIGHT_DECAY,
        "decay_norm_and_bias": False,
        "warmup_epochs": WARMUP_EPOCHS,
        "warmup_start_factor": WARMUP_START,
        "schedule": "step",
        "lr_milestones": list(MILESTONES),
        "lr_gamma": GAMMA,
    }

    def build_model(self, cfg):
        return ResNetLite()

    def build_datasets(self, cfg):
        images, labels = load_arrays()
        train_rows, val_rows = split(len(labels))
        return {
            "train": to_dataset(images[train_rows], labels[train_rows]),
            "val": to_dataset(images[val_rows], labels[val_rows]),
        }

    def transform_batch(self, batch, ctx):
        """Random crop after 1-pixel padding, and a horizontal flip, per image (on the device)."""
        images = batch["image"]
        n = len(images)
        padded = F.pad(images, (1, 1, 1, 1))
        offsets = torch.randint(0, 3, (n, 2), device=images.device)
        rows = (offsets[:, :1] + torch.arange(8, device=images.device)).view(n, 1, 8, 1).expand(n, 1, 8, 10)
        cropped = padded.gather(2, rows)
        cols = (offsets[:, 1:] + torch.arange(8, device=images.device)).view(n, 1, 1, 8).expand(n, 1, 8, 8)
        cropped = cropped.gather(3, cols)
        flip = torch.rand(n, device=images.device) < 0.5
        cropped = torch.where(flip.view(n, 1, 1, 1), cropped.flip(-1), cropped)
        return {**batch, "image": cropped}

    def compute_loss(self, model, batch):
        logits = model(batch["image"])
        loss = F.cross_entropy(logits.float(), batch["label"], label_smoothing=LABEL_SMOOTHING)
        return loss, {"accuracy": (logits.argmax(1) == batch["label"]).float().mean()}

    @property
    def name(self) -> str:
        return "sgd-recipe"
