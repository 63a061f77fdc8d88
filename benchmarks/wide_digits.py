"""`digits` with a wide MLP head (~6.4M parameters, 25.6 MB of fp32 gradients).

The built-in digits CNN has 0.34 MB of gradients: one DDP bucket, nothing for the bucket
size or `gradient_as_bucket_view` to change. This variant keeps the data and the loss and
makes the all-reduce big enough to see on CPU:

    raytrain bench benchmarks.wide_digits:WideDigits --workers 1,2
"""

from __future__ import annotations

from torch import nn

from pipelines.digits import DigitsPipeline
from pipelines.digits.model import DigitsCNN

HIDDEN = 2048


class WideDigitsNet(nn.Module):
    def __init__(self, hidden: int = HIDDEN, num_classes: int = 10):
        super().__init__()
        self.features = DigitsCNN().features  # 1x8x8 -> 64x4x4
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images):
        return self.head(self.features(images))


class WideDigits(DigitsPipeline):
    def build_model(self, cfg):
        return WideDigitsNet()

    @property
    def name(self) -> str:
        return "wide_digits"
