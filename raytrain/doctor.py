"""`raytrain doctor`: what the cluster has, and whether a run will work on it."""

from __future__ import annotations

import os
import platform
import socket
import uuid
from pathlib import Path
from typing import Callable

from raytrain.config import DEFAULT_STORAGE


def run_doctor(address: str | None, storage: str | None, echo: Callable[[str], None]) -> int:
    """Print a report; return 0 when a run will work, 1 (with the fix) when it will not."""
    import ray
    import torch

    import raytrain

    problems: list[str] = []
    echo(f"raytrain {raytrain.__version__}, ray {ray.__version__}, torch {torch.__version__}, python {platform.python_version()}")
    cuda = torch.version.cuda or "none (CPU build)"
    nccl = torch.distributed.is_nccl_available() if torch.distributed.is_available() else False
    echo(f"torch CUDA: {cuda}; CUDA usable here: {torch.cuda.is_available()}; NCCL available: {nccl}; gloo available: {torch.distributed.is_gloo_available()}")

    address = address or os.environ.get("RAY_ADDRESS")
    started_here = not ray.is_initialized()
    if started_here:
        try:
            if address:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            else:
                ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        except Exception as exc:  # connection errors come in several types
            echo(f"FAIL cannot reach Ray at {address or 'a new local instance'}: {exc}")
            echo("  fix: check --address/RAY_ADDRESS (e.g. 127.0.0.1:6379), that the head is running (ray status), and RAY_AUTH_MODE=token if the cluster uses token auth")
            return 1
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        echo(f"Ray cluster: {'connected to ' + address if address else 'embedded local Ray'}; {len(nodes)} node(s)")
        total_gpus = 0
        for node in nodes:
            res = node.get("Resources", {})
            gpus = int(res.get("GPU", 0))
            total_gpus += gpus
            kinds = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            gpu_text = f"{gpus} GPU" + (f" ({', '.join(kinds)})" if kinds else "") if gpus else "no GPU"
            memory_gib = res.get("memory", 0) / 2**30
            echo(f"  node {node.get('NodeManagerAddress')}: {res.get('CPU', 0):g} CPUs, {gpu_text}, {memory_gib:.1f} GiB memory for tasks")
        if total_gpus and torch.cuda.is_available():
            echo(f"  GPU model seen by this process: {torch.cuda.get_device_name(0)}")
        backend = "nccl (GPU workers)" if total_gpus else "gloo (CPU workers)"
        echo(f"Backend a run will use: {backend}")
        if total_gpus and not nccl:
            problems.append("the cluster has GPUs but this torch has no NCCL; install a CUDA build of torch (scripts/install.sh on the GPU machine)")
        problems += check_storage(storage, multi_node=len(nodes) > 1, echo=echo)
    finally:
        if started_here:
            ray.shutdown()
    for problem in problems:
        echo(f"FAIL {problem}")
    echo("OK: a run will work here." if not problems else f"{len(problems)} problem(s) found.")
    return 1 if problems else 0


def check_storage(storage: str | None, multi_node: bool, echo: Callable[[str], None]) -> list[str]:
    path = Path(os.path.expanduser(storage or DEFAULT_STORAGE)).absolute()
    if not path.exists():
        if storage:
            return [f"storage path {path} does not exist; create it (mkdir -p {path}) or pass another --storage"]
        parent = next((p for p in path.parents if p.exists()), Path("/"))
        if not os.access(parent, os.W_OK):
            return [f"default storage {path} cannot be created ({parent} is not writable); pass --storage DIR"]
        echo(f"Storage: {path} (will be created on the first run)")
        return []
    try:
        probe = path / f".raytrain-doctor-{uuid.uuid4().hex}"
        probe.write_text(socket.gethostname())
        probe.unlink()
    except OSError as exc:
        return [f"storage path {path} is not writable ({exc.strerror}); fix its permissions or pass another --storage"]
    echo(f"Storage: {path} (writable)")
    if multi_node and not _looks_shared(path):
        echo(
            f"  note: {path} looks node-local; multi-node runs need storage every node sees "
            "(an NFS/EFS mount), or checkpoints written on one node cannot be restored on another"
        )
    return []


def _looks_shared(path: Path) -> bool:
    """True when `path` sits on a network file system (NFS, CIFS, FUSE...), judged from /proc/mounts."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    best = max((m for m in mounts if str(path).startswith(m[1])), key=lambda m: len(m[1]), default=None)
    return bool(best) and best[2] in {"nfs", "nfs4", "cifs", "smbfs", "fuse", "fuse.sshfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "efs"}


__all__ = ["run_doctor", "check_storage"]
