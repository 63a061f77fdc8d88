"""The data of the nanoGPT-style recipe: the first megabytes of the Python standard library's own
sources (no download), as bytes, split 90/10 into `train.bin` and `val.bin` — one uint8 token
per byte, the raw token files nanoGPT's `prepare.py` writes. Both the original script and the
raytrain port read these files.

    python -m examples.nanogpt_style.data --out DIR [--megabytes 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

TRAIN_FILE, VAL_FILE = "train.bin", "val.bin"
VAL_FRACTION = 0.1
DTYPE = "uint8"  # bytes are the tokens: a vocabulary of 256


def in_memory(megabytes: float = 2.0) -> dict[str, np.ndarray]:
    """The train and val tokens as arrays."""
    from pipelines.charlm.pipeline import corpus

    text = corpus(megabytes).astype(DTYPE)
    cut = int(len(text) * (1 - VAL_FRACTION))
    return {"train": text[:cut], "val": text[cut:]}


def prepare(out: str | Path, megabytes: float = 2.0) -> Path:
    """Write OUT/train.bin and OUT/val.bin (once; kept when both exist) and return OUT."""
    out = Path(out)
    if (out / TRAIN_FILE).exists() and (out / VAL_FILE).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for split, text in in_memory(megabytes).items():
        text.tofile(out / (TRAIN_FILE if split == "train" else VAL_FILE))
    return out


def tokens(directory: str | Path, split: str) -> np.ndarray:
    """A split's tokens, mapped from its file."""
    return np.memmap(Path(directory) / (TRAIN_FILE if split == "train" else VAL_FILE), dtype=DTYPE, mode="r")


def fixed_windows(data: np.ndarray, block: int, count: int, seed: int = 1234) -> np.ndarray:
    """`count` windows of block + 1 tokens at offsets drawn once from `seed`: the same windows for
    whoever evaluates a model on them (benchmarks/reproduce.py scores both sides this way)."""
    starts = np.random.default_rng(seed).integers(0, len(data) - block, size=count)
    return np.stack([np.asarray(data[s : s + block + 1], dtype=np.int64) for s in starts])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--megabytes", type=float, default=2.0)
    args = parser.parse_args()
    print(prepare(args.out, args.megabytes))
