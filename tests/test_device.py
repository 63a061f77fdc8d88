"""Pure tier: the device path, shown on CPU — rank 0's FLOP count leaves --compile compiling,
a checkpoint resumes across the precisions (the gradient scaler's state or none), and a
device's failures (out of memory, a device-side assert) are the user's, wherever in the step
they happen."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from one_rank import OneRank, Quiet, step_runner, take_a_step
from torch import nn

from raytrain.cli import run_command
from raytrain.config import TrainConfig
from raytrain.data.table import Table
from raytrain.errors import ConfigError, find_user_error
from raytrain.instruments.window import LossWindow
from raytrain.parallel.device import DeviceFailure
from raytrain.pipeline import Pipeline
from raytrain.rules.position import Position
from raytrain.worker.state import TrainingState
from raytrain.worker.step import StepRunner


class TwoLayers(nn.Module):
    # The user's own module: Dynamo does not trace torch's (an nn.Sequential's frame is
    # skipped as torch's own file).
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


class Regression(Pipeline):
    def build_model(self, cfg):
        return TwoLayers()

    def compute_loss(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def runner_for(pipeline: Pipeline, model: nn.Module | None = None) -> tuple[StepRunner, Table]:
    """Rank 0's runner, counting its FLOPs, and 8 rows of a regression."""
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    return step_runner(pipeline, model, count_flops=True), Table({"x": x, "y": x.sum(axis=1, keepdims=True)})


# -- F1: the FLOP count and --compile ---------------------------------------------------------


