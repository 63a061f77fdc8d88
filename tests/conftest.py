"""Test tiers: pure (no mark), CPU Ray (`ray` mark, one shared Ray instance), GPU (`gpu` mark)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# Ray Train's preemption watcher is an actor of every run (a process's start, polling for node
# drains); no test drains a node, so the suite's Rays (the shared one, and those the raytrain
# processes it starts begin) run without it.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


# Where a run could land outside pytest's tmp_path: the temp directory (raytrain's own
# names) and the default storage. The suite must leave nothing new there.
_OUTSIDE = {Path(tempfile.gettempdir()): "raytrain", Path.home() / "raytrain_results": ""}


def _outside_entries() -> set[Path]:
    found = set()
    for directory, prefix in _OUTSIDE.items():
        if directory.is_dir():
            found |= {entry for entry in directory.iterdir() if entry.name.startswith(prefix)}
    return found


def pytest_sessionstart(session):
    session.config.stash[_BEFORE] = _outside_entries()


def pytest_sessionfinish(session, exitstatus):
    left = sorted(_outside_entries() - session.config.stash.get(_BEFORE, set()))
    if left:
        print(f"\ntests left files outside tmp_path: {', '.join(map(str, left))}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _unblock_event_writers()


def _unblock_event_writers() -> None:
    """tensorboardX closes every writer left open at the interpreter's exit (atexit), by putting a
    stop on its queue: a writer whose logging thread died (its directory, a test's tmp_path, gone)
    has a full queue, and that put blocks forever. The Ray stage hung so once, after its last
    test had passed. A writer still open here is closed now if its thread lives, else marked
    closed so that the exit does not wait on it."""
    import gc

    try:
        from tensorboardX.event_file_writer import EventFileWriter
    except ImportError:
        return
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        writers = [obj for obj in gc.get_objects() if _is_instance(obj, EventFileWriter)]
    for writer in writers:
        if writer._closed:
            continue
        worker = writer._worker
        if worker is not None and worker.is_alive():
            writer.close()
        else:
            writer._closed = True
            with contextlib.suppress(Exception):
                writer._ev_writer.close()


def _is_instance(obj: object, kind: type) -> bool:
    """isinstance, false for a weak proxy whose object is gone (isinstance raises on it)."""
    try:
        return isinstance(obj, kind)
    except ReferenceError:
        return False


_BEFORE = pytest.StashKey[set]()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def no_recorded_head(tmp_path_factory):
    """The suite's runs never join a head someone started with `raytrain up` on this machine:
    they read the head record from an empty place (tests/test_head*.py point it elsewhere)."""
    os.environ["RAYTRAIN_HEAD_FILE"] = str(tmp_path_factory.mktemp("no-head") / "head.json")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session: 4 logical CPUs, isolated from any other Ray on the host."""
    import ray

    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    from raytrain.driver.session import EMBEDDED_SYSTEM_CONFIG, free_port

    pythonpath = os.pathsep.join([str(REPO), str(TESTS), *[p for p in sys.path if p]])
    dashboard_port = free_port()
    env_vars = {
        "PYTHONPATH": pythonpath,
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        # Other Rays may run on this host (the job test starts one): name our dashboard.
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard_port}",
        # Runs on the test S3 server pass their keys in the URI: no cloud metadata lookups.
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    ray.init(
        address="local",
        num_cpus=4,
        # raytrain tune places its trial drivers on this custom resource (0 CPUs each), as
        # its embedded Ray does; a running Ray cannot gain a resource later.
        resources={"trial_driver": 1000},
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        logging_level="ERROR",
        runtime_env={"env_vars": env_vars},
        _system_config=EMBEDDED_SYSTEM_CONFIG,  # as an embedded Ray of raytrain's
    )
    yield ray
    ray.shutdown()


@pytest.fixture
def make_config(tmp_path):
    """`make_config(**options)`: the TrainConfig of a test's run, stored in its tmp_path and named
    "run" unless the options say otherwise."""
    from raytrain import TrainConfig

    return lambda **options: TrainConfig(**{"storage": str(tmp_path), "name": "run", **options})


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process: FSDP2's own checks, no ports."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """One moto S3 server for the session (tests/s3_server.py), stopped by its pid at the end.
    Requests off loopback are kept off: no cloud metadata lookups."""
    from s3_server import MotoServer, moto_server_binary

    binary = moto_server_binary()
    if binary is None:
        pytest.skip("moto_server not installed (pip install -e '.[test]')")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    server = MotoServer(binary, tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def bucket(s3):
    """A new, empty bucket on the session's S3 server."""
    return s3.new_bucket()


@pytest.fixture(scope="session")
def digits_two_worker_run(ray_session, tmp_path_factory):
    """One `raytrain train digits --workers 2 --epochs 4 --log-every-steps 5` through the command
    line (with --mlflow-uri where MLflow is installed), shared because a Ray Train run's start
    costs more than its training: read by test_train_ray.py (the run files, the export, the
    name taken) and test_tracking.py (TensorBoard, MLflow, plots, the report). Gives the run
    directory, the exit status, stdout and the MLflow flags passed."""
    import contextlib
    import dataclasses
    import importlib.util
    import io
    from types import SimpleNamespace

    import raytrain
    from raytrain.cli import main

    storage = tmp_path_factory.mktemp("digits-two-workers")
    mlflow_flags = []  # --mlflow-uri once TrainConfig has the field and MLflow is installed
    has_field = "mlflow_uri" in {f.name for f in dataclasses.fields(raytrain.TrainConfig)}
    if has_field and importlib.util.find_spec("mlflow"):
        mlflow_flags = ["--mlflow-uri", f"file:{storage / 'mlruns'}"]
    argv = ["train", "digits", "--workers", "2", "--epochs", "4", "--log-every-steps", "5"]
    stdout = io.StringIO()  # not a terminal, as capsys's is not
    with contextlib.redirect_stdout(stdout):
        code = main([*argv, "--storage", str(storage), "--name", "digits2", *mlflow_flags])
    return SimpleNamespace(
        run_dir=storage / "digits2", storage=storage, code=code, out=stdout.getvalue(), mlflow_flags=mlflow_flags
    )


@pytest.fixture(scope="session")
def crash_recovered_run(ray_session, tmp_path_factory):
    """One 2-worker RecordingPipeline run (203 rows, 2 epochs of 13 steps, 0.05 s a step,
    checkpoints every 4 steps, lr 1e-2 with 1 warm-up epoch, log every step) whose rank 0 dies
    at step 11 of its first attempt and which --max-failures 1 restarts from the step-8
    checkpoint. Read by test_train_ray.py (the restart's step, rates and ids) and
    test_goodput_ray.py (the goodput accounting of the failure). Gives the run's result, its
    records directory and the run directory."""
    from types import SimpleNamespace

    from rt_test_pipelines import RecordingPipeline

    import raytrain

    storage = tmp_path_factory.mktemp("crash-recovered")
    out = storage / "records"
    out.mkdir()
    pipeline = RecordingPipeline(str(out), num_rows=203, crash_at_step=11, step_sleep_s=0.05)
    cfg = raytrain.TrainConfig(
        workers=2,
        epochs=2,
        batch_size_per_worker=8,
        lr=1e-2,
        warmup_epochs=1,
        max_failures=1,
        checkpoint_every_steps=4,
        checkpoint_async=False,  # the step-8 checkpoint is whole before step 9 begins
        log_every_steps=1,
        storage=str(storage),
        name="crash",
    )
    result = raytrain.fit(pipeline, cfg)
    return SimpleNamespace(result=result, out=out, run_dir=storage / "crash")


@pytest.fixture(scope="session")
def one_epoch_recording_run(ray_session, tmp_path_factory):
    """One finished 2-worker, 1-epoch RecordingPipeline run (64 rows, 8 a worker: 4 steps,
    constant schedule, log every step, each rank's weights written after the first step) named
    "good". test_train_ray.py compares the ranks' weights; test_hardening_ray.py's refused
    resumes leave it byte-identical (asserted there); test_train_ray.py's resume then continues
    it to a second epoch, the only change any test makes to it. Gives the storage, the records
    directory and the options the run was started with."""
    from types import SimpleNamespace

    from rt_test_pipelines import RecordingPipeline

    import raytrain

    storage = tmp_path_factory.mktemp("one-epoch")
    out = storage / "records"
    out.mkdir()
    base = dict(
        workers=2, batch_size_per_worker=8, storage=str(storage), name="good", log_every_steps=1, schedule="constant"
    )
    raytrain.fit(RecordingPipeline(str(out), num_rows=64, probe_weights=True), raytrain.TrainConfig(epochs=1, **base))
    return SimpleNamespace(storage=storage, out=out, base=base, run_dir=storage / "good")
