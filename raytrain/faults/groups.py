"""A per-step replica as a group of workers: one worker (`Solo`), or K workers that shard one
copy of the model between them (`ReplicaGroup`, `--replica-group-size K`, HSDP).

What differs between the two is said here once: how the replica's members meet, sum and
gather (a group of one: nothing to do), how its model joins torchft's step (torchft's DDP, or
its gradient shards averaged across groups: `raytrain.parallel.hsdp`), its Manager's place,
whether it writes checkpoints together (DCP over the group), and what ends it (a group
loses all its workers or none: a worker that sees a member gone leaves, `GroupWatch`).
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta
from typing import Any

import torch

from raytrain.parallel.hsdp import GroupWatch
from raytrain.rules import network
from raytrain.rules import replicas as rules
from raytrain.rundir import RunDir
from raytrain.rundir.records import Event, Kind
from raytrain.rundir.storage import Store
from raytrain.worker.runtime import gather_over_default_group, sum_over_default_group

# A worker of a replica group of several leaves once a member of its group has not beaten for
# this long (`raytrain.parallel.hsdp.GroupWatch`). The controller takes a lost worker's group
# out first, within its poll (`raytrain.faults.replacement`); the watch is for a loss the
# controller does not see. Long enough that a loaded machine, where a process can go a few
# seconds unscheduled, is not taken for a loss (2.5 s seen with 4 workers on 2 cores).
GROUP_LOST_AFTER_S = 15.0


class Solo:
    """A replica of one worker: rank 0 of 1 inside its group (RANK/WORLD_SIZE hold Ray Train's)."""

    size, rank = 1, 0
    writes_together = False  # a replica of one writes and reads all of a checkpoint by itself

    def __init__(self, replica_rank: int) -> None:
        self.replica_id = f"raytrain_{replica_rank}"

    def manager_place(self) -> dict[str, Any]:
        """The Manager's rank and world size within the replica."""
        return {"rank": 0, "world_size": 1}

    def join(self, model: torch.nn.Module, manager: Any) -> torch.nn.Module:
        """`model` in torchft's DDP: gradients averaged over each step's participants."""
        from torchft import DistributedDataParallel

        return DistributedDataParallel(manager, model)

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def stop(self) -> None:
        pass


class ReplicaGroup:
    """A replica of `size` workers that shard one copy of the model (see the module's docstring)."""

    writes_together = True  # DCP over the group

    def __init__(self, replica_rank: int, size: int, timeout_s: float, device: torch.device, run_dir: Store) -> None:
        """Form the group's process group (its workers' default group, in place of Ray Train's
        group of one) on the store the controller hosts for it (`raytrain.faults.replacement`),
        and start the watch that ends this worker once a member is gone."""
        import torch.distributed as dist

        self.group, self.rank = rules.group_of(replica_rank, size)
        self.size, self.replica_rank, self.run_dir = size, replica_rank, run_dir
        self.device = device  # where its collectives' tensors go (NCCL's on the GPU)
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.replica_id = f"raytrain_group_{self.group}"
        host, port, generation = os.environ[rules.GROUP_STORE_ENV].rsplit(":", 2)
        self.store_address = (host, int(port))
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"raytrain/group/{generation}", store), rank=self.rank,
            world_size=size, timeout=timeout,
        )  # fmt: skip
        watched = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
        self.watch = GroupWatch(watched, self.rank, size, self._leave, lost_after_s=GROUP_LOST_AFTER_S)
        self.watch.run_in_background()

    def manager_place(self) -> dict[str, Any]:
        """Rank r of every group averages with rank r of the others, through the group's store."""
        host, port = self.store_address
        return {"rank": self.rank, "world_size": self.size, "store_addr": host, "store_port": port}

    def join(self, model: torch.nn.Module, manager: Any) -> torch.nn.Module:
        """`model`, its gradient shards averaged across the step's groups."""
        from raytrain.parallel.hsdp import average_across_groups

        average_across_groups(model, manager)
        return model

    def sum(self, values: list[float]) -> list[float]:
        """Sum over the group (a collective within it: the group is its workers' default process
        group). What its workers decide from it, they decide alike."""
        return sum_over_default_group(values, self.device)

    def gather(self, value: Any) -> list[Any]:
        """Every worker of the group's `value`, by rank in the group."""
        return gather_over_default_group(value, self.size)

    def stop(self) -> None:
        self.watch.stop()

    def _leave(self, why: str) -> None:
        """A member of this worker's group is gone, and its shards with it: say so, then exit,
        so that the whole group is replaced while the other groups go on."""
        message = f"Replica group {self.group} lost a worker ({why}): its worker {self.rank} leaves too"
        with contextlib.suppress(Exception):
            RunDir(self.run_dir).append_event(
                Event(Kind.QUORUM, message, extra={"group": self.group, "replica": self.replica_rank})
            )
        os._exit(1)


def replica_of(
    replica_rank: int, size: int, timeout_s: float, device: torch.device, run_dir: Store
) -> Solo | ReplicaGroup:
    """This worker's replica: itself, or its group of `size`."""
    return ReplicaGroup(replica_rank, size, timeout_s, device, run_dir) if size > 1 else Solo(replica_rank)


def replica_process_group(pg_class: type, address: str) -> type:
    """torchft's process group `pg_class`, as a replica needs it across hosts:

    - its reconfigure handle names its rendezvous store by `address` (torchft names it by
      `socket.gethostname()`; the store itself listens on every interface);
    - each collective waits for a missing peer the peer wait (`set_peer_wait`, per step by
      `ReplicaRuntime.wait_for_peers`), not the group's timeout, which a gloo or NCCL
      collective would otherwise wait out whatever torchft's Manager waits (its `wrap_future`
      bounds a step's future, but a `Work.wait` blocks in the collective itself). On gloo it is
      each collective's own timeout. torchft's NCCL group (where NCCL can abort) clears that
      timeout on purpose and aborts the communicator itself after its group timeout: there the
      peer wait is that timeout (`set_timeout`), and torch's own NCCL watchdog stays off."""

    class ReplicaProcessGroup(pg_class):  # type: ignore[valid-type, misc]
        op_timeout: timedelta | None = None

        def get_reconfigure_handle(self) -> str:
            handle = json.loads(super().get_reconfigure_handle())
            handle["store"] = network.with_host(handle["store"], address)
            return json.dumps(handle)

        def set_peer_wait(self, timeout: timedelta) -> None:
            if getattr(self, "_use_abort", False):  # torchft's NCCL: its own abort timer
                self.set_timeout(timeout)
            else:
                self.op_timeout = timeout

        def _opts_hook(self, opts: Any) -> Any:
            opts = super()._opts_hook(opts)
            if self.op_timeout is not None and hasattr(opts, "timeout"):
                opts.timeout = self.op_timeout
            return opts

    ReplicaProcessGroup.__name__ = ReplicaProcessGroup.__qualname__ = pg_class.__name__
    return ReplicaProcessGroup
