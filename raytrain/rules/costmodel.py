"""A cost model of data-parallel speedup: what the gradient all-reduce costs at N GPUs.

Pure arithmetic, no Ray, no torch. Weak scaling (the per-worker batch stays fixed): every
worker does the 1-worker step's compute, then DDP all-reduces the gradients. A ring
all-reduce moves 2(N-1)/N × the gradient bytes through the slowest link of the ring, in
2(N-1) hops per bucket:

    comm      = 2(N-1)/N × grad_bytes / bandwidth  +  buckets × 2(N-1) × latency
    hidden    = min(overlap × comm, backward time)        (DDP overlaps buckets with backward)
    step(N)   = step(1) + comm - hidden
    speedup   = N × step(1) / step(N),   efficiency = speedup / N

On one node the ring runs over the intra-node link; over several nodes the bottleneck is
the smaller of the intra-node link and the node's inter-node bandwidth (its NICs together).
The model counts communication only: input pipelines, stragglers and synchronized
BatchNorm cost extra, so it is an upper bound on the speedup a run can reach.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from raytrain.text import plural


@dataclass(frozen=True)
class Link:
    """An interconnect, with the bandwidth a ring all-reduce really gets out of it."""

    name: str
    nominal_GBps: float
    """Per-direction line rate per GPU (intra-node) or per NIC (inter-node), in GB/s (1e9 B/s)."""
    effective_GBps: float
    """All-reduce bus bandwidth typically measured on it (nccl-tests `busbw`), in GB/s."""
    latency_us: float
    """Per hop of the ring, in microseconds."""
    inter_node: bool
    description: str


LINKS: dict[str, Link] = {
    link.name: link
    for link in [
        Link("nvlink", 300.0, 230.0, 5.0, False, "NVLink 3 + NVSwitch (A100 SXM): 12 links × 25 GB/s per direction"),
        Link("nvlink4", 450.0, 360.0, 5.0, False, "NVLink 4 + NVSwitch (H100 SXM): 18 links × 25 GB/s per direction"),
        Link("pcie3", 16.0, 10.0, 8.0, False, "PCIe 3.0 x16 through the host, no NVLink"),
        Link("pcie4", 32.0, 20.0, 8.0, False, "PCIe 4.0 x16 through the host, no NVLink (e.g. A100 PCIe cards)"),
        Link("pcie5", 64.0, 40.0, 8.0, False, "PCIe 5.0 x16 through the host, no NVLink"),
        Link("ib100", 12.5, 11.0, 6.0, True, "InfiniBand EDR/HDR100, 100 Gb/s per NIC, RDMA"),
        Link("ib200", 25.0, 22.0, 6.0, True, "InfiniBand HDR, 200 Gb/s per NIC, RDMA"),
        Link("ib400", 50.0, 45.0, 6.0, True, "InfiniBand NDR, 400 Gb/s per NIC, RDMA"),
        Link("eth100", 12.5, 9.0, 30.0, True, "100 GbE, TCP sockets (no RDMA)"),
        Link("eth25", 3.125, 2.5, 30.0, True, "25 GbE, TCP sockets"),
        Link("eth10", 1.25, 1.0, 30.0, True, "10 GbE, TCP sockets"),
    ]
}

DEFAULT_INTRA_LINK = "nvlink"
BACKWARD_FRACTION = 2 / 3
"""Share of the step spent in backward (backward ≈ 2 × forward; the optimizer is small)."""


@dataclass(frozen=True)
class Prediction:
    """The predicted step at `gpus` workers, with every term of the model."""

    gpus: int
    nodes: int
    link: str
    bandwidth_GBps: float
    step_time_s: float
    """1-worker step time."""
    comm_s: float
    """Whole all-reduce per step (bandwidth + latency terms)."""
    hidden_s: float
    """Part of comm_s that runs under backward."""
    step_time_n_s: float
    speedup: float
    efficiency: float


class CostModelError(ValueError):
    """Inputs the model cannot use; the message names the input and the fix."""


def get_link(name: str) -> Link:
    if name in LINKS:
        return LINKS[name]
    close = difflib.get_close_matches(name, list(LINKS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise CostModelError(f"unknown link {name!r}{hint}; choose one of {', '.join(LINKS)}")


def ring_allreduce_s(
    gpus: int, grad_bytes: float, bandwidth_GBps: float, latency_us: float = 0.0, buckets: int = 1
) -> float:
    """Time of a ring all-reduce of `grad_bytes` over `gpus` workers sent in `buckets` pieces."""
    if gpus <= 1:
        return 0.0
    hops = 2 * (gpus - 1)
    return hops / gpus * grad_bytes / (bandwidth_GBps * 1e9) + buckets * hops * latency_us * 1e-6


def default_overlap(grad_bytes: float, bucket_mb: float) -> float:
    """Share of the all-reduce DDP can overlap with backward: all buckets but the last ready."""
    return 1.0 - 1.0 / num_buckets(grad_bytes, bucket_mb)


def num_buckets(grad_bytes: float, bucket_mb: float) -> int:
    return max(1, math.ceil(grad_bytes / (bucket_mb * 2**20)))


def predict(
    *,
    gpus: int,
    step_time_s: float,
    grad_bytes: float,
    nodes: int = 1,
    link: str = DEFAULT_INTRA_LINK,
    intra_link: str = DEFAULT_INTRA_LINK,
    nics_per_node: int = 1,
    bucket_mb: float = 25.0,
    overlap: float | None = None,
    backward_fraction: float = BACKWARD_FRACTION,
) -> Prediction:
    """Speedup of `gpus` workers over `nodes` nodes vs one worker.

    `link` is the ring's link: the intra-node one on one node, the inter-node one
    (per NIC, `nics_per_node` NICs per node) on several; `intra_link` is the link inside
    each node when `nodes > 1`. `overlap` defaults to `default_overlap` (all buckets but
    the last can hide behind backward).
    """
    _check(
        gpus=gpus,
        nodes=nodes,
        step_time_s=step_time_s,
        grad_bytes=grad_bytes,
        nics_per_node=nics_per_node,
        bucket_mb=bucket_mb,
        overlap=overlap,
        backward_fraction=backward_fraction,
    )
    ring = get_link(link)
    if nodes > 1 and not ring.inter_node:
        inter = ", ".join(name for name, candidate in LINKS.items() if candidate.inter_node)
        raise CostModelError(
            f"link {link!r} connects GPUs inside a node; over {nodes} nodes name the inter-node link ({inter})"
        )
    if nodes > 1 and get_link(intra_link).inter_node:
        raise CostModelError(
            f"intra_link {intra_link!r} is an inter-node link; name the link inside a node (nvlink, pcie4, ...)"
        )
    if nodes == 1:
        bandwidth, latency = ring.effective_GBps, ring.latency_us
    else:
        inside = get_link(intra_link)
        bandwidth = min(inside.effective_GBps, ring.effective_GBps * nics_per_node)
        latency = max(inside.latency_us, ring.latency_us)
    buckets = num_buckets(grad_bytes, bucket_mb)
    comm = ring_allreduce_s(gpus, grad_bytes, bandwidth, latency, buckets)
    share = default_overlap(grad_bytes, bucket_mb) if overlap is None else overlap
    hidden = min(share * comm, backward_fraction * step_time_s)
    step_n = step_time_s + comm - hidden
    speedup = 1.0 if gpus == 1 else gpus * step_time_s / step_n
    return Prediction(gpus, nodes, link, bandwidth, step_time_s, comm, hidden, step_n, speedup, speedup / gpus)


def _check(**values: float | None) -> None:
    problems = []
    for name in ("gpus", "nodes", "nics_per_node"):
        if not (isinstance(values[name], int) and values[name] >= 1):
            problems.append(f"{name}: got {values[name]!r}; must be a positive integer")
    for name in ("step_time_s", "grad_bytes", "bucket_mb"):
        value = values[name]
        if not (isinstance(value, (int, float)) and 0 < value < math.inf):
            problems.append(f"{name}: got {value!r}; must be a positive number")
    for name in ("overlap", "backward_fraction"):
        value = values[name]
        if value is not None and not 0 <= value <= 1:
            problems.append(f"{name}: got {value!r}; must be between 0 and 1")
    if not problems and values["gpus"] % values["nodes"]:
        problems.append(f"gpus: got {values['gpus']} over {values['nodes']} nodes; give a multiple of the node count")
    if problems:
        raise CostModelError("; ".join(problems))


def describe(p: Prediction, grad_bytes: float) -> str:
    """One sentence with the numbers: what the all-reduce costs and what is left of the speedup."""
    return (
        f"{p.gpus} GPUs on {plural(p.nodes, 'node')} over {p.link} ({p.bandwidth_GBps:g} GB/s effective): "
        f"all-reduce of {grad_bytes / 1e6:.1f} MB takes {p.comm_s * 1e3:.2f} ms per step, "
        f"{p.hidden_s * 1e3:.2f} ms of it under backward; step {p.step_time_s * 1e3:.1f} → "
        f"{p.step_time_n_s * 1e3:.1f} ms; speedup {p.speedup:.2f}× ({p.efficiency:.1%} efficiency)"
    )


def implied_bandwidth_GBps(gpus: int, grad_bytes: float, comm_s: float) -> float | None:
    """The bus bandwidth a measured per-step communication time implies (None when unmeasurable)."""
    if gpus <= 1 or comm_s <= 0:
        return None
    return 2 * (gpus - 1) / gpus * grad_bytes / comm_s / 1e9
