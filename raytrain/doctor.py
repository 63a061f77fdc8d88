"""`raytrain doctor`: what the cluster has, and whether a run will work on it.

It joins the Ray a run would use (--address, else RAY_ADDRESS, else an embedded local Ray),
lists every node with its CPUs, GPUs (model), memory, torch/CUDA/NCCL and whether raytrain
imports there (a probe task pinned to each node), names the backend a run will use, and
checks the storage path: it exists, is writable, and — on a multi-node cluster — every node
sees the same directory (a file written here is read back on each node). Exit status 0 when
a run will work, 1 when something will not, each problem printed with its fix.
"""

from __future__ import annotations

import os
import platform
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raytrain.config import DEFAULT_STORAGE
from raytrain.driver.session import address_problem

PROBE_TIMEOUT_S = 90.0
_NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smbfs", "smb3", "fuse", "fuse.sshfs", "fuse.juicefs", "fuse.gcsfuse", "lustre", "gpfs",
    "beegfs", "ceph", "cephfs", "glusterfs", "fuse.glusterfs", "efs", "9p", "wekafs", "fuse.s3fs",
}  # fmt: skip


@dataclass
class StorageState:
    """What the driver (this process) found at the storage path."""

    path: str
    explicit: bool  # given with --storage (else the default)
    exists: bool = False
    is_dir: bool = False
    writable: bool = False
    error: str = ""
    marker: str = ""  # name of the file written here for the nodes to read back
    token: str = ""  # its content
    fs_type: str = ""


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)  # each: what is wrong; the fix
    notes: list[str] = field(default_factory=list)


def run_doctor(address: str | None, storage: str | None, echo: Callable[[str], None], probe_timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """Print a report; return 0 when a run will work, 1 (with the fix) when it will not."""
    import ray
    import torch

    import raytrain

    echo(f"raytrain {raytrain.__version__}, ray {ray.__version__}, torch {torch.__version__}, python {platform.python_version()} ({socket.gethostname()})")
    local = _torch_facts()
    echo(
        f"This machine: torch CUDA build {local['cuda'] or 'none (CPU build)'}; CUDA usable: {local['cuda_usable']}; "
        f"NCCL: {_nccl_text(local)}; gloo: {local['gloo']}"
    )

    state = inspect_storage(storage)
    address = address or os.environ.get("RAY_ADDRESS")
    started_here = not ray.is_initialized()
    unreachable = address_problem(address) if started_here and address else None
    if unreachable:
        # ray.init retries an address that does not answer for minutes, deaf to Ctrl-C.
        echo(f"FAIL cannot reach Ray at {address}: {unreachable}")
        echo(f"  fix: {_CONNECT_FIX}")
        _remove_marker(state)
        return 1
    if started_here:
        try:
            if address:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            else:
                # The embedded Ray a plain `raytrain train` starts: this machine only, loopback.
                ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        except Exception as exc:  # connection and auth errors come in several types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            echo(f"FAIL cannot reach Ray at {address or 'a new local instance'}: {first}")
            echo(f"  fix: {_CONNECT_FIX}")
            _remove_marker(state)
            return 1
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        where = f"connected to {address}" if address else "embedded local Ray (this machine only)"
        echo(f"Ray cluster: {where}; {len(nodes)} node(s)")
        probes = probe_nodes(nodes, state, timeout_s=probe_timeout_s)
        for node in nodes:
            echo("  " + describe_node(node, probes.get(node["NodeID"])))
        report = assess(nodes, probes, state, local)
        total_gpus = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes)
        echo(f"Backend a run will use: {'nccl (GPU workers, --gpu auto)' if total_gpus else 'gloo (CPU workers; the cluster has no GPU)'}")
        echo(describe_storage(state, multi_node=len(nodes) > 1))
    finally:
        _remove_marker(state)
        if started_here:
            ray.shutdown()
    for note in report.notes:
        echo(f"note: {note}")
    for problem in report.problems:
        echo(f"FAIL {problem}")
    echo("OK: a run will work here." if not report.problems else f"{len(report.problems)} problem(s) found.")
    return 1 if report.problems else 0


