"""A ResNet-style SGD recipe on the 8×8 digits, written the classic way: the "before" of
examples/sgd_recipe/pipeline.py (docs/porting.md puts them side by side).

SGD with momentum 0.9 (Nesterov), weight decay 5e-4 except on norms and biases, gradual
warmup from a tenth of the rate over the first epoch, step decay (×0.1) at epochs 6 and 9,
label smoothing 0.1, random crop (pad 1) and horizontal flip per sample, a small residual
network with batch norm. Run alone, or under torchrun for DDP with DistributedSampler:

    python examples/sgd_recipe/original.py --epochs 10 --seed 0 --out result.json
    python -m torch.distributed.run --nproc_per_node 2 examples/sgd_recipe/original.py \
        --epochs 10 --seed 0 --out result.json

Every rank trains `--global-batch-size / world size` samples per step. Rank 0 writes the
final training loss (the mean over the last epoch) and the validation loss as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.sgd_recipe.model import ResNetLite  # noqa: E402
from pipelines.digits.pipeline import load_arrays, split  # noqa: E402

LR, MOMENTUM, WEIGHT_DECAY, LABEL_SMOOTHING = 0.1, 0.9, 5e-4, 0.1
MILESTONES, GAMMA, WARMUP_EPOCHS, WARMUP_START = (6, 9), 0.1, 1, 0.1


class Digits(Dataset):
    """The images with per-sample augmentation (random crop after 1-pixel padding, flip)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, augment: bool):
        self.images, self.labels, self.augment = torch.from_numpy(images), torch.from_numpy(labels), augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.augment:
            padded = F.pad(image, (1, 1, 1, 1))
            top, left = torch.randint(0, 3, (2,))
            image = padded[:, top : top + 8, left : left + 8]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return image, self.labels[index]


def param_groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]  # biases and norm weights
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    images, labels = load_arrays()
    train_rows, val_rows = split(len(labels))
    train = Digits(images[train_rows], labels[train_rows], augment=True)
    val = Digits(images[val_rows], labels[val_rows], augment=False)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=math.ceil(args.global_batch_size / world), sampler=sampler)

    model = ResNetLite()
    model = DDP(model) if distributed else model
    optimizer = torch.optim.SGD(param_groups(model), lr=LR, momentum=MOMENTUM, nesterov=True)
    steps_per_epoch = len(loader)

    def factor(step: int) -> float:
        epoch = step / steps_per_epoch
        if epoch < WARMUP_EPOCHS:
            return WARMUP_START + (1 - WARMUP_START) * epoch / WARMUP_EPOCHS
        return GAMMA ** sum(epoch >= m for m in MILESTONES)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    torch.manual_seed(args.seed * 1000 + rank)  # augmentation differs per rank
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total, count = torch.zeros(()), 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y, label_smoothing=LABEL_SMOOTHING)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += loss.detach() * len(y)
            count += len(y)
        sums = torch.tensor([float(total), float(count)])
        if distributed:
            dist.all_reduce(sums)
        train_loss = float(sums[0] / sums[1])
    model.eval()
    with torch.no_grad():
        x, y = val.images, val.labels
        val_loss = float(F.cross_entropy(model(x), y, label_smoothing=LABEL_SMOOTHING))
        val_accuracy = float((model(x).argmax(1) == y).float().mean())
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {"train_loss": train_loss, "val_loss": val_loss, "val_accuracy": val_accuracy, "world_size": world}
            )
        )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
