"""A small residual network with batch norm for 8×8 images: a plain torch module."""

from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
        )
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(x + self.body(x))


class ResNetLite(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))
