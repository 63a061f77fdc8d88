"""The cost model of `raytrain.rules.costmodel`: known inputs give known predictions (pure, no Ray)."""

from __future__ import annotations

import math

import pytest

from raytrain.rules import costmodel
from raytrain.rules.costmodel import (
    LINKS,
    CostModelError,
    default_overlap,
    implied_bandwidth_GBps,
    num_buckets,
    predict,
    ring_allreduce_s,
)

RESNET50_GRAD_BYTES = 25_557_032 * 4  # torchvision resnet50 parameters, fp32 gradients


def test_ring_allreduce_formula():
    # 2(N-1)/N × bytes / bandwidth: 2 workers move the whole gradient once each way.
    assert ring_allreduce_s(2, 1e9, 10.0) == pytest.approx(0.1)
    assert ring_allreduce_s(8, 1e9, 10.0) == pytest.approx(2 * 7 / 8 * 0.1)
    # Latency: 2(N-1) hops per bucket.
    assert ring_allreduce_s(4, 0.0, 10.0, latency_us=10.0, buckets=3) == pytest.approx(3 * 6 * 10e-6)
    assert ring_allreduce_s(1, 1e9, 10.0, latency_us=10.0) == 0.0


def test_one_gpu_is_exactly_one():
    p = predict(gpus=1, step_time_s=0.1, grad_bytes=1e8)
    assert p.speedup == 1.0 and p.efficiency == 1.0 and p.comm_s == 0.0 and p.step_time_n_s == 0.1


def test_known_prediction_without_overlap():
    # 2 GPUs, 1 GB of gradients over NVLink (230 GB/s, 5 µs per hop) in 25 MiB buckets:
    # comm = 2(2-1)/2 × 1e9 / 230e9 + 38 buckets × 2 hops × 5 µs.
    grad = 1e9
    p = predict(gpus=2, step_time_s=1.0, grad_bytes=grad, link="nvlink", overlap=0.0)
    buckets = math.ceil(grad / (25 * 2**20))
    expected_comm = grad / 230e9 + buckets * 2 * 5e-6
    assert p.comm_s == pytest.approx(expected_comm)
    assert p.hidden_s == 0.0
    assert p.step_time_n_s == pytest.approx(1.0 + expected_comm)
    assert p.speedup == pytest.approx(2 / (1.0 + expected_comm))


def test_overlap_hides_at_most_the_backward_time():
    # A slow link: 1 GB over eth10 (1 GB/s effective) at 2 GPUs is ≥ 1 s of all-reduce.
    p = predict(gpus=2, step_time_s=0.3, grad_bytes=1e9, link="eth10", overlap=1.0)
    assert p.hidden_s == pytest.approx(0.3 * costmodel.BACKWARD_FRACTION)
    assert p.step_time_n_s == pytest.approx(0.3 + p.comm_s - 0.2)
    half = predict(gpus=2, step_time_s=100.0, grad_bytes=1e9, link="eth10", overlap=0.5)
    assert half.hidden_s == pytest.approx(0.5 * half.comm_s)


def test_default_overlap_is_all_buckets_but_the_last():
    assert num_buckets(100 * 2**20, 25.0) == 4
    assert default_overlap(100 * 2**20, 25.0) == pytest.approx(0.75)
    assert default_overlap(1_000, 25.0) == 0.0  # one bucket: nothing to overlap with


def test_multi_node_uses_the_bottleneck_link():
    one = predict(gpus=16, nodes=2, step_time_s=0.08, grad_bytes=RESNET50_GRAD_BYTES, link="ib200", overlap=0.0)
    assert one.bandwidth_GBps == LINKS["ib200"].effective_GBps  # one NIC per node is slower than NVLink
    eight = predict(
        gpus=16, nodes=2, step_time_s=0.08, grad_bytes=RESNET50_GRAD_BYTES, link="ib200", nics_per_node=8, overlap=0.0
    )
    assert eight.bandwidth_GBps == 8 * LINKS["ib200"].effective_GBps
    capped = predict(
        gpus=16,
        nodes=2,
        step_time_s=0.08,
        grad_bytes=RESNET50_GRAD_BYTES,
        link="ib400",
        nics_per_node=8,
        intra_link="pcie4",
    )
    assert capped.bandwidth_GBps == LINKS["pcie4"].effective_GBps  # the intra-node link is now the bottleneck
    assert eight.speedup > one.speedup


def test_seed_size_class_on_8_a100():
    """ResNet-50 (102 MB of fp32 gradients), 80 ms per step on one A100: NVLink leaves
    almost nothing to lose; over PCIe 4 without overlap the model lands on the seed's 7.2×."""
    nvlink = predict(gpus=8, step_time_s=0.080, grad_bytes=RESNET50_GRAD_BYTES, link="nvlink")
    assert nvlink.speedup == pytest.approx(7.97, abs=0.01)
    pcie = predict(gpus=8, step_time_s=0.080, grad_bytes=RESNET50_GRAD_BYTES, link="pcie4")
    assert pcie.speedup == pytest.approx(7.77, abs=0.01)
    pcie_no_overlap = predict(gpus=8, step_time_s=0.080, grad_bytes=RESNET50_GRAD_BYTES, link="pcie4", overlap=0.0)
    assert pcie_no_overlap.speedup == pytest.approx(7.16, abs=0.01)
    assert pcie_no_overlap.efficiency == pytest.approx(0.895, abs=0.002)


def test_implied_bandwidth_inverts_the_ring_formula():
    comm = ring_allreduce_s(4, 2e8, 12.5)
    assert implied_bandwidth_GBps(4, 2e8, comm) == pytest.approx(12.5)
    assert implied_bandwidth_GBps(1, 2e8, 0.1) is None
    assert implied_bandwidth_GBps(2, 2e8, 0.0) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"link": "nvlnk"}, "did you mean 'nvlink'"),
        ({"gpus": 0}, "gpus: got 0"),
        ({"gpus": 6, "nodes": 4, "link": "ib200"}, "multiple of the node count"),
        ({"step_time_s": 0.0}, "step_time_s: got 0.0"),
        ({"grad_bytes": -1}, "grad_bytes: got -1"),
        ({"overlap": 1.5}, "overlap: got 1.5"),
        ({"gpus": 16, "nodes": 2, "link": "nvlink"}, "inter-node link"),
        ({"gpus": 16, "nodes": 2, "link": "ib200", "intra_link": "eth25"}, "link inside a node"),
    ],
)
def test_bad_inputs_name_the_fix(kwargs, message):
    args = {"gpus": 8, "step_time_s": 0.1, "grad_bytes": 1e8, **kwargs}
    with pytest.raises(CostModelError, match=message):
        predict(**args)


def test_every_link_is_documented_and_consistent():
    for link in LINKS.values():
        assert link.description and 0 < link.effective_GBps <= link.nominal_GBps and link.latency_us > 0
