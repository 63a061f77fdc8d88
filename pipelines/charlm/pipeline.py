"""The `charlm` pipeline: stdlib sources as byte windows, CharGPT, next-byte cross-entropy."""

from __future__ import annotations

import dataclasses
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.nn.functional as F

import raytrain
from pipelines.charlm.model import CharGPT
from raytrain.errors import DataError

VAL_FRACTION = 0.05


@dataclass
class CharLMArgs:
    """--pipeline-arg options of the charlm pipeline."""

    corpus_mb: float = 1.0
    """Megabytes of the stdlib's .py sources."""
    block: int = 128
    """Context length in bytes."""
    width: int = 128
    """Embedding width of the transformer."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads (must divide width)."""

    def __post_init__(self):
        if min(self.corpus_mb, self.block, self.width, self.layers, self.heads) <= 0:
            raise ValueError("every --pipeline-arg of charlm must be positive")
        if self.width % self.heads:
            raise ValueError(f"--pipeline-arg width {self.width} must be divisible by heads {self.heads}")


def options(cfg) -> dict:
    return dataclasses.asdict(CharLMPipeline().args(cfg))


def corpus(megabytes: float) -> np.ndarray:
    """The first `megabytes` of the stdlib's .py files in sorted order, as bytes (uint8)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    limit, chunks, size = int(megabytes * 2**20), [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return np.frombuffer(b"\n".join(chunks)[:limit], dtype=np.uint8)


def unigram_bits_per_byte(text: np.ndarray) -> float:
    counts = np.bincount(text, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


class CharLMPipeline(raytrain.Pipeline):
    default_config = {"epochs": 3, "batch_size_per_worker": 32, "lr": 1e-3, "warmup_epochs": 0.5, "log_every_steps": 20}
    Args = CharLMArgs

    def build_datasets(self, cfg):
        import ray.data

        opts = options(cfg)
        text = corpus(opts["corpus_mb"])
        window = opts["block"] + 1
        rows = len(text) // window
        if rows < 2:
            raise DataError(f"pipeline charlm: corpus of {len(text)} bytes is shorter than two windows of {window}")
        windows = text[: rows * window].reshape(rows, window).astype(np.int64)
        num_val = max(1, int(rows * VAL_FRACTION))
        self.unigram_bits = unigram_bits_per_byte(text)
        print(
            f"charlm: {len(text) / 2**20:.2f} MB of stdlib source, {rows} windows of {window} bytes; "
            f"unigram baseline {self.unigram_bits:.3f} bits/byte ({self.unigram_bits * math.log(2):.3f} nats)",
            flush=True,
        )
        return {
            "train": ray.data.from_numpy(windows[:-num_val]).rename_columns({"data": "tokens"}),
            "val": ray.data.from_numpy(windows[-num_val:]).rename_columns({"data": "tokens"}),
        }

    def build_model(self, cfg):
        opts = options(cfg)
        return CharGPT(block=opts["block"], width=opts["width"], layers=opts["layers"], heads=opts["heads"])

    def shard_modules(self, model):
        # The transformer blocks: each is one FSDP unit (gathered for its forward, freed after),
        # one activation checkpoint and one compiled region.
        return list(model.blocks)

    def compute_loss(self, model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        return loss, {"bits_per_byte": loss.detach() / math.log(2)}

    @property
    def name(self) -> str:
        return "charlm"
