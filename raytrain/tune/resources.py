"""What a sweep's trials need and how many run at once: a trial's CPUs, the embedded Ray's size,
the concurrency that lets trials x workers fit, and the custom resource trial drivers sit on
(RAY_NOTES: without it, trial drivers take the CPUs their inner trainers wait for)."""

from __future__ import annotations

import math
from typing import Sequence

from raytrain.errors import ConfigError
from raytrain.rules.head import TRIAL_DRIVER_RESOURCE

# Trial drivers on a cluster without `trial_driver` reserve this much memory instead:
# Tune needs every trial to reserve something, and a CPU would starve the workers.
FALLBACK_DRIVER_MEMORY = 256 * 2**20
# An embedded Ray may offer up to this many logical CPUs per core (as `raytrain train`
# does for small machines); a trial larger than that cannot fit this machine.
LOCAL_OVERSUBSCRIPTION = 2


def trial_cpus(workers: int, cpus_per_worker: float) -> float:
    return workers * cpus_per_worker


def embedded_cpus(largest_trial_cpus: float, cpu_count: int) -> int:
    """Logical CPUs of an embedded Ray for a sweep: the machine's cores, or up to
    LOCAL_OVERSUBSCRIPTION× that when the largest trial (plus 2 for Ray itself) needs it,
    as `raytrain train` oversubscribes a small machine."""
    wanted = math.ceil(largest_trial_cpus) + 2
    return max(cpu_count, min(wanted, LOCAL_OVERSUBSCRIPTION * cpu_count))


def max_concurrent_trials(
    worker_counts: Sequence[int],
    *,
    cpus_per_worker: float,
    cluster_cpus: float,
    use_gpu: bool = False,
    cluster_gpus: float = 0,
    requested: int | None = None,
    where: str = "the cluster",
) -> int:
    """How many trials may run at once so that their workers always fit together.

    Sized for the largest trial (trials of any mix of sizes then fit). Raises ConfigError
    when the largest trial can never fit `where`."""
    largest = max(worker_counts)
    need_cpus = trial_cpus(largest, cpus_per_worker)
    fits = math.floor(cluster_cpus / need_cpus + 1e-9)
    problems = []
    if fits < 1:
        most = math.floor(cluster_cpus / cpus_per_worker + 1e-9)
        problems.append(
            (
                "workers",
                f"got {largest} in {','.join(map(str, worker_counts))}: a trial of {largest} workers × "
                f"{cpus_per_worker:g} CPU needs {need_cpus:g} CPUs, but {where} has {cluster_cpus:g}; drop worker "
                f"counts above {most} from --workers, lower --cpus-per-worker, or run on a bigger cluster (--address)",
            )
        )
    if use_gpu:
        gpu_fits = math.floor(cluster_gpus / largest + 1e-9)
        if gpu_fits < 1:
            problems.append(
                (
                    "workers",
                    f"got {largest} in {','.join(map(str, worker_counts))}: a trial of {largest} GPU workers needs "
                    f"{largest} GPUs, but {where} has {cluster_gpus:g}; drop worker counts above {int(cluster_gpus)} "
                    "from --workers, or run on a bigger cluster (--address)",
                )
            )
        fits = min(fits, gpu_fits)
    if problems:
        raise ConfigError(problems)
    return min(fits, requested) if requested else fits


def trial_driver_resources(cluster_resources: dict[str, float]) -> dict[str, float]:
    """What a trial's driver reserves: no CPU (its TorchTrainer's workers take those), one
    unit of `trial_driver` where the cluster offers it, else a little memory."""
    if cluster_resources.get(TRIAL_DRIVER_RESOURCE, 0) >= 1:
        return {"CPU": 0, TRIAL_DRIVER_RESOURCE: 1}
    return {"CPU": 0, "memory": FALLBACK_DRIVER_MEMORY}
