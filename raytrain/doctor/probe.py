"""A probe task pinned to each node: its CPUs, GPUs, memory, torch/CUDA/NCCL, whether raytrain
imports there, whether it reads back the driver's storage marker, and its network (its node
address, its interfaces, what its hostname resolves to, the interface variables it has)."""

from __future__ import annotations

from typing import Any, Callable

from raytrain.doctor.storage import StorageState

PROBE_TIMEOUT_S = 90.0


def _make_probe() -> Callable[..., dict[str, Any]]:
    """A self-contained function for a task on each node (pickled by value, so it runs
    even where raytrain does not import — which it then reports)."""

    def add_network(facts: dict[str, Any]) -> None:
        """The node's address, each interface's IP addresses, what the hostname resolves to, and
        the interface variables in the node's environment (`raytrain.rules.network.NodeNetwork`)."""
        import os
        import socket

        facts["interface_variables"] = {
            name: os.environ[name]
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
            if name in os.environ
        }
        try:
            resolved = socket.getaddrinfo(facts["hostname"], None, type=socket.SOCK_STREAM)
            facts["resolves_to"] = list(dict.fromkeys(str(info[4][0]) for info in resolved))
        except OSError:
            facts["resolves_to"] = []
        try:
            import psutil
            import ray

            facts["node_address"] = ray.util.get_node_ip_address()
            families = (socket.AF_INET, socket.AF_INET6)
            facts["interfaces"] = {
                name: [entry.address for entry in entries if entry.family in families]
                for name, entries in psutil.net_if_addrs().items()
            }
        except Exception as exc:  # noqa: BLE001 - the network facts are left out, said as such
            facts["network_error"] = f"{type(exc).__name__}: {exc}"

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
                query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
                out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
                facts["gpu_models"] = [line.strip() for line in out.splitlines() if line.strip()]
            except (OSError, subprocess.SubprocessError):
                pass
        add_network(facts)
        try:
            import raytrain

            facts["raytrain"] = raytrain.__version__
        except Exception as exc:  # noqa: BLE001
            facts["raytrain_error"] = f"{type(exc).__name__}: {exc}"
        if marker and "://" in storage:  # an object store: the same checks through pyarrow
            try:
                import pyarrow.fs as pafs

                fs, base = pafs.FileSystem.from_uri(storage)
                with fs.open_input_stream(f"{base}/{marker}") as handle:
                    facts["sees_marker"] = handle.readall().decode() == token
            except Exception as exc:  # noqa: BLE001 - the node's problem, reported
                facts["sees_marker"] = False
                facts["storage_error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                return facts
            try:
                scratch = f"{base}/.raytrain-doctor-{uuid.uuid4().hex}"
                with fs.open_output_stream(scratch) as out:
                    out.write(b"raytrain")
                with fs.open_input_stream(scratch) as handle:
                    echoed = handle.readall()
                fs.delete_file(scratch)
                facts["storage_writable"] = echoed == b"raytrain"
                if echoed != b"raytrain":
                    facts["storage_error"] = "an object written reads back different (unsigned requests?)"
            except Exception as exc:  # noqa: BLE001
                facts["storage_writable"] = False
                facts["storage_error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        elif marker:
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
        refs[node["NodeID"]] = task.options(scheduling_strategy=strategy).remote(
            state.uri or state.path, state.marker, state.token
        )
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
