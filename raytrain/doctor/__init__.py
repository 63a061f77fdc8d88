"""`raytrain doctor`: what the cluster has, and whether a run will work on it.

It joins the Ray a run would use (--address, else RAY_ADDRESS, else an embedded local Ray),
lists every node with its CPUs, GPUs (model), memory, torch/CUDA/NCCL and whether raytrain
imports there (a probe task pinned to each node), names the backend a run will use, and
checks the storage path: it exists, is writable, and — on a multi-node cluster — every node
sees the same directory (a file written here is read back on each node). On a multi-node
cluster it also checks the network between the hosts: a hostname that resolves to loopback,
interfaces named differently, an interface variable some host cannot use (from the probes'
facts), and whether every node reaches every other's node address on a free port (`network`).
On a head it did not start, it names health-check settings that declare a silent node dead
later than raytrain's would (Ray's defaults: a minute), with the fix.
Exit status 0 when a run will work (notes do not change it), 1 when something will not, each
problem printed with its fix.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from raytrain.doctor.network import check_reachability
from raytrain.doctor.probe import PROBE_TIMEOUT_S, probe_nodes
from raytrain.doctor.storage import NETWORK_FS, StorageState, describe_storage, inspect_storage, remove_marker
from raytrain.driver.session import NODE_HEALTH_CONFIG, address_problem, head_system_config, join_problem
from raytrain.rules.head import slow_death_note
from raytrain.rules.network import NodeNetwork, Unreachable, interface_holding, network_findings


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)  # each: what is wrong; the fix
    notes: list[str] = field(default_factory=list)


def run_doctor(
    address: str | None, storage: str | None, echo: Callable[[str], None], probe_timeout_s: float = PROBE_TIMEOUT_S
) -> int:
    """Print a report; return 0 when a run will work, 1 (with the fix) when it will not."""
    import ray
    import torch

    import raytrain

    echo(
        f"raytrain {raytrain.__version__}, ray {ray.__version__}, torch {torch.__version__}, python "
        f"{platform.python_version()} ({socket.gethostname()})"
    )
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
        echo(f"FAIL cannot reach Ray at {address}: {unreachable[0]}")
        echo(f"  fix: {unreachable[1]}")
        remove_marker(state)
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
            what, fix = join_problem(address, exc) if address else ("a local Ray did not start", _LOCAL_FIX)
            echo(f"FAIL cannot reach Ray at {address or 'a new local instance'}: {what} (Ray: {first})")
            echo(f"  fix: {fix}")
            remove_marker(state)
            return 1
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        where = f"connected to {address}" if address else "embedded local Ray (this machine only)"
        echo(f"Ray cluster: {where}; {len(nodes)} node(s)")
        probes = probe_nodes(nodes, state, timeout_s=probe_timeout_s)
        for node in nodes:
            echo("  " + describe_node(node, probes.get(node["NodeID"])))
        unreachable, unchecked = check_reachability(nodes)
        if len(nodes) > 1:
            echo(describe_reachability(len(nodes), unreachable, unchecked))
        report = assess(nodes, probes, state, local)
        network = assess_network(nodes, probes, os.environ, unreachable, unchecked)
        report.problems += network.problems
        report.notes += network.notes
        if address or not started_here:  # the embedded Ray a run starts has raytrain's health checks
            report.notes += head_health_notes(head_system_config())
        total_gpus = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes)
        backend = "nccl (GPU workers, --gpu auto)" if total_gpus else "gloo (CPU workers; the cluster has no GPU)"
        echo(f"Backend a run will use: {backend}")
        echo(describe_storage(state, multi_node=len(nodes) > 1))
    finally:
        remove_marker(state)
        if started_here:
            ray.shutdown()
    for note in report.notes:
        echo(f"note: {note}")
    for problem in report.problems:
        echo(f"FAIL {problem}")
    echo("OK: a run will work here." if not report.problems else f"{len(report.problems)} problem(s) found.")
    return 1 if report.problems else 0


# A local Ray that would not start (doctor without --address): what `ray_session` says of it.
_LOCAL_FIX = "is the machine overloaded, or /tmp full? Or give --address to check a running cluster"


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
            counted = (f"{name} ×{models.count(name)}" if models.count(name) > 1 else name for name in names)
            gpu_text += f" ({', '.join(counted)})"
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
    if "interfaces" in facts:
        held = interface_holding(facts.get("node_address") or node.get("NodeManagerAddress", ""), facts["interfaces"])
        line += f"; interface {held}" if held else "; no interface holds its address"
    return line


def head_health_notes(system_config: dict | None) -> list[str]:
    """What the head's health-check settings cost (`raytrain.rules.head.slow_death_note`), from
    its system config (None: not readable here)."""
    if system_config is None:
        return [
            "the head's health-check settings cannot be read through Ray Client; run doctor with the head's GCS "
            "address (HOST:6379) to check how soon it declares a silent node dead"
        ]
    note = slow_death_note(system_config, NODE_HEALTH_CONFIG)
    return [note] if note else []


def describe_reachability(count: int, unreachable: list[Unreachable], unchecked: dict[str, str]) -> str:
    pairs = count * (count - 1)
    if not unreachable and not unchecked:
        return f"Between nodes: each of the {count} nodes reached every other's address on a free port"
    failed = f"{len(unreachable)} of {pairs} node pairs could not connect on a free port" if unreachable else ""
    left = f"{len(unchecked)} node(s) unchecked" if unchecked else ""
    return f"Between nodes: {'; '.join(filter(None, [failed, left]))} (below)"


def assess_network(
    nodes: list[dict],
    probes: dict[str, dict[str, Any]],
    driver_env: Mapping[str, str],
    unreachable: Sequence[Unreachable] = (),
    unchecked: dict[str, str] | None = None,
) -> Report:
    """The network's problems and notes (`raytrain.rules.network.network_findings`) from the
    probes' facts (pure: tested without Ray). A node whose probe found no network is left out."""
    networks = []
    for node in nodes:
        facts = probes.get(node["NodeID"], {})
        if "interfaces" in facts:
            networks.append(
                NodeNetwork(
                    hostname=facts.get("hostname", "?"),
                    node_address=facts.get("node_address") or node.get("NodeManagerAddress", "?"),
                    interfaces=facts["interfaces"],
                    resolves_to=tuple(facts.get("resolves_to", ())),
                    variables=facts.get("interface_variables", {}),
                )
            )
    found = network_findings(networks, driver_env, unreachable, unchecked)
    return Report(problems=found.problems, notes=found.notes)


