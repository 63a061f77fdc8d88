"""The raytrain port of examples/nanogpt_style/original.py: the same model, data and recipe,
counted in steps.

    python -m examples.nanogpt_style.data --out /tmp/nano
    raytrain train examples.nanogpt_style.pipeline:NanoGPTStyle --workers 2 --pipeline-arg data=/tmp/nano

Where each line of the original went (docs/porting.md has the two side by side): the
iteration loop and `max_iters` → --max-steps; `get_batch`'s random windows → a sampled
training set (`raytrain.Sampled.windows`, drawn from (seed, position): the same after a resume
or a resize); the per-process `batch_size` → --global-batch-size (2 processes × 8 = 16);
`get_lr` → --warmup-steps with --warmup-start-factor 0 (from 0, as the original) and this
pipeline's `lr_factor` (the cosine to the floor, read from its options through
`raytrain.context()`); `configure_optimizer` → `build_optimizer`; `clip_grad_norm_` →
--grad-clip-norm; `estimate_loss` every `eval_interval` over `eval_iters` batches →
--eval-every-steps and --eval-batches (the same windows every pass); rank-0 printing, saving
and JSON → the run's lines, model.pt and summary.json. The recipe is reproduced as it is: the
rate is not scaled (--lr-scaling none) and the warmup is the recipe's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import raytrain
from examples.nanogpt_style import data as token_data
from examples.nanogpt_style.original import (
    BATCH_SIZE,
    BETA2,
    BLOCK,
    EVAL_INTERVAL,
    EVAL_ITERS,
    GRAD_CLIP,
    HEADS,
    LAYERS,
    LR,
    MAX_ITERS,
    MIN_LR,
    WARMUP_ITERS,
    WEIGHT_DECAY,
    WIDTH,
)
from pipelines.charlm.model import CharGPT


@dataclass
class NanoArgs:
    """--pipeline-arg options of the nanoGPT-style port."""

    data: str | None = None
    """Directory of train.bin and val.bin (python -m examples.nanogpt_style.data --out DIR), which every worker maps;
    default: the same 2 MB of the standard library's sources, held in memory."""
    min_lr_ratio: float = MIN_LR / LR
    """The floor the cosine decays to, as a fraction of the peak rate."""
    weight_decay: float = WEIGHT_DECAY
    """AdamW's weight decay on the weight matrices (none on biases and norms)."""
    beta2: float = BETA2
    """AdamW's second-moment decay."""
    block: int = BLOCK
    """Context length in tokens (bytes)."""

    def __post_init__(self):
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--pipeline-arg min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


class NanoGPTStyle(raytrain.Pipeline):
    default_config = {
        "max_steps": MAX_ITERS,
        "global_batch_size": 2 * BATCH_SIZE,  # the original's 8 per process, on 2 processes
        "lr": LR,
        "lr_scaling": "none",  # reproduce the recipe as it is (linear or sqrt to scale it up)
        "warmup_steps": WARMUP_ITERS,
        "warmup_start_factor": 0.0,  # from 0, as the original's warmup
        "grad_clip_norm": GRAD_CLIP,
        "eval_every_steps": EVAL_INTERVAL,
        "eval_batches": EVAL_ITERS,
        "log_every_steps": 10,
    }
    Args = NanoArgs

    def build_datasets(self, cfg):
        args = self.args(cfg)
        length = args.block + 1  # inputs and next-token targets
        if args.data is None:  # small enough to travel with the pipeline to every worker
            return {split: raytrain.Sampled.windows(text, length) for split, text in token_data.in_memory().items()}
        return {
            split: raytrain.Sampled.windows(f"{args.data}/{name}", length, dtype=token_data.DTYPE)
            for split, name in (("train", token_data.TRAIN_FILE), ("val", token_data.VAL_FILE))
        }

    def build_model(self, cfg):
        return CharGPT(block=self.args(cfg).block, width=WIDTH, layers=LAYERS, heads=HEADS)

    def shard_modules(self, model):
        return list(model.blocks)

    def build_optimizer(self, model, cfg):
        args = self.args(cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, args.beta2))

    def lr_factor(self, progress):
        # The cosine from the peak to the floor; the floor is this pipeline's option, read from
        # the run's configuration (raytrain.context(): also the batch and the step budget).
        floor = self.args(raytrain.context().config).min_lr_ratio
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)

    def compute_loss(self, model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    @property
    def name(self) -> str:
        return "nanogpt-style"
