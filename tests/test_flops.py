"""The cost view (pure tier): device peaks, achieved FLOP/s per worker, MFU, and where they
show (summary.json's `cost`, the report's line, bench's columns)."""

from __future__ import annotations

import pytest

from raytrain.bench import scaling_rows
from raytrain.bench.render import cost_sentence, table_lines
from raytrain.rules.flops import cost_view, describe_cost, device_peak_tflops


def test_peaks_come_from_the_device_name_and_the_precision():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0  # the more specific name wins
    assert device_peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert device_peak_tflops("NVIDIA H200", "fp16") == 989.0
    assert device_peak_tflops("cpu", "fp32") is None


@pytest.mark.parametrize(
    "device, bf16",
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),  # not the SXM part's peak: the name of most words wins
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40", 181.0),  # "L4" is a word of its own, not a prefix
        ("NVIDIA L40S", 362.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10G", None),  # not in the table: no guess from a prefix
    ],
)
def test_a_device_is_matched_by_whole_words_the_most_specific_name_first(device, bf16):
    assert device_peak_tflops(device, "bf16") == bf16


def test_achieved_flops_per_worker_and_mfu():
    # 6 GFLOP per sample at 1,000 samples/s over 4 workers: 1.5 TFLOP/s each, of an A100's 312 at bf16.
    cost = cost_view(6e9, 1000.0, 4, "NVIDIA A100-SXM4-80GB", "bf16")
    assert cost["achieved_tflops_per_worker"] == pytest.approx(1.5)
    assert cost["mfu"] == pytest.approx(1.5 / 312) and cost["peak_from"] == "table"
    assert describe_cost(cost) == (
        "6 GFLOP per sample (forward + backward); 1.5 TFLOP/s per worker; MFU 0.5% of 312 TFLOP/s "
        "(NVIDIA A100-SXM4-80GB, bf16, table)"
    )
    overridden = cost_view(6e9, 1000.0, 4, "NVIDIA A100-SXM4-80GB", "bf16", peak_tflops=150.0)
    assert overridden["mfu"] == pytest.approx(0.01) and overridden["peak_from"] == "--peak-tflops"


def test_without_a_peak_there_is_no_mfu_and_without_a_count_no_cost():
    cost = cost_view(7_548_672, 5000.0, 2, "cpu", "fp32")
    assert cost["mfu"] is None and cost["peak_tflops"] is None
    assert describe_cost(cost).endswith("no MFU: no peak known for cpu (give --peak-tflops)")
    assert cost_view(None, 5000.0, 2, "cpu", "fp32") is None
    assert cost_view(7_548_672, None, 2, "cpu", "fp32") is None


def test_bench_rows_and_table_carry_the_cost_columns():
    runs = [
        {
            "workers": n,
            "global_batch_size": 32 * n,
            "per_worker_batch": 32,
            "epochs": 1,
            "steady_steps": 10,
            "steady_samples_per_s": rate,
            "steady_time_s": 32 * n * 10 / rate,
            "phase_time_s": {"data_wait": 0.001, "forward_backward": 0.08, "optimizer": 0.01},
            "flops_per_sample": 2e9,
            "device_name": "NVIDIA H100 80GB HBM3",
            "run_dir": f"/runs/w{n}",
        }
        for n, rate in ((1, 100_000.0), (2, 180_000.0))
    ]
    rows = scaling_rows(runs, 340_000, None, 25.0, precision="bf16")
    assert rows[1]["cost"]["achieved_tflops_per_worker"] == pytest.approx(180.0)
    report = {"results": rows, "link": None}
    header, _, two = table_lines(report)
    assert header[-2:] == ["TFLOP/s/worker", "MFU"] and two[-2:] == ["180", "18.2%"]
    assert cost_sentence(report).startswith("FLOPs per sample: 2,000,000,000 (forward and backward")
    assert "MFU against 989 TFLOP/s per device (NVIDIA H100 80GB HBM3, bf16, table)" in cost_sentence(report)


def test_peak_tflops_must_be_positive():
    from raytrain.config import TrainConfig
    from raytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="peak_tflops.*positive number of TFLOP/s"):
        TrainConfig(peak_tflops=0.0)