def test_rank_0_counts_its_flops_and_still_compiles_the_model():
    """The counted micro-batch is the compiled model's first call: run under FlopCounterMode,
    Dynamo would skip the frame and never compile it."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pipeline = Regression()
    model = pipeline.build_model(TrainConfig())
    model.compile(backend="eager")  # Dynamo's graphs, without a C++ compiler
    runner, table = runner_for(pipeline, model)
    for _ in range(3):
        take_a_step(runner, table)
    # 2 per multiply-add forward, 4 backward but for the first layer's input (no gradient): 2
    assert runner.measures.telemetry.flops_per_sample == pytest.approx(2 * 40 + 4 * 8 + 2 * 32)
    assert counters["stats"]["unique_graphs"] >= 1
    assert model._compiled_call_impl is not None  # given back after the counted micro-batch
    torch._dynamo.reset()


class Events:
    def __init__(self):
        self.events = []

    def event(self, kind, message, **extra):
        self.events.append((kind, message, extra))


def test_a_sequential_model_compiles_in_place_and_every_ranks_graphs_are_counted():
    """nn.Module.compile leaves an nn.Sequential eager (Dynamo skips torch.nn's frames at the top);
    compile_in_place gives Dynamo a frame to start from, and the count says what was built."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from raytrain.parallel.strategy import compile_in_place, graphs_built

    torch._dynamo.reset()
    counters.clear()
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    plain.compile(backend="eager")
    plain(torch.zeros(2, 4))
    # torch's own behaviour, the reason for compile_in_place: once this builds a graph, it can go.
    assert graphs_built()[0] == 0
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    keys = list(model.state_dict())
    compile_in_place(model, backend="eager")
    runner, table = runner_for(Regression(), model)
    runner.measures.compiled_from = graphs_built()
    for _ in range(3):
        take_a_step(runner, table)
    graphs, seconds = runner.measures.compiled()
    assert graphs >= 1 and seconds > 0.0
    assert list(model.state_dict()) == keys  # compiled in place: the checkpoint's keys are the model's
    assert runner.measures.telemetry.flops_per_sample == pytest.approx(2 * 40 + 4 * 8 + 2 * 32)  # counted eager
    files, measures = Events(), runner.measures
    measures.note_compiled([(graphs, seconds), (0, 0.0)], files, step=1)  # figures kept; said after 2 steps
    assert measures.telemetry.compile_graphs == [graphs, 0] and files.events == []
    measures.note_compiled([(graphs, seconds), (0, 0.0)], files, step=2)
    (kind, line, extra), = files.events  # fmt: skip
    assert kind == "compile" and extra["graphs"] == [graphs, 0]
    assert line.startswith("Not compiled on rank 1 by step 2: --compile built no graph there, so it runs eager")
    measures.note_compiled([(graphs, seconds), (1, 2.0)], files, step=3)
    assert len(files.events) == 1  # said once an attempt
    torch._dynamo.reset()


class Rank(OneRank):
    """One of three ranks whose sums are `summed` (None: its own values, a failed reduction)."""

    world_size = 3
    vectors: list = []  # every rank's reduced values, in order

    def __init__(self, rank, summed=None):
        self.world_rank, self.summed = rank, summed

    def all_reduce_sum(self, values):
        self.vectors.append(values)
        return self.summed or values


def test_the_sync_carries_every_ranks_compile_figures_and_nothing_more_without_compile():
    from raytrain.instruments.window import sync

    vectors = Rank.vectors = []

    def synced(compiled):
        vectors.clear()
        for rank in range(3):
            sync(Rank(rank), Quiet(), LossWindow.on(torch.device("cpu")), 10, compiled=compiled and compiled[rank])
        summed = [sum(column) for column in zip(*vectors)]
        return sync(Rank(0, summed), Quiet(), LossWindow.on(torch.device("cpu")), 10, compiled=compiled and compiled[0])

    assert synced([(2, 0.0), (1, 1.5), (0, 3.0)]).compiled == [(2, 0.0), (1, 1.5), (0, 3.0)]
    width = len(vectors[0])
    assert synced(None).compiled == [] and len(vectors[0]) == width - 6  # two slots a rank, under --compile only
    # Per-step, a reduction that failed holds only the rank's own group: the others' figures are
    # missing, not "no graph", and nothing is said from it (a rank would read as eager).
    vectors.clear()
    own = sync(Rank(0), Quiet(), LossWindow.on(torch.device("cpu")), 10, compiled=(2, 0.5))
    assert own.compiled == [] and own.diverged == {}  # the others' missing slots are no divergence either


def test_the_sync_names_each_rank_whose_loss_went_bad_and_at_which_step_step_0_included():
    from raytrain.instruments.window import sync

    vectors = Rank.vectors = []

    windows = [LossWindow.on(torch.device("cpu")) for _ in range(3)]
    windows[1].add(torch.tensor(float("nan")), 4, step_index=0)  # rank 1's first step
    windows[2].add(torch.tensor(2.0), 4, step_index=0)
    windows[2].add(torch.tensor(float("inf")), 4, step_index=7)
    for rank in range(3):
        sync(Rank(rank), Quiet(), windows[rank], 10)
    summed = [sum(column) for column in zip(*vectors)]
    assert sync(Rank(0, summed), Quiet(), LossWindow.on(torch.device("cpu")), 10).diverged == {1: 0, 2: 7}


def test_a_torch_without_dynamos_counters_leaves_compile_not_counted_never_failed(monkeypatch):
    import torch._dynamo.utils

    from raytrain.parallel import strategy

    assert strategy.graphs_built() is not None
    monkeypatch.delattr(torch._dynamo.utils, "calculate_time_spent")
    assert strategy.graphs_built() is None


def test_the_compile_line_says_each_ranks_graphs_and_seconds():
    from raytrain.instruments.phases import compile_line

    assert compile_line([2, 2], [14.21, 13.9], 2) == (
        "Compiled by step 2: graphs built by rank: 2, 2, in 14.2, 13.9 s of compiling"
    )


# -- F7: the gradient scaler across precisions ------------------------------------------------


def state_of(precision: str, seed: int = 0, scale: float | None = None) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    if scale is not None:  # a scale of its own, as after overflows
        scaler.scale(torch.ones(()))
        scaler.update(new_scale=scale)
    return TrainingState(model, optimizer, scaler, Position(epoch=0, step=3))


@pytest.mark.parametrize("before, after", [("bf16", "fp16"), ("fp32", "fp16"), ("fp16", "bf16"), ("fp16", "fp16")])
def test_a_checkpoint_resumes_under_another_precision(tmp_path, before, after):
    saved = state_of(before, scale=1024.0 if before == "fp16" else None)
    saved.save(tmp_path / "ckpt", OneRank(), {}, distributed=False).wait()
    resumed = state_of(after, seed=1)
    resumed.load(tmp_path / "ckpt", OneRank(), seed=0, distributed=False, load_optimizer=lambda load: load())
    assert torch.equal(resumed.model.weight, saved.model.weight)
    if after == "fp16":  # the saved scale when there is one, else a fresh scaler's
        assert resumed.scaler.get_scale() == (1024.0 if before == "fp16" else 65536.0)


# -- F6: the device's failures -------------------------------------------------------------------

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"
ASSERT = "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported"


class RaiseInBackward(torch.autograd.Function):
    error: Exception | None = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RaiseInBackward.error


class FailsIn(Regression):
    """Raises `error` from its model's forward or backward, its optimizer's step, or its
    evaluation (a forward under no_grad)."""

    def __init__(self, where: str, error: Exception):
        self.where, self.error = where, error

    def compute_loss(self, model, batch):
        if self.where == "forward" or (self.where == "evaluation" and not torch.is_grad_enabled()):
            raise self.error
        prediction = model(batch["x"])
        if self.where == "backward" and torch.is_grad_enabled():
            RaiseInBackward.error = self.error
            prediction = RaiseInBackward.apply(prediction)
        return ((prediction - batch["y"]) ** 2).mean()

    def build_optimizer(self, model, cfg):
        error = self.error if self.where == "the optimizer step" else None

        class Failing(torch.optim.SGD):
            def step(self, closure=None):
                if error is not None:
                    raise error
                return super().step(closure)

        return Failing(model.parameters(), lr=cfg.lr)


PLACES = ["forward", "backward", "the optimizer step", "evaluation"]


def fail_in(where: str, error: Exception) -> DeviceFailure:
    runner, table = runner_for(FailsIn(where, error))
    with pytest.raises(DeviceFailure) as failure:
        take_a_step(runner, table)
        runner.evaluate(table)
    return failure.value


@pytest.mark.parametrize("where", PLACES)
def test_out_of_memory_anywhere_in_a_step_is_the_users_with_the_ways_out(where, capsys):
    failure = fail_in(where, torch.OutOfMemoryError(OOM))
    message = str(failure)
    assert message.startswith(f"out of memory on rank 0 ({socket.gethostname()}) in {where}: {OOM}")
    for way_out in ("--batch-size-per-worker", "--strategy fsdp", "--activation-checkpointing"):
        assert way_out in message
    assert "GiB allocated" not in message  # no GPU figures on a CPU
    assert find_user_error(wrapped(failure)) is failure  # never retried (raytrain.driver.failfast)
    assert run_command(Namespace(command="train", handler=lambda args: raise_(failure))) == 2
    err = capsys.readouterr().err
    assert err.count("raytrain train: ") == 1 and "Traceback" not in err  # one message


@pytest.mark.parametrize("where", PLACES)
def test_a_device_side_assert_is_not_retried_and_says_how_to_find_the_kernel(where):
    failure = fail_in(where, torch.AcceleratorError(ASSERT))
    assert f"a device-side assert fired on rank 0 ({socket.gethostname()}), seen in {where}" in str(failure)
    assert "CUDA_LAUNCH_BLOCKING=1" in str(failure)


def test_other_errors_of_the_step_stay_what_they_were():
    runner, table = runner_for(FailsIn("forward", RuntimeError("shape mismatch")))
    with pytest.raises(Exception) as error:
        take_a_step(runner, table)
    assert not isinstance(error.value, DeviceFailure) and "shape mismatch" in str(error.value)


def raise_(error: Exception):
    raise error


def wrapped(error: Exception) -> Exception:
    """`error` as Ray Train hands it to the failure policy: a worker group's error naming it."""
    outer = RuntimeError("Training failed")
    outer.worker_failures = {0: error}
    return outer


# -- benchmarks/gpu_check.py, rehearsed on CPU ------------------------------------------------------

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def gpu_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(GPU_CHECK.parents[1])}
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), str(out), *args], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="says what it does without a GPU")
def test_the_gpu_check_stops_at_once_without_a_cuda_device(tmp_path):
    done = gpu_check(tmp_path)
    assert done.returncode == 2
    assert f"gpu_check: no CUDA device (torch {torch.__version__}, cuda available False); stopping" in done.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["stopped"] == "no CUDA device"


