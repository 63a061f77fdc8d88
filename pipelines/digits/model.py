"""A plain torch module: nothing here knows about Ray or distributed training."""

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3×3 conv layers, one pooling, two linear layers: ~85k parameters."""

    def __init__(self, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width // 2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width // 2, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width * 4 * 4, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))
