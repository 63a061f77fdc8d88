"""Run under `python -m torch.distributed.run --standalone --nproc_per_node=2 tests/syncbn_ranks.py OUT`:
a model with BatchNorm, converted for --sync-batchnorm, takes one DDP step over gloo with each
rank holding half of a fixed batch; rank 0 saves the output, the gradients and the running
statistics to OUT for tests/test_check.py to compare with one process over the whole batch."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from raytrain.parallel.batchnorm import sync_batchnorm_layers


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
        torch.nn.BatchNorm1d(3),
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 1, 8, 8, generator=generator) * 3 + 1, torch.randn(16, 3, generator=generator)


def step(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = module(x)
    ((out - y) ** 2).mean().backward()
    return out.detach()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = sync_batchnorm_layers(model(), torch.device("cpu"))
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    x, y = batch()
    out = step(ddp, x.chunk(world)[rank], y.chunk(world)[rank])
    outs = [torch.zeros_like(out) for _ in range(world)]
    dist.all_gather(outs, out)
    if rank == 0:
        grads = {name: p.grad for name, p in plain.named_parameters()}
        torch.save({"out": torch.cat(outs), "grads": grads, "state": plain.state_dict()}, sys.argv[1])
    # Every rank waits for rank 0's file before the group is torn down: gloo aborts a rank
    # that leaves while its peer is still busy ("terminate called without an active exception",
    # seen in the slow stage on a loaded machine; the torchrun template's ranks meet likewise).
    dist.barrier()
    dist.destroy_process_group()