def assess(nodes: list[dict], probes: dict[str, dict[str, Any]], state: StorageState, local: dict[str, Any]) -> Report:
    """Everything that will make a run fail, each with its fix (pure: tested without Ray)."""
    report = Report()
    if not local.get("gloo") and not local.get("nccl"):
        report.problems.append(
            "this torch has no gloo or NCCL backend (torch.distributed); install the official torch build"
        )
    multi_node = len(nodes) > 1
    torch_versions = {}
    for node in nodes:
        name = node.get("NodeManagerAddress", node.get("NodeID", "?"))
        facts = probes.get(node["NodeID"], {})
        gpus = int(node.get("Resources", {}).get("GPU", 0))
        if "error" in facts:
            report.notes.append(
                f"node {name} did not answer the probe ({facts['error']}): its torch, GPUs and storage are unchecked"
            )
            continue
        if "torch_error" in facts:
            report.problems.append(
                f"node {name}: torch does not import ({facts['torch_error']}); install raytrain and its dependencies "
                "there (see setup_commands in cluster.yaml)"
            )
            continue
        if "raytrain_error" in facts:
            report.problems.append(
                f"node {name}: raytrain does not import ({facts['raytrain_error']}); install it on every node "
                "(`pip install -e ~/raytrain`, as cluster.yaml's setup_commands do) or submit with `ray job submit "
                "--working-dir .`"
            )
        if "torch" in facts:
            torch_versions.setdefault(facts["torch"], []).append(name)
        if gpus:
            if not facts.get("cuda"):
                report.problems.append(
                    f"node {name} has {gpus} GPU(s) but a CPU-only torch ({facts.get('torch')}); install a CUDA "
                    "build of torch there (scripts/install.sh on the GPU machine), or train on CPUs with --no-gpu"
                )
            elif not facts.get("nccl"):
                report.problems.append(
                    f"node {name} has GPUs but its torch has no NCCL; install the official CUDA build of torch "
                    "there, or use --no-gpu"
                )
            elif facts.get("cuda_usable") is False:
                report.problems.append(
                    f"node {name}: Ray counts {gpus} GPU(s) there but torch cannot use CUDA (driver too old for CUDA "
                    f"{facts.get('cuda')}, or no driver); check nvidia-smi on that node and install a torch build "
                    "matching its driver"
                )
        if state.remote and state.marker and "sees_marker" in facts:
            if not facts["sees_marker"] or not facts.get("storage_writable", True):
                report.problems.append(
                    f"storage {state.path} cannot be used from node {name} ({facts.get('hostname', '?')}): "
                    f"{facts.get('storage_error') or 'the marker written here reads back different'}; give every node "
                    "credentials for the bucket (an instance role, or the AWS variables in the environment Ray starts "
                    "with) and a route to its endpoint"
                )
        elif multi_node and state.marker and "sees_marker" in facts:
            if not facts["sees_marker"]:
                report.problems.append(
                    f"storage {state.path} is not shared: node {name} ({facts.get('hostname', '?')}) does not see the "
                    "file written here, so checkpoints written on one node cannot be restored on another; mount one "
                    "shared file system (NFS, EFS, Lustre...) at the same path on every node and pass it as --storage"
                )
            elif not facts.get("storage_writable", True):
                report.problems.append(
                    f"storage {state.path} is not writable from node {name} ({facts.get('storage_error', '')}); "
                    "fix the mount's permissions for the user Ray runs as on that node"
                )
    if len(torch_versions) > 1:
        spread = "; ".join(f"{version} on {', '.join(names)}" for version, names in sorted(torch_versions.items()))
        report.notes.append(
            f"nodes run different torch versions ({spread}); DDP across versions may fail, install one version "
            "everywhere"
        )

    # The storage as seen from here (the driver writes config.yaml, summary.json, model.pt).
    if state.remote:
        if not state.writable:
            report.problems.append(state.error)
    elif not state.exists:
        if state.explicit:
            report.problems.append(
                f"storage path {state.path} does not exist; create it (mkdir -p {state.path}) or pass another --storage"
            )
        elif multi_node:
            report.problems.append(
                f"the default storage {state.path} does not exist here and a multi-node cluster needs storage every "
                "node shares; mount a shared file system (NFS/EFS) on every node and pass it as --storage"
            )
        else:
            parent = next((p for p in Path(state.path).parents if p.exists()), Path("/"))
            if not os.access(parent, os.W_OK):
                report.problems.append(
                    f"default storage {state.path} cannot be created ({parent} is not writable); pass --storage DIR"
                )
            else:
                report.notes.append(f"storage {state.path} will be created by the first run")
    elif not state.is_dir:
        report.problems.append(f"storage path {state.path} is a file, not a directory; pass a directory with --storage")
    elif not state.writable:
        report.problems.append(
            f"storage path {state.path} is not writable ({state.error}); fix its permissions (chmod/chown) or pass "
            "another --storage"
        )
    elif (
        multi_node
        and state.fs_type
        and state.fs_type not in NETWORK_FS
        and not any("sees_marker" in p for p in probes.values())
    ):
        report.notes.append(
            f"storage {state.path} is on {state.fs_type}, which looks node-local; multi-node runs need a shared mount"
        )
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


__all__ = ["run_doctor", "assess", "assess_network", "inspect_storage", "StorageState"]
