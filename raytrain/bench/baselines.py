"""The baselines: the classic torchrun template (`raytrain.baselines.classic_ddp`) and one plain process, run and timed
like raytrain; the CPU anything else took meanwhile."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from raytrain.bench.options import BASELINE_TIMEOUT_S, TEMPLATE_MODULE, BenchError, BenchOptions, PlannedRun
from raytrain.text import plural

# What a rank prints when torch's gloo aborts it by itself (std::terminate in a gloo thread,
# SIGABRT), seen a few times on a busy 2-core machine while other gloo jobs ran, never with the
# same template run alone: not the template's failure, so its run is taken once more.
GLOO_ABORT = "terminate called without an active exception"


def run_template(
    pipeline: str, run: PlannedRun, opts: BenchOptions, out: Path, *, mode: str, tag: str, echo
) -> dict[str, Any]:
    """The classic template with `run`'s config and epochs: under torchrun at `run`'s worker
    count, or (`mode="plain"`) as one process without torch.distributed."""
    from raytrain.driver.session import driver_pythonpath, free_port

    workers = run.workers
    folder = out / "baselines"
    name = f"{mode}-w{workers}" + (f"-{tag}" if tag else "")
    config_path = folder / f"{name}.config.json"
    config_path.write_text(json.dumps(run.cfg.to_dict()))
    args = ["-m", TEMPLATE_MODULE, "--pipeline", pipeline, "--data", str(folder / "train.npz")]
    args += ["--config", str(config_path), "--epochs", str(run.epochs), "--warmup-steps", str(opts.warmup_steps)]
    args += ["--out", str(folder / f"{name}.json")]
    command = [sys.executable, *args]
    if mode != "plain":
        torchrun = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(workers)]
        command = [sys.executable, *torchrun, "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    # Ray gives each worker OMP_NUM_THREADS = its whole CPUs; the template gets the same.
    threads = max(1, int(run.cfg.cpus_per_worker))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": driver_pythonpath()}
    what = f"{mode} baseline on {workers} process{'es' if workers > 1 else ''}" + (f" ({tag})" if tag else "")
    echo(f"bench: {what}, {plural(threads, 'thread')} each")
    log = folder / f"{name}.log"
    background = BackgroundCPU()
    for attempt in range(2):
        with open(log, "w") as handle:
            try:
                code = subprocess.run(
                    command, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=BASELINE_TIMEOUT_S
                ).returncode
            except subprocess.TimeoutExpired:
                code = None
        if code in (0, None) or attempt == 1 or GLOO_ABORT not in log.read_text(errors="replace"):
            break
        echo(f"bench: a rank of the {what} was aborted by gloo itself ({GLOO_ABORT!r}); running it once more")
    ray_share = background.share()
    import ray

    ray_beside = "running" if ray.is_initialized() else "stopped"
    if code != 0 or not (folder / f"{name}.json").exists():
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        raise BenchError(f"the {what} {'timed out' if code is None else f'exited with {code}'}: {tail}\nLog: {log}")
    result = json.loads((folder / f"{name}.json").read_text())
    result["ray_beside"] = ray_beside  # "running": a Ray the study did not start (e.g. --address)
    result["ray_background_cpu_share"] = ray_share if ray_beside == "running" else None
    echo(f"bench: {what}: {result['steady_samples_per_s']:,.0f} samples/s steady")
    return result


class BackgroundCPU:
    """CPU taken by this process's descendants (the embedded Ray's processes) from now until
    `share()`, as a share of one CPU; None when there are none (Ray is not a child of this
    process: a joined cluster)."""

    def __init__(self) -> None:
        self.processes = psutil.Process().children(recursive=True)
        self.start_cpu, self.start = _cpu_seconds(self.processes), time.perf_counter()

    def share(self) -> float | None:
        if not self.processes:
            return None
        return (_cpu_seconds(self.processes) - self.start_cpu) / max(1e-9, time.perf_counter() - self.start)


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += times.user + times.system
    return total


def machine_facts() -> dict[str, Any]:
    import ray
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "load_average_at_end": [round(x, 2) for x in load] if load else None,
    }
