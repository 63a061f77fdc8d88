"""Pure tier: failures by type. The command line's exit status of every error raytrain ends a
command with, decided by the error's type and not by the order of `except` clauses; and which
failures are the collectives' (a peer lost or stalled: a worker fault, retried) rather than the
pipeline's (never retried)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import signal
import time
from argparse import Namespace
from types import SimpleNamespace

import pytest
import ray.exceptions
import torch.distributed as dist

import raytrain
from raytrain import errors, hooks
from raytrain.bench.options import BenchError
from raytrain.bench.predict import PredictError
from raytrain.cli import Terminated, run_command
from raytrain.driver.interrupts import Interrupted
from raytrain.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    PipelineCodeError,
    PipelineError,
    RunFailed,
    StorageError,
    UsageError,
    UserError,
)
from raytrain.instruments.window import TrainingDiverged
from raytrain.observe.report import ReportError
from raytrain.parallel.device import DeviceFailure
from raytrain.parallel.strategy import is_collective_failure
from raytrain.rundir import Store
from raytrain.rundir.faults import StorageUnavailable
from raytrain.rundir.files import DriverGone, LockUnreadable, RunLocked
from raytrain.worker.network import ProcessGroupNetworkError

STATUSES = {  # every error type a command ends with -> its exit status (DESIGN: Exit status)
    ConfigError: 2,
    UsageError: 2,
    DataError: 2,
    StorageError: 2,
    StorageUnavailable: 2,
    RunLocked: 2,
    LockUnreadable: 2,  # a lock file that is not a lock's record: the user checks and removes it
    CheckpointError: 2,
    PipelineError: 2,
    PipelineCodeError: 2,
    ReportError: 2,
    DeviceFailure: 2,  # out of memory, a device-side assert: the same at every retry
    PredictError: 2,
    ProcessGroupNetworkError: 2,  # the workers' process group cannot connect across hosts: the interfaces
    RunFailed: 1,
    BenchError: 1,
    TrainingDiverged: 1,  # a UserError (never retried) and a FloatingPointError, but the run failed
    DriverGone: 1,  # the run's lock was removed under a live driver: its workers stopped, the run failed
}


def make(kind: type[BaseException]) -> BaseException:
    if kind is ConfigError:
        return ConfigError([("lr", "got -1; give a rate > 0")])
    if kind is RunLocked:
        return RunLocked(Store.of("/tmp/runs/a"), {"pid": 7, "host": "what went wrong"})
    if kind is LockUnreadable:
        return LockUnreadable(Store.of("/tmp/runs/a"), "what went wrong")
    if issubclass(kind, StorageError):
        return kind(28, "cannot write /x: what went wrong (ENOSPC); free space")
    return kind("what went wrong")


def subclasses(kind: type) -> set[type]:
    found = set(kind.__subclasses__())
    return found.union(*(subclasses(sub) for sub in found))


@pytest.mark.parametrize("kind", STATUSES, ids=lambda kind: kind.__name__)
def test_every_error_type_has_its_exit_status(kind):
    assert errors.exit_status(make(kind)) == STATUSES[kind]


def test_every_user_error_and_run_failure_is_in_the_table():
    for module in pkgutil.walk_packages(raytrain.__path__, "raytrain."):  # an error type anywhere
        importlib.import_module(module.name)
    assert {
        kind for kind in subclasses(UserError) | subclasses(RunFailed) if kind.__module__.startswith("raytrain.")
    } <= (set(STATUSES))


def test_signals_and_unexpected_errors():
    assert errors.exit_status(Interrupted(signal.SIGINT, "/tmp/runs/a")) == 130
    assert errors.exit_status(Interrupted(signal.SIGTERM, "/tmp/runs/a")) == 143
    assert errors.exit_status(Terminated()) == 143
    for unexpected in (KeyError("x"), FloatingPointError("x"), ValueError("x"), RuntimeError("x")):
        assert errors.exit_status(unexpected) is None


def command(error: BaseException, **extra) -> Namespace:
    def handler(args):
        raise error

    return Namespace(command="train", handler=handler, **extra)


@pytest.mark.parametrize("kind", STATUSES, ids=lambda kind: kind.__name__)
def test_the_command_line_exits_by_the_errors_type_with_one_message(kind, capsys):
    error = make(kind)
    assert run_command(command(error)) == STATUSES[kind]
    err = capsys.readouterr().err
    assert err.startswith("raytrain train: ") and ("what went wrong" in err or "Invalid configuration" in err)


def test_a_configuration_error_names_each_option_as_the_user_wrote_it(capsys):
    args = command(ConfigError([("lr", "got -1; give a rate > 0")]), spell=lambda name: f"{name} (in run.yaml)")
    assert run_command(args) == 2
    assert (
        capsys.readouterr().err == "raytrain train: Invalid configuration: lr (in run.yaml): got -1; give a rate > 0\n"
    )


def test_a_file_system_error_is_named_with_its_path_and_fix(capsys):
    assert run_command(command(PermissionError(13, "Permission denied", "/srv/runs"))) == 2
    err = capsys.readouterr().err
    assert "cannot use /srv/runs: Permission denied (EACCES)" in err


def test_an_error_raytrain_does_not_anticipate_keeps_its_traceback():
    with pytest.raises(KeyError):
        run_command(command(KeyError("bug")))


def test_a_signal_outside_a_run_exits_with_its_status(capsys):
    assert run_command(command(KeyboardInterrupt())) == 130
    assert run_command(command(Terminated())) == 143
    assert capsys.readouterr().err == "raytrain train: interrupted\nraytrain train: terminated\n"


# -- collective failures ------------------------------------------------------------------------

# What torch 2.13's gloo raises on rank 0 (bare RuntimeErrors; tests/gloo_peers.py shows them).
GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:28044. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
    "for recv operation to complete"
)


@pytest.mark.parametrize(
    "error",
    [
        dist.DistError("collective failed"),
        dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1 remote process exited"),
        dist.DistNetworkError("Connection reset by peer"),
        dist.DistStoreError("Timed out after 300 seconds waiting for clients"),
        ray.exceptions.ActorDiedError(),
        ray.exceptions.NodeDiedError("node 10.0.0.2 died"),
        ray.exceptions.WorkerCrashedError(),
        RuntimeError(GLOO_PEER_GONE),
        RuntimeError(GLOO_TIMEOUT),
    ],
    ids=repr,
)
def test_a_lost_or_stalled_peer_is_a_collective_failure(error):
    assert is_collective_failure(error)
    try:  # and so is the user's error raised from one
        raise ValueError("forward failed") from error
    except ValueError as wrapped:
        assert is_collective_failure(wrapped)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("[gloo/transport/tcp/pair.cc:553] mentioned in the user's own message"),
        ValueError("gloo backend: NCCL not configured in my pipeline"),
        RuntimeError("gloo is the CPU backend; NCCL the GPU's"),
        TimeoutError("my tokenizer service timed out"),
        IndexError("Target 12 is out of bounds."),
    ],
    ids=repr,
)
def test_the_users_errors_that_mention_a_backend_are_not_collective_failures(error):
    assert not is_collective_failure(error)


class Loss(raytrain.Pipeline):
    def __init__(self, error: BaseException):
        self.error = error

    def compute_loss(self, model, batch):
        raise self.error


def test_compute_loss_passes_a_collective_failure_through_and_blames_the_pipeline_for_the_rest():
    lost = dist.DistBackendError("NCCL communicator was aborted")
    with pytest.raises(dist.DistBackendError):
        hooks.call(Loss(lost), "compute_loss", None, {}, passthrough=is_collective_failure)
    with pytest.raises(PipelineCodeError, match="compute_loss raised ValueError: gloo"):
        hooks.call(Loss(ValueError("gloo")), "compute_loss", None, {}, passthrough=is_collective_failure)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exits", "stalls"])
def test_what_gloo_raises_for_a_lost_peer_is_a_collective_failure(tmp_path, how):
    from ranks import run_ranks

    out = tmp_path / "seen.json"
    run_ranks("gloo_peers.py", how, out, timeout_s=120, check=False)  # rank 1 goes away: the run fails
    seen = json.loads(out.read_text())
    assert seen["type"] is not None, "the collective did not fail"
    assert seen["collective"], seen


def test_a_finished_run_whose_controller_does_not_return_is_ended_and_counted_finished():
    """A run whose training finished always ends: `done` starts the controller's grace, and a
    controller still waiting then (a replica waiting for room) is ended."""
    import threading

    from raytrain.driver.interrupts import EndsWhenDone
    from raytrain.rundir.records import Event, Kind

    lines, ended = [], threading.Event()
    sink = EndsWhenDone(lines.append, grace_s=0.05, end=lambda: ended.set() or True)
    sink.event(Event(Kind.EPOCH, "epoch 1/1"))
    assert not ended.wait(0.2)  # no `done`, no end
    sink.event(Event(Kind.DONE, "finished 1 epochs, 23 steps"))
    assert ended.wait(5) and sink.ended
    assert "training finished" in lines[0] and "ending it" in lines[0]
    returned = EndsWhenDone(lines.append, grace_s=0.05, end=lambda: pytest.fail("ended a controller that returned"))
    returned.event(Event(Kind.DONE, "finished"))
    returned.cancel()  # the controller returned within its grace
    time.sleep(0.2)
    assert not returned.ended


def test_an_abort_the_controller_does_not_answer_kills_it(monkeypatch):
    """After "aborting", the driver returns: a controller stuck in a wait of its own is killed."""
    import ray

    from raytrain.driver import interrupts

    killed = []

    def no_answer(ref, timeout=None):
        raise ray.exceptions.GetTimeoutError("no answer")

    controller = SimpleNamespace(abort=SimpleNamespace(remote=lambda: "ref"))
    monkeypatch.setattr(ray, "get", no_answer)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append((actor, no_restart)))
    monkeypatch.setattr(interrupts, "_controller", controller)
    lines = []
    interrupts.StopRequest(run_dir=None, echo=lines.append).abort("the workers did not stop in time")
    assert killed == [(controller, True)] and "aborting the run" in lines[0]
    monkeypatch.setattr(interrupts, "_controller", None)
    assert interrupts.end_controller(abort_timeout_s=1) is False  # no run: nothing to end