_CONNECT_FIX = (
    "check --address/RAY_ADDRESS (the head's GCS address, e.g. 10.0.0.5:6379, or `auto` on a cluster node; "
    "`ray status` on the head prints it), that the head is running and this machine can reach it, and for a "
    "token-auth cluster export RAY_AUTH_MODE=token with the cluster's token in ~/.ray/auth_token (or "
    "RAY_AUTH_TOKEN_PATH). From a laptop, run doctor as a job instead: ray job submit -- raytrain doctor"
)


# -- storage -------------------------------------------------------------------------------


def inspect_storage(storage: str | None) -> StorageState:
    """Check the path from this process; when it is a writable directory, leave a marker file
    in it for the nodes to read back (removed by `_remove_marker`)."""
    path = Path(os.path.expanduser(storage or DEFAULT_STORAGE)).absolute()
    state = StorageState(path=str(path), explicit=bool(storage))
    state.exists = path.exists()
    state.is_dir = path.is_dir()
    state.fs_type = _fs_type(path)
    if not state.is_dir:
        return state
    marker = path / f".raytrain-doctor-{uuid.uuid4().hex}"
    try:
        marker.write_text(f"{socket.gethostname()} {marker.name}")
        state.writable, state.marker, state.token = True, marker.name, marker.read_text()
    except OSError as exc:
        state.error = exc.strerror or type(exc).__name__
    return state


def _remove_marker(state: StorageState) -> None:
    if state.marker:
        try:
            (Path(state.path) / state.marker).unlink()
        except OSError:
            pass
        state.marker = ""


def _fs_type(path: Path) -> str:
    """The file system type of the mount `path` (or its nearest existing parent) is on."""
    import psutil

    try:
        mounts = psutil.disk_partitions(all=True)
    except OSError:
        return ""
    target = str(path)
    best = max(
        (m for m in mounts if target == m.mountpoint or target.startswith(m.mountpoint.rstrip("/") + "/")),
        key=lambda m: len(m.mountpoint),
        default=None,
    )
    return best.fstype if best else ""


def describe_storage(state: StorageState, multi_node: bool) -> str:
    fs = f", {state.fs_type}" if state.fs_type else ""
    if not state.exists:
        return f"Storage: {state.path} (does not exist{fs})"
    if not state.is_dir:
        return f"Storage: {state.path} (not a directory)"
    if not state.writable:
        return f"Storage: {state.path} (not writable: {state.error}{fs})"
    checked = "; read back on every node" if multi_node and state.marker else ""
    return f"Storage: {state.path} (writable{fs}{checked})"


# -- per-node probe ------------------------------------------------------------------------


