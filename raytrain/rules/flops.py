"""The cost view: FLOPs per sample, achieved FLOP/s per worker, and the model FLOPs
utilization (MFU) against the device's peak. Pure arithmetic, no torch.

The FLOPs per sample are counted once per attempt by torch's `FlopCounterMode` on rank 0's
first micro-batch (forward and backward; the optimizer's few FLOPs per parameter are left
out, as MFU usually leaves them out) and divided by its rows. Achieved FLOP/s per worker =
FLOPs per sample × the run's steady samples/s ÷ the workers. MFU = that ÷ the device's
peak at the run's precision: dense tensor-core peaks for bf16/fp16, the plain fp32 peak
for fp32 (a run computes fp32 on TF32 tensor cores unless --no-tf32, so an fp32 MFU can read
high). `--peak-tflops` replaces the table, e.g. for a device it does not know.
"""

from __future__ import annotations

from typing import Any

# Dense peak TFLOP/s per device (no sparsity): (bf16/fp16 tensor cores, fp32 without TF32),
# from the vendors' data sheets. Matched against torch.cuda.get_device_name() word by word
# (an "L4" is not an "L40"); the name of most words that matches wins ("H200 NVL" over "H200").
DEVICE_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "B200": (2250.0, 75.0),
    "H200 NVL": (835.0, 60.0),
    "H200": (989.0, 67.0),
    "H100 PCIe": (756.0, 51.0),
    "H100 NVL": (835.0, 60.0),
    "H100": (989.0, 67.0),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "L40": (181.0, 90.5),
    "L4": (121.0, 30.3),
    "A10": (125.0, 31.2),
    "V100": (125.0, 15.7),  # fp16 (no bf16)
    "T4": (65.0, 8.1),  # fp16 (no bf16)
    "MI300X": (1307.0, 163.4),
}


def device_peak_tflops(device_name: str, precision: str) -> float | None:
    """The table's peak for `device_name` at `precision` (None: not a device it knows)."""
    words = _words(device_name)
    matches = [name for name in DEVICE_PEAK_TFLOPS if _contains(words, _words(name))]
    if not matches:
        return None
    tensor, fp32 = DEVICE_PEAK_TFLOPS[max(matches, key=lambda name: len(_words(name)))]
    return fp32 if precision == "fp32" else tensor


def _words(name: str) -> list[str]:
    """ "NVIDIA A100-SXM4-80GB" -> ["nvidia", "a100", "sxm4", "80gb"]."""
    return name.lower().replace("-", " ").replace("_", " ").split()


def _contains(words: list[str], part: list[str]) -> bool:
    return any(words[i : i + len(part)] == part for i in range(len(words) - len(part) + 1))


def cost_view(
    flops_per_sample: float | None,
    samples_per_s: float | None,
    workers: int,
    device_name: str,
    precision: str,
    peak_tflops: float | None = None,
) -> dict[str, Any] | None:
    """FLOPs per sample, achieved TFLOP/s per worker and MFU (None without a peak); None
    without a FLOP count or a throughput."""
    if not flops_per_sample or not samples_per_s or workers < 1:
        return None
    achieved = flops_per_sample * samples_per_s / workers / 1e12
    peak = peak_tflops or device_peak_tflops(device_name, precision)
    return {
        "flops_per_sample": flops_per_sample,
        "achieved_tflops_per_worker": achieved,
        "device": device_name,
        "precision": precision,
        "peak_tflops": peak,
        "peak_from": None if peak is None else ("--peak-tflops" if peak_tflops else "table"),
        "mfu": achieved / peak if peak else None,
    }


def describe_cost(cost: dict[str, Any]) -> str:
    """`1.2 MFLOP per sample (forward + backward); 0.45 TFLOP/s per worker; MFU 23% of 989 TFLOP/s
    (NVIDIA H100 80GB HBM3, bf16, table)`."""
    text = (
        f"{_si(cost['flops_per_sample'])}FLOP per sample (forward + backward); "
        f"{_si(cost['achieved_tflops_per_worker'] * 1e12)}FLOP/s per worker"
    )
    if cost.get("mfu") is None:
        return text + f"; no MFU: no peak known for {cost['device'] or 'this device'} (give --peak-tflops)"
    return (
        text + f"; MFU {cost['mfu']:.1%} of {cost['peak_tflops']:g} TFLOP/s "
        f"({cost['device']}, {cost['precision']}, {cost['peak_from']})"
    )


def _si(value: float) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "
