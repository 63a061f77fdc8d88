"""Pipelines for benchmarks/adversarial_cases.sh: digits with one fault each."""

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from pipelines.digits.pipeline import DigitsPipeline
from pipelines.parquet.pipeline import ParquetPipeline


class NanAt20(DigitsPipeline):
    steps = 0

    def compute_loss(self, model, batch):
        self.steps += 1
        loss, extra = super().compute_loss(model, batch)
        return (loss * math.nan if self.steps >= 20 else loss), extra


class BadModel(DigitsPipeline):
    def build_model(self, cfg):
        return {}["hidden_size"]


class VectorLoss(DigitsPipeline):
    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["image"]).float(), batch["label"], reduction="none")


class BadLabel(DigitsPipeline):
    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["image"]).float(), batch["label"] + 10)


class OtherShape(DigitsPipeline):
    def build_model(self, cfg):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))

    @property
    def name(self):
        return "digits"


# -- benchmarks/hardening_cases.sh: the newer hooks, one fault each ----------------------------


class LrRaises(DigitsPipeline):
    def lr_factor(self, progress):
        return {}["warmup"]


class LrString(DigitsPipeline):
    def lr_factor(self, progress):
        return "0.5"


class LrNegative(DigitsPipeline):
    def lr_factor(self, progress):
        return -1.0


class LrNan(DigitsPipeline):
    def lr_factor(self, progress):
        return math.nan


class ForeignOptimizer(DigitsPipeline):
    def build_optimizer(self, model, cfg):
        return torch.optim.AdamW(torch.nn.Linear(64, 10).parameters(), lr=cfg.lr)


class DropRows(DigitsPipeline):
    def transform_batch(self, batch, ctx):
        return {key: value[: len(value) // 2] for key, value in batch.items()}


class DropColumn(DigitsPipeline):
    def transform_batch(self, batch, ctx):
        return {"image": batch["image"]}


class TransformNone(DigitsPipeline):
    def transform_batch(self, batch, ctx):
        batch["image"] = batch["image"] + 0.01 * torch.randn_like(batch["image"])  # forgot the return


class DictArgs(DigitsPipeline):
    Args = dict


class ForeignShard(DigitsPipeline):
    def shard_modules(self, model):
        return [torch.nn.Linear(4, 4)]


class NoVal(DigitsPipeline):
    def build_datasets(self, cfg):
        return {"train": super().build_datasets(cfg)["train"]}


class NoTrain(DigitsPipeline):
    def build_datasets(self, cfg):
        return {"training": super().build_datasets(cfg)["train"]}


class DetachedLoss(DigitsPipeline):
    def compute_loss(self, model, batch):
        loss, extra = super().compute_loss(model, batch)
        return loss.item(), extra


def not_a_pipeline():
    return DigitsPipeline()


class ParquetLosesFile(ParquetPipeline):
    """The parquet pipeline whose data loses a file between planning the read and reading it."""

    def build_datasets(self, cfg):
        datasets = super().build_datasets(cfg)
        victim = Path(self.args(cfg).path) / "c.parquet"
        if victim.exists():
            os.remove(victim)
        return datasets


class DefaultConfigTypo(DigitsPipeline):
    default_config = {**DigitsPipeline.default_config, "epocs": 3}


class OddSample(torch.utils.data.Dataset):
    """Digits as a torch Dataset whose sample 7 has another image shape."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = torch.from_numpy(self.images[index])
        return {"image": image[..., :7] if index == 7 else image, "label": int(self.labels[index])}


class TorchOddShape(DigitsPipeline):
    def build_datasets(self, cfg):
        from pipelines.digits.pipeline import load_arrays

        images, labels = load_arrays()
        return {"train": OddSample(images[:512], labels[:512])}