def _make_probe() -> Callable[..., dict[str, Any]]:
    """A self-contained function for a task on each node (pickled by value, so it runs
    even where raytrain does not import — which it then reports)."""

    def probe(storage: str, marker: str, token: str) -> dict[str, Any]:
        import os
        import platform
        import shutil
        import socket
        import subprocess
        import uuid

        facts: dict[str, Any] = {"hostname": socket.gethostname(), "python": platform.python_version()}
        try:
            facts["ram_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError, AttributeError):
            pass
        try:
            import torch
            import torch.distributed as dist

            facts["torch"] = torch.__version__
            facts["cuda"] = torch.version.cuda
            facts["cuda_usable"] = torch.cuda.is_available()
            facts["nccl"] = dist.is_available() and dist.is_nccl_available()
            facts["gloo"] = dist.is_available() and dist.is_gloo_available()
            if facts["cuda_usable"]:
                facts["gpu_models"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                try:
                    facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
                except Exception:  # noqa: BLE001 - only informative
                    pass
        except Exception as exc:  # noqa: BLE001 - reported as the node's problem
            facts["torch_error"] = f"{type(exc).__name__}: {exc}"
        if not facts.get("gpu_models") and shutil.which("nvidia-smi"):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
                ).stdout
                facts["gpu_models"] = [line.strip() for line in out.splitlines() if line.strip()]
            except (OSError, subprocess.SubprocessError):
                pass
        try:
            import raytrain

            facts["raytrain"] = raytrain.__version__
        except Exception as exc:  # noqa: BLE001
            facts["raytrain_error"] = f"{type(exc).__name__}: {exc}"
        if marker:
            try:
                with open(os.path.join(storage, marker)) as handle:
                    facts["sees_marker"] = handle.read() == token
            except OSError:
                facts["sees_marker"] = False
            scratch = os.path.join(storage, f".raytrain-doctor-{uuid.uuid4().hex}")
            try:
                with open(scratch, "w") as handle:
                    handle.write("x")
                os.unlink(scratch)
                facts["storage_writable"] = True
            except OSError as exc:
                facts["storage_writable"] = False
                facts["storage_error"] = exc.strerror or type(exc).__name__
        return facts

    return probe


def probe_nodes(nodes: list[dict], state: StorageState, timeout_s: float) -> dict[str, dict[str, Any]]:
    """node id -> the probe's facts, or {"error": ...} when it failed or did not answer in time."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_make_probe())
    refs = {}
    for node in nodes:
        strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        refs[node["NodeID"]] = task.options(scheduling_strategy=strategy).remote(state.path, state.marker, state.token)
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    results = {}
    for node_id, ref in refs.items():
        if ref not in ready:
            results[node_id] = {"error": f"no answer within {timeout_s:.0f} s"}
            ray.cancel(ref, force=True)
            continue
        try:
            results[node_id] = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the node's problem, reported
            results[node_id] = {"error": (str(exc).strip().splitlines() or [type(exc).__name__])[-1]}
    return results


# -- the verdict ---------------------------------------------------------------------------


def describe_node(node: dict, facts: dict[str, Any] | None) -> str:
    res = node.get("Resources", {})
    facts = facts or {}
    gpus = int(res.get("GPU", 0))
    models = facts.get("gpu_models") or [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
    gpu_text = "no GPU"
    if gpus:
        gpu_text = f"{gpus} GPU" + ("s" if gpus > 1 else "")
        if models:
            names = sorted(set(models))
            gpu_text += " (" + ", ".join(f"{name} ×{models.count(name)}" if models.count(name) > 1 else name for name in names) + ")"
    ram = f"{facts['ram_gib']:.1f} GiB RAM, " if "ram_gib" in facts else ""
    memory = f"{ram}{res.get('memory', 0) / 2**30:.1f} GiB for Ray tasks"
    head = ", head" if "node:__internal_head__" in res else ""
    host = f" ({facts['hostname']}{head})" if facts.get("hostname") else (f" ({head[2:]})" if head else "")
    line = f"node {node.get('NodeManagerAddress')}{host}: {res.get('CPU', 0):g} CPUs, {gpu_text}, {memory}"
    if "error" in facts:
        return line + f"; probe failed: {facts['error']}"
    if "torch" in facts:
        line += f"; torch {facts['torch']} (CUDA {facts.get('cuda') or 'none'}"
        if gpus:
            line += f", NCCL {_nccl_text(facts)}"
        line += ")"
    elif "torch_error" in facts:
        line += f"; torch does not import: {facts['torch_error']}"
    line += f"; raytrain {facts['raytrain']}" if "raytrain" in facts else ""
    return line


def assess(nodes: list[dict], probes: dict[str, dict[str, Any]], state: StorageState, local: dict[str, Any]) -> Report:
    """Everything that will make a run fail, each with its fix (pure: tested without Ray)."""
    report = Report()
    if not local.get("gloo") and not local.get("nccl"):
        report.problems.append("this torch has no gloo or NCCL backend (torch.distributed); install the official torch build")
    multi_node = len(nodes) > 1
    torch_versions = {}
    for node in nodes:
        name = node.get("NodeManagerAddress", node.get("NodeID", "?"))
        facts = probes.get(node["NodeID"], {})
        gpus = int(node.get("Resources", {}).get("GPU", 0))
        if "error" in facts:
            report.notes.append(f"node {name} did not answer the probe ({facts['error']}): its torch, GPUs and storage are unchecked")
            continue
        if "torch_error" in facts:
            report.problems.append(f"node {name}: torch does not import ({facts['torch_error']}); install raytrain and its dependencies there (see setup_commands in cluster.yaml)")
            continue
        if "raytrain_error" in facts:
            report.problems.append(
                f"node {name}: raytrain does not import ({facts['raytrain_error']}); install it on every node "
                "(`pip install -e ~/raytrain`, as cluster.yaml's setup_commands do) or submit with `ray job submit --working-dir .`"
            )
        if "torch" in facts:
            torch_versions.setdefault(facts["torch"], []).append(name)
        if gpus:
            if not facts.get("cuda"):
                report.problems.append(
                    f"node {name} has {gpus} GPU(s) but a CPU-only torch ({facts.get('torch')}); install a CUDA build of torch there "
                    "(scripts/install.sh on the GPU machine), or train on CPUs with --no-gpu"
                )
            elif not facts.get("nccl"):
                report.problems.append(f"node {name} has GPUs but its torch has no NCCL; install the official CUDA build of torch there, or use --no-gpu")
            elif facts.get("cuda_usable") is False:
                report.problems.append(
                    f"node {name}: Ray counts {gpus} GPU(s) there but torch cannot use CUDA (driver too old for CUDA {facts.get('cuda')}, "
                    "or no driver); check nvidia-smi on that node and install a torch build matching its driver"
                )
        if multi_node and state.marker and "sees_marker" in facts:
            if not facts["sees_marker"]:
                report.problems.append(
                    f"storage {state.path} is not shared: node {name} ({facts.get('hostname', '?')}) does not see the file written "
                    "here, so checkpoints written on one node cannot be restored on another; mount one shared file system "
                    "(NFS, EFS, Lustre...) at the same path on every node and pass it as --storage"
                )
            elif not facts.get("storage_writable", True):
                report.problems.append(
                    f"storage {state.path} is not writable from node {name} ({facts.get('storage_error', '')}); "
                    "fix the mount's permissions for the user Ray runs as on that node"
                )
    if len(torch_versions) > 1:
        spread = "; ".join(f"{version} on {', '.join(names)}" for version, names in sorted(torch_versions.items()))
        report.notes.append(f"nodes run different torch versions ({spread}); DDP across versions may fail, install one version everywhere")

    # The storage as seen from here (the driver writes config.yaml, summary.json, model.pt).
    if not state.exists:
        if state.explicit:
            report.problems.append(f"storage path {state.path} does not exist; create it (mkdir -p {state.path}) or pass another --storage")
        elif multi_node:
            report.problems.append(
                f"the default storage {state.path} does not exist here and a multi-node cluster needs storage every node shares; "
                "mount a shared file system (NFS/EFS) on every node and pass it as --storage"
            )
        else:
            parent = next((p for p in Path(state.path).parents if p.exists()), Path("/"))
            if not os.access(parent, os.W_OK):
                report.problems.append(f"default storage {state.path} cannot be created ({parent} is not writable); pass --storage DIR")
            else:
                report.notes.append(f"storage {state.path} will be created by the first run")
    elif not state.is_dir:
        report.problems.append(f"storage path {state.path} is a file, not a directory; pass a directory with --storage")
    elif not state.writable:
        report.problems.append(
            f"storage path {state.path} is not writable ({state.error}); fix its permissions (chmod/chown) or pass another --storage"
        )
    elif multi_node and state.fs_type and state.fs_type not in _NETWORK_FS and not any("sees_marker" in p for p in probes.values()):
        report.notes.append(f"storage {state.path} is on {state.fs_type}, which looks node-local; multi-node runs need a shared mount")
    return report


def _torch_facts() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_usable": torch.cuda.is_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
    }
    if facts["cuda_usable"]:
        try:
            facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - only informative
            pass
    return facts


def _nccl_text(facts: dict[str, Any]) -> str:
    if not facts.get("nccl"):
        return "not available"
    return f"available {facts['nccl_version']}" if facts.get("nccl_version") else "available"


__all__ = ["run_doctor", "assess", "inspect_storage", "StorageState"]
