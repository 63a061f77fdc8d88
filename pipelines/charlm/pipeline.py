"""The `charlm` pipeline: stdlib sources as byte windows, CharGPT, next-byte cross-entropy."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np
import torch.nn.functional as F

import raytrain
from pipelines.charlm.model import CharGPT
from raytrain.data import DataError

VAL_FRACTION = 0.05
DEFAULTS = {"corpus_mb": 1.0, "block": 128, "width": 128, "layers": 2, "heads": 4}


def options(cfg) -> dict:
    args = {**DEFAULTS, **cfg.pipeline_args}
    unknown = sorted(set(args) - set(DEFAULTS))
    if unknown:
        raise DataError(f"pipeline charlm: unknown --pipeline-arg {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    try:
        parsed = {"corpus_mb": float(args["corpus_mb"]), **{k: int(args[k]) for k in ("block", "width", "layers", "heads")}}
    except ValueError as exc:
        raise DataError(f"pipeline charlm: --pipeline-arg values must be numbers ({exc})") from None
    if parsed["width"] % parsed["heads"]:
        raise DataError(f"pipeline charlm: width {parsed['width']} must be divisible by heads {parsed['heads']}")
    return parsed


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
        print(f"charlm: {len(text) / 2**20:.2f} MB of stdlib source, {rows} windows of {window} bytes; "
              f"unigram baseline {self.unigram_bits:.3f} bits/byte ({self.unigram_bits * math.log(2):.3f} nats)", flush=True)
        return {
            "train": ray.data.from_numpy(windows[:-num_val]).rename_columns({"data": "tokens"}),
            "val": ray.data.from_numpy(windows[-num_val:]).rename_columns({"data": "tokens"}),
        }

    def build_model(self, cfg):
        opts = options(cfg)
        return CharGPT(block=opts["block"], width=opts["width"], layers=opts["layers"], heads=opts["heads"])

    def compute_loss(self, model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        return loss, {"bits_per_byte": loss.detach() / math.log(2)}

    @property
    def name(self) -> str:
        return "charlm"