@pytest.mark.slow
def test_every_part_of_the_gpu_check_runs_on_cpu_without_ray(tmp_path):
    done = gpu_check(tmp_path, "--device", "cpu", "--tiny")
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert set(results["parts"]) == {"sync", "compile", "resume", "oom", "speed", "watch", "connect"}
    assert results["parts"]["connect"]["nosuch0"]["failed_at"] == "init"  # gloo: as its group forms
    assert all(part["ok"] for part in results["parts"].values())
    assert results["parts"]["compile"]["graphs"] > 0
    assert results["ray_imported"] is False
    assert "all parts passed" in (tmp_path / "gpu_check.log").read_text()


# -- the smaller findings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpu, visible, expected",
    [(None, True, "cuda:0"), (True, True, "cuda:0"), (False, True, "cpu"), (None, False, "cpu")],
)
def test_local_mode_runs_where_gpu_says(gpu, visible, expected):
    from raytrain.worker.runtime import local_device

    assert str(local_device(gpu, cuda_visible=visible)) == expected


def test_a_collective_timeout_under_a_second_is_kept_as_given():
    from raytrain.faults.replacement import torchft_config

    assert torchft_config(False, 0.5).timeout_s == 0.5
    from raytrain.driver.launch import build_torch_trainer

    cfg = TrainConfig(collective_timeout_s=0.5, workers="1")
    assert build_torch_trainer(Regression(), cfg, "/unused", {}, use_gpu=False).backend_config.timeout_s == 0.5


