"""The process group's network: each worker's gloo and NCCL bound to the interface that holds
its own Ray node address (`raytrain.rules.network`), before Ray Train creates the group.

Ray Train sets MASTER_ADDR to rank 0's node address and then calls `init_process_group` on
every worker (its TorchConfig backend's `on_start`); gloo's and NCCL's own choice of interface
is made inside that call, from the worker's environment, so raytrain's backends
(`BoundTorchConfig` here; per-step mode's in `raytrain.faults.replacement`) bind first
(`BindsInterfaces`). A group that cannot form is said in one message naming the host, the
address it tried and the fix: a `ProcessGroupNetworkError` (exit status 2, never retried) when
the interfaces are wrong (`check_host_interfaces` says the same on the driver before an
embedded Ray starts), else an error Ray's failure policy may retry (a firewall; a host cut off
while the group formed).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from raytrain.errors import UserError
from raytrain.rules import network
from raytrain.rules.network import WorkerNetwork


def host_interfaces() -> dict[str, list[str]]:
    """This host's interfaces that hold an IP address (gloo and NCCL take no other), each with
    its addresses, in the kernel's order."""
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    found = {
        name: [e.address for e in entries if e.family in families] for name, entries in psutil.net_if_addrs().items()
    }
    return {name: addresses for name, addresses in found.items() if addresses}


def check_host_interfaces() -> None:
    """Raise ProcessGroupNetworkError when an interface variable of this process's environment
    names an interface this host lacks (the driver of an embedded Ray, whose workers inherit it)."""
    problems = network.host_problems(os.environ, socket.gethostname(), host_interfaces())
    if problems:
        raise ProcessGroupNetworkError(" ".join(problems))


def bind_to_node_interface() -> WorkerNetwork:
    """In a worker: set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface that holds
    this node's Ray address, each unless already set, and say what they are, and what of them
    this host lacks."""
    import ray

    address = ray.util.get_node_ip_address()
    interfaces = host_interfaces()
    values = network.interface_env(address, interfaces, os.environ)
    os.environ.update(values)
    return WorkerNetwork(
        hostname=socket.gethostname(),
        node_address=address,
        interface=network.interface_holding(address, interfaces),
        chosen={name: os.environ[name] for name in network.INTERFACE_VARIABLES if name in os.environ},
        set_here=tuple(sorted(values)),
        problems=tuple(network.host_problems(os.environ, socket.gethostname(), interfaces)),
    )


def connect_now() -> None:
    """In a worker: a one-element all-reduce over its process group (NCCL's on the worker's GPU).
    NCCL connects at a group's first collective, not when it is created: a bad interface fails
    here, not in DDP's first broadcast."""
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from raytrain.worker.runtime import sum_over_default_group

    nccl = dist.get_backend() == "nccl"
    sum_over_default_group([1.0], ray.train.torch.get_device() if nccl else torch.device("cpu"))


# Seconds Ray Train waits for the workers to destroy their process group before it kills them
# (a live worker's destroy takes well under a second).
PROCESS_GROUP_SHUTDOWN_S = 3


class ProcessGroupNetworkError(UserError, RuntimeError):
    """The workers' process group cannot form: an interface variable names an interface a host
    lacks, or the group could not connect across hosts (the host, the address it tried and the
    interface variables that fix it). Exit status 2; never retried."""


class BindsInterfaces:
    """A Ray Train torch backend's `on_start`, preceded by `bind_to_node_interface` on every
    worker of the group it starts (a whole worker group, or one replica group), and on NCCL
    followed by `connect_now`."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        from raytrain.instruments.notice import catch_notices

        worker_group.execute(catch_notices)  # in each worker's main thread, where a signal handler is set
        workers = worker_group.execute(bind_to_node_interface)
        problems = list(dict.fromkeys(problem for worker in workers for problem in worker.problems))
        if problems:  # every attempt would fail alike, on this host
            raise ProcessGroupNetworkError(" ".join(problems))
        try:
            super().on_start(worker_group, backend_config)  # type: ignore[misc]
            if getattr(backend_config, "backend", None) == "nccl":
                worker_group.execute(connect_now)
        except Exception as exc:
            failure = network.connect_failure(str(exc), workers)
            if failure is None:
                raise
            if failure.deterministic:
                raise ProcessGroupNetworkError(failure.message) from None
            raise RuntimeError(failure.message) from exc  # Ray's policy may retry it (--max-failures)

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        """Ray's, with a shorter wait for the workers to destroy their process group: it waits up to
        30 s (TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, read where this runs, in the controller), then
        kills them all. After a host was cut off or frozen, its workers never answer and the others
        are stuck in a collective with them: those 30 s were most of a restart (RESULTS.md §33)."""
        from ray.train.constants import TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S

        os.environ.setdefault(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, str(PROCESS_GROUP_SHUTDOWN_S))
        super().on_shutdown(worker_group, backend_config)  # type: ignore[misc]


class _Backend(BindsInterfaces, _TorchBackend):
    """Ray Train's torch backend, bound to each node's interface."""


class BoundTorchConfig(TorchConfig):
    """`TorchConfig` whose backend binds gloo and NCCL to each node's interface first."""

    @property
    def backend_cls(self):
        return _Backend
