"""Pure tier: the pieces that keep bad input and faults to one message and nothing lost — strict
JSON, atomic writes, storage errors by errno, the run lock, resume rules, typed pipeline
arguments, compute_loss checks, the address probe, the embedded Ray's capacity check, and the
CLI's exit statuses for each."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import raytrain
from raytrain import hooks, rundir
from raytrain.cli import main
from raytrain.config import TrainConfig
from raytrain.driver.session import address_problem, check_embedded_capacity
from raytrain.driver.summary import write_summary
from raytrain.errors import ConfigError, PipelineCodeError, PipelineError, StorageError, find_user_error, pipeline_code
from raytrain.pipeline import parse_pipeline_args
from raytrain.rules.resume import StoredRun, changes
from raytrain.rundir.host import host_id


def test_run_files_are_strict_json():
    assert rundir.dumps({"loss": float("nan"), "lr": [float("inf"), 1.0]}) == '{"loss": null, "lr": [null, 1.0]}'


def test_summary_is_strict_and_says_diverged_for_a_nan_loss(tmp_path):
    from raytrain.instruments.window import TrainingDiverged

    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"epoch": 1, "step": 5, "loss": float("nan"), "world_size": 2, "epoch_end": True}) + "\n"
    )
    summary = write_summary(tmp_path, TrainConfig(), None, TrainingDiverged("the loss became NaN"), time.time())
    text = (tmp_path / "summary.json").read_text()
    assert summary.status == "diverged" and "NaN" not in text.replace("the loss became NaN", "")
    json.loads(text, parse_constant=lambda c: pytest.fail(c))


def test_a_deterministic_fault_is_the_summarys_error_not_rays_wrapper(tmp_path):
    from raytrain.instruments.agreement import ReplicaMismatchRecurred

    wrapper = RuntimeError("Training failed due to worker errors:\n...")  # Ray Train's, each rank's inside
    wrapper.worker_failures = {1: ReplicaMismatchRecurred("Replicas disagree at step 15: the run stops here.")}
    summary = write_summary(tmp_path, TrainConfig(), None, wrapper, time.time())
    assert summary.status == "failed" and summary.error == "Replicas disagree at step 15: the run stops here."


def test_atomic_write_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    rundir.write_json(target, {"status": "finished"})

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(
        StorageError, match=r"cannot write .*summary.json: No space left on device \(ENOSPC\); the file system is full"
    ):
        rundir.write_json(target, {"status": "failed"})
    assert json.loads(target.read_text()) == {"status": "finished"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


@pytest.mark.parametrize(
    "code, fix",
    [
        (errno.EROFS, "read-only"),
        (errno.EACCES, "no permission"),
        (errno.ENAMETOOLONG, "too long"),
        (errno.ENOTDIR, "is a file"),
    ],
)
def test_storage_errors_name_path_errno_and_fix(code, fix):
    error = rundir.storage_error(OSError(code, os.strerror(code)), "/runs/x", "write")
    assert isinstance(error, StorageError) and error.errno == code
    assert (
        str(error).startswith("cannot write /runs/x:")
        and f"({errno.errorcode[code]})" in str(error)
        and fix in str(error)
    )


def test_storage_that_is_a_file_or_unwritable_is_refused_before_ray(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = main(["train", "digits", "--storage", str(blocker), "--name", "r"])
    err = capsys.readouterr().err
    assert code == 2 and "is a file, not a directory" in err and len(err.strip().splitlines()) == 1
    code = main(["train", "digits", "--storage", "/proc/raytrain-test", "--name", "r"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot create the run directory /proc/raytrain-test" in err and "(ENOENT)" in err


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    first, second = rundir.RunLock(tmp_path), rundir.RunLock(tmp_path)
    first.acquire()
    with pytest.raises(rundir.RunLocked, match=f"in use by process {os.getpid()}"):
        second.acquire()
    first.release()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(
        json.dumps({"pid": dead.pid, "host": os.uname().nodename, "host_id": host_id(), "since": 0})
    )
    second.acquire()
    assert second.holder()["pid"] == os.getpid()
    second.release()
    assert not (tmp_path / ".lock").exists()


def test_the_lock_is_atomic_under_racing_starters(tmp_path):
    winners, errors = [], []

    def race():
        lock = rundir.RunLock(tmp_path)
        try:
            lock.acquire()
            winners.append(lock)
        except rundir.RunLocked as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(errors) == 7


def stored(position=None, **config):
    return StoredRun(
        Path("/runs/r"), {"seed": 0, "epochs": 3, "shuffle_window_rows": None, **config}, "digits", None, position or {}
    )


def test_resume_refuses_another_pipeline_and_order_changes_mid_epoch():
    _, refused = changes(stored(), {"seed": 0, "epochs": 3, "shuffle_window_rows": None}, "parquet")
    assert refused and refused[0][0] == "pipeline" and "trains 'digits', not 'parquet'" in refused[0][1]
    mid = stored({"epoch": 1, "epoch_offset": 320, "step": 40})
    changed, refused = changes(mid, {"seed": 7, "epochs": 5, "shuffle_window_rows": None}, "digits")
    assert [name for name, _ in refused] == ["seed"] and "320 samples into epoch 2" in refused[0][1]
    assert changed == [("epochs", 3, 5)]
    at_boundary = stored({"epoch": 2, "epoch_offset": 0, "step": 80})
    changed, refused = changes(at_boundary, {"seed": 7, "epochs": 3, "shuffle_window_rows": None}, "digits")
    assert not refused and changed == [("seed", 0, 7)]


@dataclass
class Options:
    path: str
    size: int = 4
    rate: float = 0.5
    fast: bool = False
    note: str | None = None

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"--pipeline-arg size: got {self.size}; a positive integer")


class WithArgs(raytrain.Pipeline):
    Args = Options


def test_pipeline_args_are_typed_and_unknown_keys_refused_with_the_known_ones():
    args = parse_pipeline_args(WithArgs(), {"path": "/d", "size": "8", "rate": "1e-3", "fast": "true", "note": "none"})
    assert args == Options("/d", 8, 1e-3, True, None)
    with pytest.raises(PipelineError) as failure:
        parse_pipeline_args(WithArgs(), {"pth": "/d", "size": "x"})
    message = str(failure.value)
    assert "unknown --pipeline-arg pth (did you mean 'path'?); WithArgs knows: path, size, rate, fast, note" in message
    assert (
        "--pipeline-arg size: got 'x'; expected an integer" in message and "needs --pipeline-arg path=VALUE" in message
    )
    with pytest.raises(PipelineError, match="size: got 0; a positive integer"):
        parse_pipeline_args(WithArgs(), {"path": "/d", "size": "0"})
    with pytest.raises(PipelineError, match="takes no --pipeline-arg"):
        parse_pipeline_args(raytrain.Pipeline(), {"x": "1"})


def test_unknown_pipeline_arg_is_refused_by_the_cli_before_ray(capsys):
    code = main(
        ["train", "parquet", "--pipeline-arg", "path=/d", "--pipeline-arg", "label=y", "--pipeline-arg", "hiden=64"]
    )
    err = capsys.readouterr().err
    assert (
        code == 2 and "unknown --pipeline-arg hiden (did you mean 'hidden'?)" in err and "label, features, task" in err
    )


@pytest.mark.parametrize(
    "output, expected",
    [
        (torch.ones(3, requires_grad=True), "its loss has shape (3,)"),
        (1.5, "it returned a float"),
        (torch.tensor(1.0), "has no gradient"),
        ((torch.ones((), requires_grad=True), [1]), "second item is a list"),
        ((torch.ones(()), {}, 3), "a tuple of 3"),
    ],
)
def test_compute_loss_results_are_checked_with_a_message_naming_compute_loss(output, expected):
    def returning(value, training=True):
        class Returns(raytrain.Pipeline):
            def compute_loss(self, model, batch):
                return value

        model = torch.nn.Linear(1, 1).train(training)
        return hooks.call(Returns(), "compute_loss", model, {})

    with pytest.raises(PipelineCodeError, match="compute_loss must return a scalar loss tensor") as failure:
        returning(output)
    assert expected in str(failure.value) and "in compute_loss" in str(failure.value)
    returning(torch.ones((), requires_grad=True))
    returning((torch.ones(()), {"accuracy": 1.0}), training=False)


def test_pipeline_code_errors_name_the_method_and_the_users_frame():
    def users_code():
        return {}["missing"]

    with pytest.raises(PipelineCodeError) as failure:
        with pipeline_code(raytrain.Pipeline(), "build_model"):
            users_code()
    message = str(failure.value)
    assert message.startswith("pipeline Pipeline: build_model raised KeyError: 'missing'")
    assert "test_hardening.py" in message and "in users_code" in message
    assert find_user_error(RuntimeError("wrapper")) is None and find_user_error(failure.value) is failure.value


@pytest.mark.slow
def test_an_address_that_is_not_ray_is_answered_within_seconds():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def http_like():
        connection, _ = server.accept()
        connection.recv(64)
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        connection.close()

    threading.Thread(target=http_like, daemon=True).start()
    started = time.monotonic()
    assert "not a Ray cluster" in address_problem(f"127.0.0.1:{port}")[0]
    assert time.monotonic() - started < 10
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts, never answers
    started = time.monotonic()
    assert "not a Ray cluster" in address_problem(f"127.0.0.1:{silent.getsockname()[1]}")[0]
    assert time.monotonic() - started < 30
    server.close()
    silent.close()


@pytest.mark.slow
def test_a_worker_count_this_machine_cannot_hold_is_refused_with_the_numbers(tmp_path):
    cpus = os.cpu_count() or 1
    with pytest.raises(ConfigError, match=rf"got 64 workers × 1 CPU = 64 CPUs, but this machine has {cpus}"):
        check_embedded_capacity(TrainConfig(workers=64), echo=lambda line: None)
    notes = []
    check_embedded_capacity(TrainConfig(workers=cpus + 1), echo=notes.append)
    assert notes and "oversubscribed" in notes[0]
    # The CLI, as a user runs it (a fresh process: its own embedded Ray, refused before it starts).
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("raytrain")),
            "train",
            "digits",
            "--workers",
            "64",
            "--name",
            "big",
            "--storage",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "use at most" in done.stderr and not (tmp_path / "big").exists()


@pytest.mark.slow
def test_train_names_what_is_wrong_with_an_address_and_never_the_token_when_no_head_answered(tmp_path):
    """The issue's cases, as a user runs them: each refused with exit 2 in seconds, before Ray
    starts, naming the form or that nothing answers (not a refused token)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    cases = {
        "127.0.0.1:99999": "its port 99999 is out of range: a port is a number from 1 to 65535",
        f"ray://127.0.0.1:{port}": "nothing answers there (Connection refused)",
    }
    for address, said in cases.items():
        started = time.monotonic()
        done = subprocess.run(
            [str(Path(sys.executable).with_name("raytrain")), "train", "digits", "--address", address]
            + ["--name", "joined", "--storage", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"--address: got {address!r}: {said}; " in done.stderr, done.stderr
        assert "token" not in done.stderr and "Traceback" not in done.stderr
        assert time.monotonic() - started < 60


def test_build_datasets_without_train_lists_the_keys(ray_free_build):
    from raytrain.data.sources import build_datasets

    class NoTrain(raytrain.Pipeline):
        def build_datasets(self, cfg):
            return {"training": None, "val": None}

    with pytest.raises(PipelineCodeError, match=r"returned a dict with keys \['training', 'val'\]"):
        build_datasets(NoTrain(), TrainConfig())


@pytest.fixture
def ray_free_build():
    yield


@pytest.mark.slow
def test_the_readme_example_imports_from_the_working_directory(tmp_path):
    project = tmp_path / "my_project"
    project.mkdir()
    (project / "__init__.py").write_text("")
    (project / "train.py").write_text("import raytrain\nclass Regression(raytrain.Pipeline):\n    pass\n")
    code = (
        "import os, sys; sys.path = [p for p in sys.path if p not in ('', os.getcwd())];"
        "from raytrain.pipeline import load_pipeline; "
        "print(type(load_pipeline('my_project.train:Regression')).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "Regression", done.stderr


@pytest.mark.slow
def test_a_clone_in_the_working_directory_never_shadows_the_installed_raytrain(tmp_path):
    """A newcomer runs `raytrain train my_port:Pipe` from a directory that also holds a clone of
    this repository (`./raytrain/`, a folder without __init__.py, and its `pipelines/`). The
    driver finds my_port there, and the workers — given the driver's path, in a process started
    elsewhere — import raytrain and the built-in pipelines from where the driver has them."""
    (tmp_path / "raytrain" / "raytrain").mkdir(parents=True)  # the clone's root: a namespace package
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "__init__.py").write_text("raise ImportError('the clone was imported')\n")
    (tmp_path / "my_port.py").write_text("import raytrain\nclass Pipe(raytrain.Pipeline):\n    pass\n")
    code = (
        "import os, sys, subprocess; sys.path = [p for p in sys.path if p not in ('', os.getcwd())];"
        "import raytrain; from raytrain.pipeline import load_pipeline;"
        "from raytrain.driver.session import driver_pythonpath;"
        "print(type(load_pipeline('my_port:Pipe')).__name__, type(load_pipeline('digits')).__name__);"
        "worker = 'import raytrain, pipelines.digits, my_port; print(raytrain.__file__, my_port.__file__)';"
        "env = {**os.environ, 'PYTHONPATH': driver_pythonpath()};"
        "print(subprocess.run([sys.executable, '-c', worker], env=env, cwd='/', capture_output=True, text=True,"
        " check=True).stdout.strip(), raytrain.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(raytrain.__file__).resolve().parents[1])  # this checkout, as installed
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded, worker = done.stdout.strip().splitlines()
    assert loaded == "Pipe DigitsPipeline"
    worker_raytrain, worker_port, driver_raytrain = worker.split()
    assert worker_raytrain == driver_raytrain and worker_port == str(tmp_path / "my_port.py")


def test_a_module_an_installed_package_hides_is_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "json.py").write_text("class Pipe: pass\n")  # the standard library's json comes first
    with pytest.raises(PipelineError) as failure:
        raytrain.pipeline.load_pipeline("json:Pipe")
    message = str(failure.value)
    assert message.startswith("pipeline 'json:Pipe': module 'json' is imported from ")
    assert f"not from json in the working directory ({tmp_path}); rename your module (e.g. my_json)" in message


def test_a_model_that_does_not_load_the_weights_is_said_key_by_key():
    from raytrain.errors import weights_mismatch

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    weights = {"0.weight": torch.zeros(5, 4), "0.bias": torch.zeros(3), "extra.w": torch.zeros(1)}
    with pytest.raises(RuntimeError) as failure:
        model.load_state_dict(weights, strict=True)
    assert weights_mismatch(failure.value) == (
        "missing 1.weight, 1.bias (2); unexpected extra.w (1); 0.weight is [5, 4] in the file, [3, 4] in the model"
    )


def test_pipeline_args_in_a_config_file_that_are_not_a_mapping_are_refused(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("pipeline_args: [1, 2]\n")
    code = main(["train", "digits", "--config", str(config), "--storage", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"pipeline_args (in {config}): got [1, 2] (list); expected a mapping of KEY: value" in err


def test_a_namespace_package_in_the_working_directory_is_the_users_own(tmp_path, monkeypatch):
    """`raytrain train benchmarks.overhead:TinyMLP` from a checkout: `benchmarks/` has no
    __init__.py (no __file__), and is still the user's module, not a shadowing install."""
    from raytrain.pipeline import load_pipeline

    (tmp_path / "nsbench").mkdir()
    (tmp_path / "nsbench" / "pipe.py").write_text("import raytrain\nclass Pipe(raytrain.Pipeline):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(load_pipeline("nsbench.pipe:Pipe")).__name__ == "Pipe"


def _checkpoint(run: Path, step: int) -> Path:
    """A tiny complete checkpoint as one writer leaves it: DCP files and the final files."""
    import torch.distributed.checkpoint as dcp

    from raytrain.rundir import checkpoints, formats

    directory = run / f"checkpoint_s{step:09d}_x"
    directory.mkdir(parents=True)
    with formats.single_process():
        dcp.save({"model": {"w": torch.full((2,), float(step))}}, checkpoint_id=str(directory), no_dist=True)
    checkpoints.write_train_state(directory, {"position": {"step": step}, "scaler": {}, "rng": []})
    return directory


def test_the_checkpoint_a_run_resumes_from_is_one_rule_for_the_driver_and_the_workers(tmp_path):
    from raytrain.errors import CheckpointError
    from raytrain.rules.resume import check_readable
    from raytrain.rundir.checkpoints import TRAIN_STATE_FILE, resume_choice

    run = tmp_path / "run"
    _checkpoint(run, 4)
    _checkpoint(run, 8)
    (_checkpoint(run, 12) / TRAIN_STATE_FILE).write_bytes(b"not a torch file")
    choice = resume_choice(run)  # the workers' view: every usable one, furthest first
    assert [d.name for d, _ in choice.usable] == ["checkpoint_s000000008_x", "checkpoint_s000000004_x"]
    assert [state["position"]["step"] for _, state in choice.usable] == [8, 4]
    assert choice.names == ["checkpoint_s000000012_x"] and "cannot be read" in choice.skipped_line()
    stored = rundir.RunDir(run).stored_run()  # the driver's: the same first one, passed over the same
    assert stored.checkpoint.name == "checkpoint_s000000008_x" and stored.passed_over == choice.passed_over
    for directory in run.glob("checkpoint_s00000000[48]_x"):
        (directory / TRAIN_STATE_FILE).write_bytes(b"")
    stored = rundir.RunDir(run).stored_run()
    assert stored.checkpoint is None and len(stored.passed_over) == 3
    with pytest.raises(CheckpointError, match="cannot be resumed: none of its checkpoints can be read"):
        check_readable(stored)


def test_rays_record_naming_a_deleted_checkpoint_is_set_aside_and_a_current_one_kept(tmp_path):
    from raytrain.rundir.checkpoints import RAY_SNAPSHOT, forget_missing

    run = tmp_path / "run"
    kept = _checkpoint(run, 4)
    record = {
        "checkpoint_results": [{"checkpoint_dir_name": kept.name, "metrics": {}}],
        "latest_checkpoint_result": {"checkpoint_dir_name": kept.name, "metrics": {}},
        "validated_checkpoint_dir_names": [],
    }
    (run / RAY_SNAPSHOT).write_text(json.dumps(record))
    assert forget_missing(run) == [] and (run / RAY_SNAPSHOT).is_file()  # it names what is there
    gone = "checkpoint_s000000002_y"
    record["checkpoint_results"].insert(0, {"checkpoint_dir_name": gone, "metrics": {}})
    (run / RAY_SNAPSHOT).write_text(json.dumps(record))
    assert forget_missing(run) == [gone] and not (run / RAY_SNAPSHOT).exists()
    assert forget_missing(run) == []  # nothing left to set aside