@pytest.mark.parametrize(
    "device_type, tf32, exact, expected",
    [
        ("cuda", True, False, True),
        ("cuda", False, False, False),
        ("cuda", True, True, False),
        ("cpu", True, False, False),
    ],
)
def test_tf32_is_on_for_a_gpu_unless_no_tf32_or_raytrain_check(device_type, tf32, exact, expected):
    from raytrain.parallel.device import use_tf32

    assert use_tf32(device_type, tf32, exact=exact) is expected


def test_no_tf32_is_a_flag_and_raytrain_checks_runner_is_exact():
    from raytrain.check.worker import CheckRunner
    from raytrain.cli.parser import build_parser

    assert TrainConfig().tf32 is True
    args = build_parser().parse_args(["train", "digits", "--no-tf32"])
    assert args.tf32 is False
    assert CheckRunner.exact and not StepRunner.exact


def test_bf16_on_a_gpu_without_it_is_a_configuration_error_naming_the_ways_out():
    from raytrain.parallel.device import bf16_unsupported, check_bf16

    check_bf16("bf16", torch.device("cpu"))  # a CPU computes bf16
    message = str(ConfigError([("precision", bf16_unsupported("Tesla V100-SXM2-16GB"))]))
    assert message == (
        "Invalid configuration: precision: bf16 is not supported on Tesla V100-SXM2-16GB: use --precision fp16 "
        "(autocast with a gradient scaler) or fp32"
    )


def test_more_workers_than_gpus_is_refused_on_one_machine_and_said_on_a_cluster(monkeypatch):
    """Ray counts GPUs like CPUs: 8 workers on a 1-GPU machine would wait forever, in silence."""
    import ray

    from raytrain.config import TrainConfig
    from raytrain.driver.session import note_gpu_capacity

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    with pytest.raises(ConfigError, match="got 8 with GPUs, one GPU each, but this machine has 1; use --workers 1"):
        note_gpu_capacity(TrainConfig(workers=8), 1.0)
    with pytest.raises(ConfigError, match="use --workers 2:8, --no-gpu"):
        note_gpu_capacity(TrainConfig(workers="4:8"), 2.0)
    note_gpu_capacity(TrainConfig(workers=1), 1.0)  # fits: nothing said
    said = []
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    note_gpu_capacity(TrainConfig(workers=8), 4.0, echo=said.append)
    assert said and "the cluster has 4 GPUs and 8 workers need one each: training starts when nodes" in said[0]
