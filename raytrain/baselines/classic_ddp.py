"""The classic hand-written template that raytrain replaces: the baseline of `raytrain bench`.

Under torchrun it is the seed's recipe, DDP + DistributedSampler + DataLoader(num_workers=0):

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 \\
        -m raytrain.baselines.classic_ddp --pipeline digits --data train.npz --config config.json \\
        --epochs 3 --out out.json

Run with plain `python -m raytrain.baselines.classic_ddp` it is the single-process training
loop a user starts from (no process group, no DDP, a shuffling DataLoader). The model, loss and batch come from the
same raytrain pipeline and resolved config as the raytrain run; the data are the rows of
its training dataset, saved by `raytrain bench` as a .npz of columns.

Throughput is measured like raytrain's loop measures it: the first `--warmup-steps` steps
of every epoch are left out, and a step is timed from asking for its batch to the end of
`optimizer.step()`; logging between steps is not timed. Rank 0 writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain.config import TrainConfig
from raytrain.parallel.device import apply_tf32
from raytrain.parallel.holding import compute_dtype
from raytrain.pipeline import load_pipeline


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True, help="built-in name or module:attr")
    parser.add_argument("--data", required=True, help=".npz of the training columns")
    parser.add_argument("--config", required=True, help="JSON of the resolved TrainConfig")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out at the start of every epoch")
    parser.add_argument("--out", required=True, help="where rank 0 writes its figures (JSON)")
    parser.add_argument("--val", help=".npz of validation columns: the final validation loss is written too")
    return parser.parse_args()


def train_classic() -> None:
    """Train and time as the classic template does; rank 0 writes the figures to --out."""
    args = parse_args()
    cfg = TrainConfig.from_dict(json.loads(open(args.config).read()))
    pipeline = load_pipeline(args.pipeline)

    ddp = "RANK" in os.environ  # started by torchrun?
    use_cuda = torch.cuda.is_available() and cfg.gpu is not False
    if ddp:
        dist.init_process_group("nccl" if use_cuda else "gloo")
        rank, world_size, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    else:
        rank, world_size, local_rank = 0, 1, 0
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        apply_tf32(cfg.tf32)  # the same fp32 matmuls as raytrain's run (--tf32, default on)

    torch.manual_seed(cfg.seed)
    model = pipeline.build_model(cfg).to(device)
    if ddp:
        model = DDP(model, device_ids=[local_rank] if use_cuda else None, **ddp_arguments(cfg))

    with np.load(args.data) as data:
        names = list(data.files)
        dataset = TensorDataset(*[torch.from_numpy(data[name]) for name in names])
    per_worker = math.ceil((cfg.global_batch_size or cfg.batch_size_per_worker * world_size) / world_size)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed) if ddp else None
    loader = DataLoader(
        dataset, batch_size=per_worker, shuffle=sampler is None, sampler=sampler, num_workers=0, pin_memory=use_cuda
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps)))
    )
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    dtype = compute_dtype(cfg.precision)
    autocast = contextlib.nullcontext if dtype is None else lambda: torch.autocast(device.type, dtype=dtype)

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    phases = {"data_wait": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    steady_samples, steady_time, steady_steps = 0, 0.0, 0
    model.train()
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        epoch_loss = torch.zeros(2, dtype=torch.float64)  # sample-weighted sum, samples
        batches = iter(loader)
        for step in range(len(loader)):
            tick = time.perf_counter()
            columns = next(batches)
            batch = {name: tensor.to(device, non_blocking=use_cuda) for name, tensor in zip(names, columns)}
            sync()
            t_data = time.perf_counter()
            with autocast():
                output = pipeline.compute_loss(model, batch)
            loss = output[0] if isinstance(output, tuple) else output
            scaler.scale(loss).backward()
            sync()
            t_backward = time.perf_counter()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sync()
            done = time.perf_counter()
            if step >= args.warmup_steps:
                steady_steps += 1
                steady_samples += len(columns[0]) * world_size
                steady_time += done - tick
                phases["data_wait"] += t_data - tick
                phases["forward_backward"] += t_backward - t_data
                phases["optimizer"] += done - t_backward
            if step % 10 == 0 and rank == 0:
                last_loss = loss.item()  # what the template logs; outside the timed step
            epoch_loss += torch.tensor([float(loss.detach()) * len(columns[0]), len(columns[0])], dtype=torch.float64)
    if ddp:
        dist.all_reduce(epoch_loss)
    final = {"train_loss": float(epoch_loss[0] / epoch_loss[1])}
    if args.val:
        with np.load(args.val) as data, torch.no_grad():
            model.eval()
            val = {name: torch.from_numpy(data[name]).to(device) for name in data.files}
            output = pipeline.compute_loss(model, val)
            final["val_loss"] = float(output[0] if isinstance(output, tuple) else output)

    if rank == 0:
        result = {
            "mode": "torchrun" if ddp else "plain",
            "world_size": world_size,
            "per_worker_batch": per_worker,
            "threads": torch.get_num_threads(),
            "epochs": args.epochs,
            "steady_steps": steady_steps,
            "steady_samples": steady_samples,
            "steady_time_s": steady_time,
            "steady_samples_per_s": steady_samples / steady_time if steady_time else None,
            "phase_time_s": phases,
            "last_loss": last_loss,
            **final,
        }
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    if ddp:
        # Together: on torch 2.11, gloo aborted a rank ("terminate called without an active
        # exception") that tore its group down while rank 0 was still writing the results.
        dist.barrier()
        dist.destroy_process_group()


def ddp_arguments(cfg: TrainConfig) -> dict:
    """The same DDP flags as the raytrain run (torch >= 2.12 calls broadcast_buffers forward_sync_buffers).
    Written out here rather than taken from raytrain.worker.runtime, which needs Ray: the template runs without it."""
    kwargs = {
        "bucket_cap_mb": cfg.ddp.bucket_cap_mb,
        "gradient_as_bucket_view": cfg.ddp.gradient_as_bucket_view,
        "static_graph": cfg.ddp.static_graph,
        "find_unused_parameters": cfg.ddp.find_unused_parameters,
    }
    buffers = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else "broadcast_buffers"
    )
    kwargs[buffers] = cfg.ddp.broadcast_buffers
    return kwargs


if __name__ == "__main__":
    train_classic()
