"""A nanoGPT-style training script, written for raytrain's porting guide: the "before" of
examples/nanogpt_style/pipeline.py (docs/porting.md puts them side by side).

The shape of karpathy/nanoGPT's train.py, over raytrain's own small GPT (pipelines/charlm):
iterations, not epochs; a fresh random batch of windows of a raw token file every iteration
(`get_batch`); AdamW with decay on the weight matrices only; linear warmup from 0, then a
cosine decay to a floor; gradient clipping; an estimate of the losses every `eval_interval`
iterations over `eval_iters` batches. Run alone, or under torchrun for DDP (each process draws
its own batches, `batch_size` of them per iteration):

    python -m examples.nanogpt_style.data --out /tmp/nano
    python examples/nanogpt_style/original.py --data /tmp/nano --seed 0 --save model.pt --out result.json
    python -m torch.distributed.run --nproc_per_node 2 examples/nanogpt_style/original.py --data /tmp/nano ...

Rank 0 saves the final model (a plain state_dict) and writes the last estimate as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.nanogpt_style.data import tokens  # noqa: E402
from pipelines.charlm.model import CharGPT  # noqa: E402

# The recipe (the port's default_config and Args hold the same numbers).
MAX_ITERS, WARMUP_ITERS, LR, MIN_LR = 300, 30, 1e-3, 1e-4
BATCH_SIZE, BLOCK, LAYERS, WIDTH, HEADS = 8, 64, 2, 128, 4
WEIGHT_DECAY, BETA2, GRAD_CLIP = 0.1, 0.99, 1.0
EVAL_INTERVAL, EVAL_ITERS = 50, 10


def get_lr(it: int, max_iters: int) -> float:
    """Linear warmup from 0 over WARMUP_ITERS, then cosine from LR down to MIN_LR at max_iters."""
    if it < WARMUP_ITERS:
        return LR * it / WARMUP_ITERS
    progress = (it - WARMUP_ITERS) / max(1, max_iters - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (LR - MIN_LR)


def configure_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW; weight decay on the weight matrices (and embeddings), none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, BETA2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="directory of train.bin and val.bin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-iters", type=int, default=MAX_ITERS)
    parser.add_argument("--save", help="where rank 0 saves the final state_dict")
    parser.add_argument("--out", help="where rank 0 writes the last estimate as JSON")
    args = parser.parse_args()

    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    batches = torch.Generator().manual_seed(1000 * args.seed + rank)  # each rank its own batches

    data = {split: tokens(args.data, split) for split in ("train", "val")}

    def get_batch(split: str) -> torch.Tensor:
        starts = torch.randint(len(data[split]) - BLOCK, (BATCH_SIZE,), generator=batches)
        return torch.stack([torch.from_numpy(data[split][s : s + BLOCK + 1].astype("int64")) for s in starts.tolist()])

    def loss_of(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
        logits = model(window[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        model.eval()
        out = {}
        for split in ("train", "val"):
            losses = torch.tensor([loss_of(model, get_batch(split)).item() for _ in range(EVAL_ITERS)]).mean()
            if ddp:
                dist.all_reduce(losses)
                losses /= world
            out[f"{split}_loss"] = float(losses)
        model.train()
        return out

    model = CharGPT(block=BLOCK, width=WIDTH, layers=LAYERS, heads=HEADS)
    if ddp:
        model = DDP(model)
    optimizer = configure_optimizer(model.module if ddp else model)
    started = time.time()
    for it in range(args.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, args.max_iters)
        if it and it % EVAL_INTERVAL == 0:
            estimate = estimate_loss()
            if rank == 0:
                print(f"iter {it}: train {estimate['train_loss']:.4f}, val {estimate['val_loss']:.4f}", flush=True)
        loss = loss_of(model, get_batch("train"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    estimate = estimate_loss()
    if rank == 0:
        print(f"iter {args.max_iters}: train {estimate['train_loss']:.4f}, val {estimate['val_loss']:.4f}")
        if args.save:
            torch.save((model.module if ddp else model).state_dict(), args.save)
        if args.out:
            Path(args.out).write_text(json.dumps({**estimate, "wall_time_s": time.time() - started}))
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
