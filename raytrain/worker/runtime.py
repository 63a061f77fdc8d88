"""Worker-side Ray Train and torch.distributed calls, in one place.

The per-worker loop talks to this module only, so it reads the same in local mode
(`workers=0`: the function runs in the driver, no process group) and in a real
worker group.
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointUploadMode

from raytrain.errors import find_user_error
from raytrain.rundir.storage import Store


class Runtime:
    """Rank, world size, device and the collectives of the current worker over its process
    group: Ray Train's worker group, every rank of which takes every step. How a failure is
    recovered from is the recovery object's (`raytrain.faults.restart`); per-step fault
    tolerance's replica sees its quorum through `raytrain.faults.per_step.ReplicaRuntime`."""

    counts_flops = True  # rank 0 measures a micro-batch's FLOPs (the goodput's MFU)

    def __init__(self, gpu: bool | None = None) -> None:
        """`gpu`: --gpu / --no-gpu (None: auto), which local mode's device follows; a worker
        group's device is the one Ray Train gave its worker."""
        context = ray.train.get_context()
        self.world_rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.local_rank = context.get_local_rank()
        # The nodes the job spans (failures come per node: --checkpoint-every auto's rate).
        self.nodes = max(1, -(-self.world_size // max(1, context.get_local_world_size())))
        self.distributed = dist.is_available() and dist.is_initialized()
        self.device = ray.train.torch.get_device() if self.distributed else local_device(gpu)
        self.backend = dist.get_backend() if self.distributed else "none (local mode)"
        self._checkpoint_group = None  # DCP's gloo group (dcp_options)

    def alone(self) -> "Runtime":
        """This worker by itself, on the same device: rank 0 of 1, no collectives, no DDP
        (`raytrain check` takes its 1-worker reference steps so, on rank 0)."""
        runtime = copy.copy(self)
        runtime.world_rank, runtime.world_size, runtime.local_rank, runtime.nodes = 0, 1, 0, 1
        runtime.distributed, runtime.backend = False, "none (one worker by itself)"
        return runtime

    @property
    def is_rank0(self) -> bool:
        return self.world_rank == 0

    # -- collectives --------------------------------------------------------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few floats over all ranks (one collective); identity in local mode."""
        if not self.distributed or self.world_size == 1:
            return list(values)
        return sum_over_default_group(values, self._collective_device())

    def group_sum(self, values: list[float]) -> list[float]:
        """Sum over the workers that continue from one checkpoint together: all of them."""
        return self.all_reduce_sum(values)

    def evaluation_share(self) -> tuple[int, int]:
        """(rank, world size) over which validation is split and reduced."""
        return self.world_rank, self.world_size

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (a collective)."""
        if not self.distributed or self.world_size == 1:
            return [value]
        return gather_over_default_group(value, self.world_size)

    def _collective_device(self) -> torch.device:
        # gloo reduces CPU tensors; NCCL (a worker's on a GPU) needs them on the GPU.
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # -- model --------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> torch.nn.Module:
        """Move to the device; wrap in DDP when there is more than one worker."""
        if not self.distributed:
            return model.to(self.device)
        return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=_ddp_kwargs(ddp_kwargs))

    # -- data ---------------------------------------------------------------------------
    def get_object(self, ref: Any) -> Any:
        """An object the driver put in Ray's object store, or a task's result (numpy arrays
        come back zero-copy). A task that failed on bad input raises that error itself."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            fault = find_user_error(exc)
            if fault is not None:
                raise fault from None
            raise

    # -- checkpoints and reports --------------------------------------------------------
    def dcp_options(self, load: bool = False) -> dict[str, Any]:
        """DCP's process group: a gloo group of its own for saves, whose collectives run in a
        background thread and on host memory (NCCL's would contend with training's); loads
        use the default group."""
        if load:
            return {}
        if self._checkpoint_group is None:  # a collective: every rank creates it at its first save
            self._checkpoint_group = dist.new_group(backend="gloo")
        # DCP's own staging (a copy into new host memory at each save): a pinned stager kept across
        # saves failed its second save on torch 2.11 on an H200 (KeyError: <class 'type'> in
        # StateDictStager; benchmarks/RESULTS.md §28), and torch 2.11 is what GPU machines have.
        return {"process_group": self._checkpoint_group}

    def latest_checkpoint(self, store: Store) -> Path | None:
        """Ray's latest checkpoint where listing the run `store` may not find it (`Store.resume_also`)."""
        latest = ray.train.get_checkpoint()
        return None if latest is None else store.resume_also(latest.path)

    def report(
        self, metrics: dict[str, Any], name: str = "", staging: Path | None = None, publish=None, asynchronous=True
    ) -> None:
        """Report `metrics` to Ray Train from every rank (a barrier); rank 0's (`publish`) with
        the checkpoint `name` staged in `staging`: Ray runs the publish step as its upload
        function, and registers (and prunes the oldest of) complete checkpoints only. Reports
        are asynchronous unless --no-checkpoint-async: a metrics report never waits behind an
        upload (`raytrain.worker.checkpointer`)."""
        mode = CheckpointUploadMode.ASYNC if asynchronous else CheckpointUploadMode.SYNC
        if publish is None:
            ray.train.report(metrics, checkpoint=None, **({"checkpoint_upload_mode": mode} if self.distributed else {}))
            return
        target = publish.target
        if not self.distributed:  # local mode: Ray keeps the checkpoint in memory only
            publish.run()
            ray.train.report(metrics, checkpoint=Checkpoint(target.root, filesystem=target.fs))
            return

        def upload(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
            publish.run()
            storage = ray.train.get_context().get_storage()  # Ray accepts its own file system object only
            return Checkpoint(target.root, filesystem=storage.storage_filesystem)

        ray.train.report(
            metrics,
            checkpoint=Checkpoint.from_directory(str(staging)),
            checkpoint_dir_name=name,
            checkpoint_upload_fn=upload,
            delete_local_checkpoint_after_upload=False,
            checkpoint_upload_mode=mode,
        )


def sum_over_default_group(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over this process's default group (one collective; `device`: where its
    backend reduces, the GPU for NCCL)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def gather_over_default_group(value: Any, size: int) -> list[Any]:
    """Every member of this process's default group's `value` (`size` members), in rank order."""
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, value)
    return gathered


def group_barrier() -> None:
    """Every worker of the group meets here (Ray Train's barrier; it gives up after
    RAY_TRAIN_COLLECTIVE_TIMEOUT_S, and raises at once when Ray replaces a lost worker)."""
    import ray.train.collective

    ray.train.collective.barrier()


def _ddp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Our flag names to this torch's DDP arguments (torch >= 2.12 renamed broadcast_buffers)."""
    kwargs = dict(kwargs)
    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = kwargs.pop("broadcast_buffers")
    return kwargs


def node_address() -> str:
    """This worker's host as the others reach it: its Ray node's address (the hostname where
    Ray is not running: local mode)."""
    import socket

    return ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()


def local_device(gpu: bool | None, cuda_visible: bool | None = None) -> torch.device:
    """Local mode's device (the loop in this process): the first visible GPU unless --no-gpu, or
    when there is none, the CPU. `cuda_visible`: whether this process sees a GPU (None: ask torch)."""
    if cuda_visible is None:
        cuda_visible = torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "x") != ""
    return torch.device("cuda", 0) if cuda_visible and gpu is not False else torch.device("cpu")
