"""Pipelines for benchmarks/adversarial_cases.sh: digits with one fault each."""

import math

import torch
import torch.nn.functional as F

from pipelines.digits.pipeline import DigitsPipeline


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
