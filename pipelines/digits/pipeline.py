"""The `digits` pipeline: data as Ray Datasets, the CNN, cross-entropy with accuracy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch.nn.functional as F

import raytrain
from pipelines.digits.model import DigitsCNN

DATA_FILE = Path(__file__).with_name("digits.npz")
VAL_FRACTION = 0.2
SPLIT_SEED = 1234  # fixed: the held-out set is the same whatever the run's seed
PIXEL_MEAN, PIXEL_STD = 0.305, 0.38  # of the 8×8 images scaled to [0, 1]


def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Images as standardized float32 (N, 1, 8, 8), labels as int64 (N,)."""
    with np.load(DATA_FILE) as data:
        images = (data["images"].astype(np.float32)[:, None] / 16.0 - PIXEL_MEAN) / PIXEL_STD
        labels = data["labels"].astype(np.int64)
    return images, labels


def split(num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(SPLIT_SEED).permutation(num_rows)
    num_val = int(round(num_rows * VAL_FRACTION))
    return np.sort(order[num_val:]), np.sort(order[:num_val])


def to_dataset(images: np.ndarray, labels: np.ndarray):
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    # One tensor column for the image, not 64 scalar columns: batches are built from
    # one array instead of 64 (RAY_NOTES: 5× faster).
    return ray.data.from_arrow(pa.table({"image": ArrowTensorArray.from_numpy(images), "label": labels}))


class DigitsPipeline(raytrain.Pipeline):
    default_config = {"epochs": 5, "batch_size_per_worker": 32, "lr": 1e-3, "warmup_epochs": 1}

    def build_model(self, cfg):
        return DigitsCNN()

    def build_datasets(self, cfg):
        images, labels = load_arrays()
        train_rows, val_rows = split(len(labels))
        return {
            "train": to_dataset(images[train_rows], labels[train_rows]),
            "val": to_dataset(images[val_rows], labels[val_rows]),
        }

    def compute_loss(self, model, batch):
        logits = model(batch["image"])
        loss = F.cross_entropy(logits.float(), batch["label"])
        accuracy = (logits.argmax(dim=1) == batch["label"]).float().mean()
        return loss, {"accuracy": accuracy}

    @property
    def name(self) -> str:
        return "digits"
