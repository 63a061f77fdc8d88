"""GPU tier (mark `gpu`, skipped without a CUDA GPU): the CLI on one GPU with NCCL, bf16 and fp16
autocast, a checkpointed resume and an export. `benchmarks/gpu_check.sh` runs it on the GPU machine
and adds the throughput figures against the plain loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAYTRAIN = str(Path(sys.executable).with_name("raytrain"))

pytestmark = pytest.mark.gpu


def raytrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RAYTRAIN, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_digits_trains_on_one_gpu_with_nccl_under_autocast_and_resumes(tmp_path, precision):
    common = [
        "--gpu",
        "--workers",
        "1",
        "--precision",
        precision,
        "--storage",
        str(tmp_path),
        "--name",
        precision,
        "--progress",
        "plain",
    ]
    first = raytrain("train", "digits", *common, "--epochs", "2", "--checkpoint-every-steps", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "nccl" in first.stdout and "GPU" in first.stdout
    summary = json.loads((tmp_path / precision / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_metrics"]["val_loss"] < 1.5

    resumed = raytrain(
        "train", "--storage", str(tmp_path), "--name", precision, "--resume", "--epochs", "3", "--progress", "plain"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from step {summary['steps']}" in resumed.stdout
    exported = raytrain(
        "export", str(tmp_path / precision), "-o", str(tmp_path / f"{precision}.pt"), "--pipeline", "digits"
    )
    assert exported.returncode == 0, exported.stderr[-3000:]

    import torch

    state = torch.load(tmp_path / f"{precision}.pt", map_location="cpu", weights_only=True)
    assert not any(key.startswith("module.") for key in state)
    assert all(torch.isfinite(value).all() for value in state.values() if value.is_floating_point())


def test_prefetching_on_a_gpu_stages_pinned_batches_on_a_side_stream_and_changes_nothing(monkeypatch):
    """--prefetch on a GPU: every step but an epoch's first is served a batch copied ahead on the
    side stream from pinned memory; ids and order are exact, losses and weights the same."""
    import torch
    from test_prefetch import train

    from raytrain.worker import prefetch

    device = torch.device("cuda", 0)
    pinned, staged = [], []
    to = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: (pinned.append(1), to(self, *a))[1])
    stage = prefetch.Prefetched.stage
    monkeypatch.setattr(prefetch.Prefetched, "stage", lambda self, *a: (staged.append(self), stage(self, *a)))
    plain, plain_weights, _ = train("off", None, device)
    assert staged == [] and pinned == []
    ahead, ahead_weights, _ = train("auto", None, device)
    assert staged and all(data.stream is not None for data in staged) and len(pinned) == 3 * len(staged)
    assert sum(data.staged_batches for data in set(staged)) == len(staged)
    assert ahead.seen == plain.seen
    assert ahead.losses == pytest.approx(plain.losses, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ahead_weights, plain_weights))


def test_steady_steps_on_a_gpu_count_the_kernels_time_not_the_hosts_queueing():
    import time

    import torch

    from raytrain.instruments.phases import SteadyClock
    from raytrain.rules.position import Telemetry

    clock, telemetry = SteadyClock(torch.device("cuda")), Telemetry()
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    queued = time.perf_counter()
    started = clock.start()
    for _ in range(20):
        a = a @ a / 8192.0
    clock.stop(started, 64, telemetry)
    queued = time.perf_counter() - queued  # the host returns long before the kernels are done
    assert telemetry.steady_steps == 0  # nothing is read until the next sync
    torch.cuda.synchronize()
    clock.settle(telemetry)
    assert telemetry.steady_steps == 1 and telemetry.steady_samples == 64
    assert telemetry.steady_time_s > queued


def test_a_ranks_own_compute_time_on_a_gpu_is_the_devices_not_the_hosts_queueing():
    import time

    import torch

    from raytrain.instruments.phases import OwnTime, PhaseTimer, StepPhases

    own = OwnTime(on_gpu=True)
    heartbeat = type("Beat", (), {"mark": lambda self, step, phase: None})()
    phases = StepPhases(heartbeat, 0, PhaseTimer(None, lambda: None), own)
    a = torch.randn(8192, 8192, device="cuda")
    a = a @ a / 8192.0  # cuBLAS's start, on the host, before the timed block
    torch.cuda.synchronize()
    queued = time.perf_counter()
    with phases.forward:  # a slow device's forward: the host returns long before it is done
        for _ in range(20):
            a = a @ a / 8192.0
    queued = time.perf_counter() - queued
    assert own.compute_s == 0.0 and len(own.pending) == 1  # nothing read, nothing waited for, in the step
    taken = own.take()  # at the sync: waits for the device, then reads its time
    assert taken.compute_s > 10 * queued and taken.data_s == 0.0


def test_a_per_step_replicas_nccl_collective_is_timed_by_torchft_not_torchs_watchdog():
    """Per-step on NCCL: the peer wait is torchft's own timer (it aborts the communicator), and
    each collective's own timeout stays unset, so torch's NCCL watchdog does not race it."""
    from datetime import timedelta

    import torch
    from torch.distributed import AllreduceOptions
    from torchft import ProcessGroupNCCL
    from torchft.process_group import ReconfigureOptions

    from raytrain.faults.groups import replica_process_group

    pg = replica_process_group(ProcessGroupNCCL, "127.0.0.1")(timeout=timedelta(seconds=60))
    pg.reconfigure(ReconfigureOptions(uuid=1, handles=[pg.get_reconfigure_handle()])).wait()  # a group of one
    pg.set_peer_wait(timedelta(seconds=5))
    opts = AllreduceOptions()
    tensor = torch.ones(4, device="cuda")
    work = pg.allreduce([tensor], opts)
    work.wait()
    assert opts.timeout < timedelta(0)  # cleared by torchft: no watchdog timeout
    assert pg._timeout == timedelta(seconds=5)
    assert torch.equal(tensor.cpu(), torch.ones(4))
    pg.shutdown()
