"""What the worker's device allows and what its failures mean.

A device's own failures are deterministic: a step that ran out of memory runs out again at
the same batch size, and a device-side assert (an index out of range in a kernel) fires
again on the same data. Retrying them spends --max-failures for nothing, so they are the
user's (`DeviceFailure`, exit 2), said once with the ways out, wherever in the step they
surfaced (`device_failure`). The device's settings a run decides: TF32 matmuls for fp32
(`use_tf32`, `apply_tf32`), whether bf16 runs there (`check_bf16`), and the peak memory a
rank reports (`peak_memory_bytes`).
"""

from __future__ import annotations

import socket

import torch

from raytrain.errors import ConfigError, UserError

# How torch says a kernel's assert fired (torch.AcceleratorError, a RuntimeError, since 2.8).
DEVICE_ASSERT = "device-side assert triggered"
# The CPU allocator's words when malloc fails (a GPU's is torch.OutOfMemoryError).
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"

OUT_OF_MEMORY_FIXES = (
    "a smaller --batch-size-per-worker (or --micro-batch-size, which keeps the global batch through gradient "
    "accumulation), --strategy fsdp (shards parameters, gradients and optimizer state over the workers), "
    "--activation-checkpointing (recomputes each block's activations in backward instead of keeping them)"
)


class DeviceFailure(UserError, RuntimeError):
    """The device ran out of memory or a kernel's assert fired: the same at every retry."""


def device_failure(exc: BaseException, rank: int, where: str, device: torch.device) -> DeviceFailure | None:
    """`exc` (or an exception it was raised from: compute_loss's error wraps the model's) as the
    device's failure on rank `rank` in `where` ("forward", "evaluation", ...), with its message
    and the ways out; None for any other error."""
    cause = _device_error(exc)
    if cause is None:
        return None
    host = socket.gethostname()
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
    if DEVICE_ASSERT in str(cause):
        return DeviceFailure(
            f"a device-side assert fired on rank {rank} ({host}), seen in {where}: {first}. The GPU reports it "
            "when the host next waits on it, so where it shows is not where it happened: rerun with "
            "CUDA_LAUNCH_BLOCKING=1 to have the failing kernel named (often an index out of range: a label at or "
            "above the number of classes, a token id at or above the vocabulary size)"
        )
    figures = memory_figures(device)
    return DeviceFailure(
        f"out of memory on rank {rank} ({host}) in {where}: {first}{f' ({figures})' if figures else ''}. "
        f"Ways out: {OUT_OF_MEMORY_FIXES}"
    )


def _device_error(exc: BaseException | None) -> BaseException | None:
    """The innermost device error in `exc`'s chain (a wrapper's message quotes the same words)."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    for error in reversed(chain):
        if isinstance(error, torch.OutOfMemoryError) or (
            isinstance(error, RuntimeError) and (DEVICE_ASSERT in str(error) or CPU_OUT_OF_MEMORY in str(error))
        ):
            return error
    return None


def memory_figures(device: torch.device) -> str:
    """`cuda:0: peak 70.1 GiB allocated, 0.3 GiB free of 79.1 GiB` on a GPU; "" elsewhere, or
    when the device cannot say."""
    if device.type != "cuda":
        return ""
    try:
        free, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_allocated(device)
    except Exception:  # a device in a failed state answers nothing
        return ""
    return f"{device}: peak {_gib(peak)} allocated, {_gib(free)} free of {_gib(total)}"


def _gib(size_bytes: int) -> str:
    return f"{size_bytes / 2**30:.1f} GiB"


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most memory this process's tensors held on `device` (torch's caching allocator), or
    None off a GPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def use_tf32(device_type: str, tf32: bool, *, exact: bool = False) -> bool:
    """Whether fp32 matmuls and convolutions run on TF32 tensor cores: on a GPU, unless --no-tf32
    or a check that compares runs exactly (`raytrain check`). It matters at --precision fp32 (under
    bf16 and fp16 autocast the matmuls are not fp32 anyway); a CPU has no TF32."""
    return device_type == "cuda" and tf32 and not exact


def apply_tf32(on: bool) -> None:
    """TF32 for fp32 matmuls (torch's "high" precision) and cuDNN convolutions, or neither."""
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on


def check_bf16(precision: str, device: torch.device) -> None:
    """--precision bf16 on a GPU without bf16 (before Ampere) fails at its first step, the same at
    every retry: a ConfigError naming the ways out, before anything is built."""
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError([("precision", bf16_unsupported(torch.cuda.get_device_name(device)))])


def bf16_unsupported(device_name: str) -> str:
    return f"bf16 is not supported on {device_name}: use --precision fp16 (autocast with a gradient scaler) or fp32"
