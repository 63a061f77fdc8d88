"""pytorch/examples' DDP tutorial (distributed/ddp-tutorial-series/multigpu_torchrun.py) as a
raytrain pipeline: a linear model on 2,048 random (20 → 1) samples, SGD at lr 1e-3, 32 samples
per device, a snapshot every epoch.

    raytrain train examples.multigpu_tutorial.pipeline:TutorialRegression --workers 2

What replaced what (docs/porting.md, "pytorch/examples' multigpu_torchrun.py"): the tutorial's
`MyTrainDataset` is returned as is (a map-style torch Dataset; its (input, target) tuples become
the columns '0' and '1'); `DistributedSampler` and the missing `set_epoch` → raytrain's order,
new every epoch; `--batch_size` per device → --batch-size-per-worker 32; the hand-written
snapshot with `module.state_dict()` → checkpoints without the `module.` prefix and `--resume`;
`init_process_group("nccl")` → chosen for the hardware (gloo on CPUs). The tutorial's loss,
`CrossEntropyLoss` on one output with a float target, is zero for any input (a softmax over one
class is 1), so nothing trains; the port uses the mean squared error the regression needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import raytrain


class RandomPairs(torch.utils.data.Dataset):
    """Like the tutorial's MyTrainDataset: `size` pairs of (rand(20), rand(1)), fixed by a seed."""

    def __init__(self, size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class TutorialRegression(raytrain.Pipeline):
    default_config = {
        "epochs": 10,
        "batch_size_per_worker": 32,
        "lr": 1e-3,
        "lr_scaling": "none",
        "optimizer": "sgd",
        "momentum": 0.0,
        "weight_decay": 0.0,
        "warmup_epochs": 0,
        "schedule": "constant",
    }

    def build_model(self, cfg):
        return torch.nn.Linear(20, 1)

    def build_datasets(self, cfg):
        return {"train": RandomPairs(2048), "val": RandomPairs(256, seed=1)}

    def compute_loss(self, model, batch):
        return F.mse_loss(model(batch["0"]), batch["1"])

    @property
    def name(self) -> str:
        return "tutorial-regression"
