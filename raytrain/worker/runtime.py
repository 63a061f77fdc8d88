"""Worker-side Ray Train and torch.distributed calls, in one place.

The per-worker loop talks to this module only, so it reads the same in local mode
(`workers=0`: the function runs in the driver, no process group) and in a real
worker group.
"""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path
from typing import Any, Callable

import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointUploadMode

from raytrain.errors import find_user_error
from raytrain.rundir import checkpoints as ckpt
from raytrain.rundir import storage_errors
from raytrain.worker.state import Save

# How long rank 0 waits at the end of a run for Ray's upload step to rename its last checkpoint.
PUBLISH_WAIT_S = 60.0


class Runtime:
    """Rank, world size, device and the collective helpers of the current worker."""

    def __init__(self) -> None:
        context = ray.train.get_context()
        self.world_rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.local_rank = context.get_local_rank()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.device = ray.train.torch.get_device() if self.distributed else _local_device()
        self.backend = dist.get_backend() if self.distributed else "none (local mode)"
        self._checkpoint_group = None  # DCP's gloo group (dcp_options)
        self._pending: Save | None = None  # this rank's checkpoint being written

    @property
    def is_rank0(self) -> bool:
        return self.world_rank == 0

    # -- collectives --------------------------------------------------------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few floats over all ranks (one collective); identity in local mode."""
        if not self.distributed or self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def evaluation_share(self) -> tuple[int, int]:
        """(rank, world size) over which validation is split and reduced."""
        return self.world_rank, self.world_size

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (a collective)."""
        if not self.distributed or self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def _collective_device(self) -> torch.device:
        # gloo reduces CPU tensors; NCCL needs them on the GPU.
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # -- model --------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> torch.nn.Module:
        """Move to the device; wrap in DDP when there is more than one worker."""
        if not self.distributed:
            return model.to(self.device)
        return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=_ddp_kwargs(ddp_kwargs))

    # -- data ---------------------------------------------------------------------------
    def dataset(self, name: str):
        """The named dataset's iterator (unsplit: every rank sees all rows and takes its own)."""
        return ray.train.get_dataset_shard(name)

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
    @property
    def distributed_checkpoints(self) -> bool:
        """Whether every rank writes and reads its part of a checkpoint together (DCP over the
        process group), rather than one process writing and reading all of it."""
        return self.distributed

    def dcp_options(self, load: bool = False) -> dict[str, Any]:
        """DCP's process group: a gloo group of its own for saves, whose collectives run in a
        background thread and on host memory (NCCL's would contend with training's); loads
        use the default group."""
        if load:
            return {}
        if self._checkpoint_group is None:  # a collective: every rank creates it at its first save
            self._checkpoint_group = dist.new_group(backend="gloo")
        return {"process_group": self._checkpoint_group}

    def latest_checkpoint(self) -> Checkpoint | None:
        return ray.train.get_checkpoint()

    def report(
        self,
        metrics: dict[str, Any],
        step: int,
        write: Callable[[Path, bool], Save] | None,
        run_dir: Path,
        asynchronous: bool = True,
    ) -> None:
        """Report metrics from every rank (a barrier); with `write`, a checkpoint of this step.

        Every rank writes its part into RUN_DIR/.staging/NAME (`write(directory, distributed)`),
        in the background: the loop waits only while the state is copied to host memory. Rank
        0's report hands Ray Train an upload step that waits for the files and renames the
        directory into the run directory, so a checkpoint is never seen half-written and Ray
        registers it (and prunes the oldest) only when complete. Not `asynchronous`
        (--no-checkpoint-async): every rank waits for its files before reporting. A storage error
        names the path and errno; a failed write never touches the previous checkpoint."""
        if write is None:
            ray.train.report(metrics, checkpoint=None)
            return
        self.finish_checkpoints()  # one in flight at a time: bounded host memory
        name = self.all_gather_object(ckpt.checkpoint_name(step) if self.is_rank0 else None)[0]
        staging, final = ckpt.staging_dir(run_dir) / name, Path(run_dir) / name
        with storage_errors(staging, "write the checkpoint"):
            save = self._pending = write(staging, self.distributed_checkpoints)
            if not asynchronous:
                save.wait()

        def publish(checkpoint: Checkpoint | None = None, dir_name: str = name) -> Checkpoint:
            with storage_errors(staging, "write the checkpoint"):
                save.wait()
            with storage_errors(final, "publish the checkpoint"):
                os.rename(staging, final)
            return Checkpoint.from_directory(str(final))

        if not self.distributed:  # local mode: Ray keeps the checkpoint in memory only
            ray.train.report(metrics, checkpoint=publish())
            return
        upload = {"checkpoint_upload_mode": CheckpointUploadMode.ASYNC if asynchronous else CheckpointUploadMode.SYNC}
        if not self.is_rank0:
            ray.train.report(metrics, checkpoint=None, **upload)
            return
        ray.train.report(
            metrics,
            checkpoint=Checkpoint.from_directory(str(staging)),
            checkpoint_dir_name=name,
            checkpoint_upload_fn=publish,
            delete_local_checkpoint_after_upload=False,
            **upload,
        )

    def finish_checkpoints(self, timeout_s: float | None = None) -> None:
        """Wait for this rank's checkpoint files being written (rank 0: until the checkpoint is
        in the run directory), surfacing a write that failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with storage_errors(pending.directory, "write the checkpoint"):
                pending.wait(timeout_s)
            # rank 0: Ray's upload step renames it; wait for that, briefly, so the run's end sees it
            deadline = time.monotonic() + min(PUBLISH_WAIT_S, timeout_s or PUBLISH_WAIT_S)
            while self.is_rank0 and self.distributed and pending.directory.exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def _ddp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Our flag names to this torch's DDP arguments (torch >= 2.12 renamed broadcast_buffers)."""
    kwargs = dict(kwargs)
    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = kwargs.pop("broadcast_buffers")
    return kwargs


def _local_device() -> torch.device:
    if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "":
        return torch.device("cuda", 0)
    return torch.device("cpu")
