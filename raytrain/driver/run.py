"""The driver: resolve the run, start or join Ray, fit a TorchTrainer, write the run files.

All driver-side Ray calls live here. The per-worker function is `raytrain.worker.loop`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from raytrain.rules import batch as rules
from raytrain.observe import tracking
from raytrain import rundir
from raytrain.driver import interrupts
from raytrain.rundir.checkpoints import MODEL_FILE, checkpoint_dirs, staging_dir
from raytrain.data.checks import DataError
from raytrain.rules.resume import StoredRun, describe_changes, read_stored_run
from raytrain.rules.resume import changes as resume_changes
from raytrain.config import ConfigError, TrainConfig
from raytrain.errors import PipelineCodeError, StorageError, find_user_fault, pipeline_code
from raytrain.pipeline import Pipeline, load_pipeline
from raytrain.observe.render import first_line

# Without this every print in the train function shows twice (RAY_NOTES).
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
# Ray starts its workers at nice 15, below its own processes at 0. When the training workers
# fill every core (2 workers on 2 CPUs), each wake-up of the raylet, GCS or dashboard (or of
# anything else on the machine) then preempts a rank while the others wait for it in the
# all-reduce; an embedded Ray starts its workers at this niceness instead (RAY_worker_niceness,
# if exported, wins). benchmarks/RESULTS.md, section 1.
EMBEDDED_WORKER_NICENESS = "0"
# Ray checks for a bigger worker group every this many seconds when the run is elastic
# (Ray's default, 60 s, leaves new nodes idle for a minute).
ELASTIC_MONITOR_INTERVAL_S = 15.0
# After a node loss Ray first retries the old size and waits this long for it before
# trying a smaller one (Ray's default: 60 s of idle cluster per lost node).
ELASTIC_START_TIMEOUT_S = 30.0
# Ray Train's controller takes a rank's report only when it polls the workers, every
# RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default 2 s), and a rank's next report blocks
# until then: with epochs (or checkpoint intervals) shorter than that, every report idled
# the ranks (digits, 8 epochs on 1 worker: 34 s → 20 s end to end; benchmarks/RESULTS.md,
# section 1). A poll is one small actor call per worker; it also finds a dead worker sooner.
REPORT_POLL_INTERVAL_S = 0.25


_TIMERS_SET_HERE: set[str] = set()


def apply_train_timers(cfg: TrainConfig) -> None:
    """Set Ray Train's timers for this run in the environment, which Train propagates from
    the driver to its controller and workers; a value the user exported wins."""
    timers = {
        # Ray's own barriers (ray.train.report) wait forever by default: a rank stalled
        # before a report would hang the others with no error.
        "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(cfg.collective_timeout_s),
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(REPORT_POLL_INTERVAL_S),
    }
    if cfg.elastic:
        timers["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(ELASTIC_START_TIMEOUT_S)
    for key, value in timers.items():
        if key not in os.environ or key in _TIMERS_SET_HERE:
            os.environ[key] = value
            _TIMERS_SET_HERE.add(key)


class RunFailed(RuntimeError):
    """The run started but did not finish: the cause in one paragraph and where the logs are."""


@dataclass
class FitResult:
    """What `raytrain.fit` returns."""

    metrics: dict[str, Any]
    checkpoint_path: str | None
    run_dir: str
    summary: dict[str, Any]
    model_path: str | None


def fit(
    pipeline: "str | Pipeline",
    cfg: TrainConfig | None = None,
    *,
    echo: Callable[[str], None] | None = None,
    callbacks: Sequence[Any] = (),
    progress: bool = False,
) -> FitResult:
    """Train `pipeline` (a built-in name, `module:attr` or an instance) with `cfg`.

    Raises ConfigError (bad configuration, nothing started), another UserFault (bad data,
    pipeline code, checkpoint or storage: the user's to fix), TrainingDiverged (the loss
    became NaN/inf), Interrupted (SIGINT/SIGTERM; the run is resumable), RunFailed (the run
    failed otherwise). `echo` receives the run's human-readable lines (plan, epochs,
    resizes); default: none. `progress`: also show progress on stdout (a live bar on a
    terminal, else plain lines). TensorBoard files, the report and any asked-for trackers:
    `raytrain.observe.tracking`. `callbacks`: Ray Train `UserCallback`s for the TorchTrainer
    (raytrain.tune forwards reports to Tune with one).

    With `cfg.resume`, `cfg` is checked against the run's own config.yaml and checkpoint
    (`raytrain.rules.resume`) before anything is written; the CLI builds `cfg` from that file.
    """
    pipe = load_pipeline(pipeline)
    spec = pipeline if isinstance(pipeline, str) else pipe.name
    cfg = resolve_config(pipe, cfg or TrainConfig(**pipe.default_config), spec)
    run_dir = Path(cfg.storage) / cfg.name
    echo = echo or (lambda line: None)
    if cfg.fault_tolerance == "per-step" and importlib.util.find_spec("torchft") is None:
        raise ConfigError([("fault_tolerance", "got per-step, but torchft is not installed; install it with pip install 'raytrain[ft]' (torchft-nightly), or use --fault-tolerance restart")])
    if will_embed_ray(cfg):
        check_embedded_capacity(cfg, echo=echo)  # before anything is written or started
    created = not run_dir.exists()
    rundir.check_storage(cfg.storage, run_dir)  # before Ray: a path that cannot hold the run is exit 2
    lock = rundir.RunLock(run_dir)
    lock.acquire()
    try:
        stored = check_run_dir(run_dir, cfg, spec)
        tracker = tracking.RunTracker(cfg, run_dir, spec, echo=echo, progress=progress)
        with ray_session(cfg), interrupts.stop_on_signals(run_dir, echo) as stop:
            use_gpu = resolve_gpu(cfg)
            sources = prepare_datasets(build_datasets(pipe, cfg), cfg, echo)
            if stored is not None:
                check_resume(pipe, cfg, stored, sources, echo)
            rundir.write_yaml(run_dir / rundir.CONFIG, {**cfg.to_dict(), "pipeline": spec, "gpu": use_gpu})
            trainer = build_trainer(pipe, cfg, run_dir, sources, use_gpu, callbacks=callbacks)
            echo(
                f"raytrain: {cfg.name} — {pipe.name} on {describe_workers(cfg)} "
                f"({'GPU, nccl' if use_gpu else 'CPU, gloo'}); run directory {run_dir}"
            )
            started = time.time()
            with tracker.follow(since=started, train_rows=sources["train"]["rows"]):
                try:
                    result = trainer.fit()
                    error = None
                except Exception as exc:  # Ray wraps worker errors; re-raised below
                    result, error = None, exc
        summary = write_summary(run_dir, cfg, result, error, started, interrupted=stop.signal)
        if summary.extra.get("summary_error"):
            echo(f"raytrain: summary.json not written: {summary.extra['summary_error']}")
        tracker.finish(summary)
    finally:
        lock.release()
        shutil.rmtree(staging_dir(run_dir), ignore_errors=True)
        with contextlib.suppress(OSError):
            (run_dir / rundir.STOP_FILE).unlink()
        if created:  # refused before the run began: leave no empty run directory behind
            with contextlib.suppress(OSError):
                run_dir.rmdir()
    if stop.signal:
        raise interrupts.Interrupted(stop.signal, run_dir, cfg, spec)
    if error is not None:
        fault = find_user_fault(error)
        if fault is not None:  # bad data, configuration, pipeline code or storage, or divergence: the user's to fix
            raise fault from None
        raise RunFailed(explain_failure(error, run_dir, tracker.ray_logs)) from None
    return FitResult(
        metrics=summary.final_metrics,
        checkpoint_path=summary.best_checkpoint,
        run_dir=str(run_dir),
        summary=rundir.strict(summary.to_json()),
        model_path=summary.model_path,
    )


# -- resolving the run -------------------------------------------------------------------


def resolve_config(pipe: Pipeline, cfg: TrainConfig, pipeline_name: str) -> TrainConfig:
    """Fill what depends on the run as a whole: the name, and the reference batch frozen once."""
    changes: dict[str, Any] = {}
    if not cfg.name:
        stem = pipeline_name.split(":")[-1].split(".")[-1].lower() or "run"
        changes["name"] = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.reference_batch_size is None:
        changes["reference_batch_size"] = rules.default_reference_batch_size(
            max(1, cfg.max_workers), global_batch_size=cfg.global_batch_size, batch_size_per_worker=cfg.batch_size_per_worker
        )
    return dataclasses.replace(cfg, **changes) if changes else cfg


def check_run_dir(run_dir: Path, cfg: TrainConfig, spec: str) -> StoredRun | None:
    """A new run needs a new name; a resume needs the run, and options it can honour."""
    exists = (run_dir / "config.yaml").exists() or bool(checkpoint_dirs(run_dir))
    if exists and not cfg.resume:
        raise ConfigError(
            [("name", f"run {cfg.name!r} already exists in {run_dir.parent}; add --resume to continue it, or choose another --name")]
        )
    if cfg.resume and not exists:
        raise ConfigError([("resume", f"there is no run {cfg.name!r} in {run_dir.parent} to resume; check --name and --storage")])
    if not cfg.resume:
        return None
    stored = read_stored_run(run_dir)
    _, refused = resume_changes(stored, cfg.to_dict(), spec)
    if refused:
        raise ConfigError(refused)
    return stored


def check_resume(pipe: Pipeline, cfg: TrainConfig, stored: StoredRun, sources: dict[str, dict], echo: Callable[[str], None]) -> None:
    """Before anything is written: the pipeline's model must load the checkpoint, and an
    epoch half done must continue on the same data; then say what the resume changes."""
    from raytrain.rundir import checkpoints as ckpt
    if stored.checkpoint is not None:
        with pipeline_code(pipe, "build_model"):
            model = pipe.build_model(cfg)
        weights = ckpt.load_model_weights(stored.checkpoint)
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as exc:
            raise ckpt.CheckpointError(
                f"the pipeline's model does not load the run's checkpoint {stored.checkpoint.name} "
                f"({str(exc).splitlines()[0]}); resume with the pipeline and options the run was trained with"
            ) from None
        train = sources["train"]
        before = stored.position.get("data") or {}
        now = train["layout"].digest() if train["kind"] == "stream" else before  # in memory: checked on the workers
        if stored.mid_epoch and before and before != now:
            raise DataError(
                f"dataset 'train' is not the one the checkpoint at step {stored.position.get('step')} was trained on "
                f"(then {before}, now {now}); an epoch half done must finish on the same data"
            )
    changed, _ = resume_changes(stored, cfg.to_dict(), stored.pipeline or "")
    where = (
        f"from step {stored.position.get('step', 0)} (epoch {int(stored.position.get('epoch', 0)) + 1})"
        if stored.checkpoint is not None else "from the start (it has no checkpoint yet)"
    )  # fmt: skip
    echo(f"Resuming {cfg.name} {where}; {describe_changes(changed)}")


def describe_workers(cfg: TrainConfig) -> str:
    if cfg.max_workers == 0:
        return "this process (local mode)"
    if cfg.elastic:
        return f"{cfg.min_workers}–{cfg.max_workers} workers (elastic)"
    return f"{cfg.max_workers} worker{'s' if cfg.max_workers != 1 else ''}"


# -- Ray -----------------------------------------------------------------------------------


@contextlib.contextmanager
def ray_session(cfg: TrainConfig, *, num_cpus: int | None = None, resources: dict[str, float] | None = None) -> Iterator[None]:
    """Join the Ray given by --address/RAY_ADDRESS or already initialized; else start an
    embedded local one (loopback only, isolated from other Rays on the host) and stop it after.

    `num_cpus` and `resources` (custom resources) apply to an embedded Ray only."""
    import ray
    from ray.data import DataContext

    os.environ.update(WORKER_ENV)
    DataContext.get_current().enable_progress_bars = False
    if not cfg.verbose:  # Ray Data's per-execution INFO lines on the driver
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
    if ray.is_initialized():
        note_cluster_capacity(cfg)
        yield
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    level = logging.INFO if cfg.verbose else logging.ERROR
    runtime_env = {"env_vars": {**WORKER_ENV, "PYTHONPATH": driver_pythonpath()}}
    # Worker and actor output (Ray's per-report lines, data-execution notes, C++
    # warnings) reaches the console only with -v. The run's own lines come from
    # events.jsonl and a failure is explained from the exception (rank + traceback),
    # so quiet mode hides no error; full logs stay under the Ray session directory.
    quiet = {"logging_level": level, "log_to_driver": cfg.verbose}
    if address:
        problem = address_problem(address)
        if problem:
            raise ConfigError([("address", f"got {address!r}: {problem}; give the head's HOST:PORT (e.g. 10.0.0.5:6379) or leave it out for a local Ray")])
        # Inside `ray job submit` the job's runtime_env may set the same variables; Ray
        # refuses to merge two values for one key, and the job's choice should win.
        job_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}").get("runtime_env", {}).get("env_vars", {})
        runtime_env["env_vars"] = {k: v for k, v in runtime_env["env_vars"].items() if k not in job_env}
        try:
            ray.init(address=address, runtime_env=runtime_env, **quiet)
        except Exception as exc:  # connection errors come in several types
            raise ConfigError(
                [("address", f"cannot reach a Ray cluster at {address!r} ({str(exc).splitlines()[0][:200]}); check that its head "
                  "is running (ray status), the address, and RAY_AUTH_MODE=token if the cluster uses token auth")]
            ) from None
    else:
        cpus = num_cpus or max(os.cpu_count() or 1, int(cfg.max_workers * cfg.cpus_per_worker) + 2)
        dashboard_port = free_port()
        # Train's placement-group cleaner polls the dashboard (RAY_NOTES); name ours, or with
        # several Rays on one host it cannot tell which one to ask.
        runtime_env["env_vars"]["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
        os.environ.setdefault("RAY_worker_niceness", EMBEDDED_WORKER_NICENESS)  # read by the raylet it starts
        try:
            ray.init(
                address="local",
                num_cpus=cpus,
                resources=resources,
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                dashboard_port=dashboard_port,
                runtime_env=runtime_env,
                # Ray binds its servers to the node's address even when asked for 127.0.0.1
                # (services.resolve_ip_for_localhost); its gRPC ports need the session token,
                # but the Prometheus /metrics exporters answer anyone: not started here.
                _system_config={"enable_metrics_collection": False},
                **quiet,
            )
        except Exception as exc:
            raise RunFailed(
                f"could not start the embedded Ray ({str(exc).splitlines()[0][:300]}); "
                "is the machine overloaded, or /tmp full? Rerun with -v for Ray's logs."
            ) from None
    note_cluster_capacity(cfg)
    try:
        yield
    finally:
        ray.shutdown()


def address_problem(address: str) -> str | None:
    """Why `address` cannot be a GCS address that answers, judged in a few seconds; None if it may."""
    if address.startswith(("http://", "https://")):
        return "that is the dashboard/Jobs API URL (for `ray job submit`); Ray needs the GCS address, HOST:6379"
    if address in ("auto", "local") or "://" in address:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        connection = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
    except OSError as exc:
        return f"nothing answers there ({exc.strerror or type(exc).__name__})"
    with connection:
        if not speaks_grpc(connection):
            return "something answers there, but not a Ray cluster (its GCS speaks gRPC)"
    return None


def speaks_grpc(connection: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the server on `connection` answers an HTTP/2 client preface with a SETTINGS
    frame, as a gRPC server such as Ray's GCS does; other servers answer otherwise or not at
    all (ray.init would then wait minutes for them)."""
    connection.settimeout(timeout_s)
    try:
        # The HTTP/2 client preface, then an empty SETTINGS frame (length 0, type 4).
        connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        header = b""
        while len(header) < 9:
            chunk = connection.recv(9 - len(header))
            if not chunk:
                return False
            header += chunk
    except OSError:
        return False
    return header[3] == 0x04


# An embedded Ray runs every worker on this machine: at most this many workers per CPU
# (more only thrashes; a little oversubscription is useful for testing, with a warning).
MAX_WORKERS_PER_CPU = 2
# Memory one training worker takes before any data (Ray's worker process with torch imported).
WORKER_BASE_MEMORY_BYTES = 600 << 20


def will_embed_ray(cfg: TrainConfig) -> bool:
    """Whether ray_session would start an embedded Ray (no address, none running)."""
    import ray

    return not (ray.is_initialized() or cfg.address or os.environ.get("RAY_ADDRESS"))


def note_cluster_capacity(cfg: TrainConfig, echo: Callable[[str], None] = print) -> None:
    """On a cluster that cannot hold MIN workers now, say that the run waits for nodes (an
    autoscaler may add them; nothing can be started until then)."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 0)
    need = cfg.min_workers * cfg.cpus_per_worker
    if need > cpus:
        echo(
            f"raytrain: note: the cluster has {cpus:g} CPUs and {cfg.min_workers} workers × {cfg.cpus_per_worker:g} CPU need {need:g}: "
            "training starts when nodes join (an autoscaler); without one, stop it with Ctrl-C and use fewer --workers"
        )


def check_embedded_capacity(cfg: TrainConfig, echo: Callable[[str], None] = print) -> None:
    """Refuse a worker count this machine can never hold; warn about a small oversubscription."""
    import psutil

    cpus = os.cpu_count() or 1
    need = cfg.max_workers * cfg.cpus_per_worker
    if need > MAX_WORKERS_PER_CPU * cpus:
        raise ConfigError([("workers", (
            f"got {cfg.workers} workers × {cfg.cpus_per_worker:g} CPU = {need:g} CPUs, but this machine has {cpus} and an embedded "
            f"Ray runs every worker here; use at most {int(MAX_WORKERS_PER_CPU * cpus // cfg.cpus_per_worker)} "
            "(or fewer --cpus-per-worker), or join a cluster with --address"
        ))])  # fmt: skip
    available = psutil.virtual_memory().available
    if cfg.max_workers * WORKER_BASE_MEMORY_BYTES > available:
        raise ConfigError([("workers", (
            f"got {cfg.workers} workers; each takes about {WORKER_BASE_MEMORY_BYTES / 2**30:.1f} GiB before any data and this "
            f"machine has {available / 2**30:.1f} GiB available; use at most {max(1, int(available // WORKER_BASE_MEMORY_BYTES))}, "
            "or join a cluster with --address"
        ))])  # fmt: skip
    if need > cpus:
        echo(f"raytrain: note: {cfg.max_workers} workers × {cfg.cpus_per_worker:g} CPU on a {cpus}-CPU machine: oversubscribed — fine for a test, slow for training")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def driver_pythonpath() -> str:
    """Workers import `module:attr` pipelines the way the driver does: from its cwd and path."""
    entries = [os.getcwd(), *[p for p in sys.path if p and os.path.isdir(p)]]
    return os.pathsep.join(dict.fromkeys(entries))


def resolve_gpu(cfg: TrainConfig) -> bool:
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if cfg.gpu and not gpus:
        raise ConfigError([("gpu", "was asked for, but the Ray cluster has no GPUs; drop --gpu or connect to a cluster with GPUs (--address)")])
    return bool(gpus) if cfg.gpu is None else cfg.gpu


def build_datasets(pipe: Pipeline, cfg: TrainConfig) -> dict[str, Any]:
    """The pipeline's datasets as Ray Datasets (map-style torch Datasets are converted)."""
    import ray.data
    import torch.utils.data

    from raytrain.data.checks import from_torch_dataset

    with pipeline_code(pipe, "build_datasets"):
        datasets = pipe.build_datasets(cfg)
    if not isinstance(datasets, dict) or "train" not in datasets:
        got = f"a dict with keys {sorted(map(str, datasets))}" if isinstance(datasets, dict) else f"a {type(datasets).__name__}"
        raise PipelineCodeError(f"pipeline {pipe.name}: build_datasets must return a dict with a 'train' dataset (and optionally 'val'); it returned {got}")
    out = {}
    for name, ds in datasets.items():
        if isinstance(ds, torch.utils.data.Dataset) and not isinstance(ds, ray.data.Dataset):
            ds = from_torch_dataset(ds, name)
        if not isinstance(ds, ray.data.Dataset):
            raise PipelineCodeError(f"pipeline {pipe.name}: build_datasets returned dataset {name!r} as a {type(ds).__name__}, not a ray.data.Dataset or a torch Dataset")
        out[name] = ds
    return out


# Rows of the first unit the driver reads to learn the columns (and check them) before training.
PROBE_ROWS = 16


def prepare_datasets(datasets: dict[str, Any], cfg: TrainConfig, echo: Callable[[str], None]) -> dict[str, dict]:
    """Decide, from metadata and one small first batch, how the workers get each dataset
    (docs/data.md); the driver reads no full pass:

    - in memory (small, or `--shuffle-window-rows 0`): one Ray task reads and checks it
      while the workers start; every worker maps the result from the object store;
    - streamed: the dataset's units (`raytrain.data.shards`) and the run's `StreamLayout`; each
      rank reads only the units of its lanes (`raytrain.rules.order`).

    Returns the descriptors the workers open (`raytrain.worker.loop.open_source`).
    """
    import ray

    from raytrain.data import checks as data
    from raytrain.rules import order
    from raytrain.data import shards
    sources = {}
    for name, ds in datasets.items():
        units = shards.split(ds)
        if isinstance(units, str):
            echo(
                f"dataset {name!r}: {units}; Ray Data computes it once before training (materialize) and workers read its "
                "blocks. To read it sharded instead, keep such steps out of build_datasets (e.g. write the data with raytrain data)"
            )
            units = shards.split(ds.materialize())
        if not units.num_rows:
            raise data.DataError(f"dataset {name!r} is empty: it has no rows; check the pipeline's build_datasets and its input files")
        probe = read_probe(units, name, cfg.skip_nan_rows)
        schema = data.Schema.of(probe)
        window = cfg.shuffle_window_rows if name == "train" or cfg.shuffle_window_rows == 0 else None
        estimate = schema.row_bytes() * units.num_rows
        sample = {c: np.nan_to_num(v[:1]) if np.issubdtype(v.dtype, np.floating) else v[:1] for c, v in probe.items()}
        if window == 0 or (window is None and estimate <= data.IN_MEMORY_LIMIT_BYTES):
            load = ray.remote(num_cpus=0)(data.load_table)
            sources[name] = {"kind": "memory", "rows": units.num_rows, "table": load.remote(units, name, schema, cfg.skip_nan_rows)}
            echo(f"dataset {name!r}: {units.num_rows:,} rows (~{estimate / 2**20:,.0f} MiB) in memory, read once and shared by every worker")
            continue
        layout = order.StreamLayout(units.rows, window or data.auto_window_rows(schema.row_bytes()), cfg.data_partitions)
        sources[name] = {"kind": "stream", "rows": units.num_rows, "units": units, "layout": layout, "schema": schema, "sample": sample}
        echo(
            f"dataset {name!r}: {units.num_rows:,} rows (~{estimate / 2**20:,.0f} MiB) in {len(units.rows):,} {_unit_word(units.kind)}, "
            f"streamed in {layout.lanes} partition{'s' if layout.lanes != 1 else ''}, each read by one worker; "
            f"shuffled within windows of {layout.window_rows:,} rows"
        )
    return sources


def read_probe(units, name: str, skip_nan_rows: bool) -> dict[str, np.ndarray]:
    """The first few rows of the first unit, through the pipeline's steps, checked."""
    from raytrain.data import checks as data
    first = next(i for i, rows in enumerate(units.rows) if rows)
    try:
        batch = units.dataset([first], limit=PROBE_ROWS).take_batch(PROBE_ROWS, batch_format="numpy")
    except Exception as exc:
        raise data.DataError(f"dataset {name!r} cannot be read: {data.first_error_line(exc)}") from None
    columns = data.check_columns(batch, name, units.labels[first])
    bad = data.non_finite(columns)
    if bad.any() and not skip_nan_rows:
        raise data.nan_error(name, units.labels[first], columns, bad)
    return columns


def _unit_word(kind: str) -> str:
    return {"files": "Parquet row groups/files", "tasks": "read tasks", "blocks": "blocks"}[kind]


def build_trainer(pipe: Pipeline, cfg: TrainConfig, run_dir: Path, sources: dict[str, dict], use_gpu: bool, callbacks: Sequence[Any] = ()):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from raytrain.driver.failfast import FailFastTrainer
    from raytrain.worker.replicas import torchft_config
    from raytrain.errors import summarize_on_raise
    from raytrain.worker.loop import train_loop_per_worker

    workers: int | tuple[int, int] = cfg.max_workers if not cfg.elastic else (cfg.min_workers, cfg.max_workers)
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    apply_train_timers(cfg)
    elastic = {"elastic_resize_monitor_interval_s": ELASTIC_MONITOR_INTERVAL_S} if cfg.elastic else {}
    return FailFastTrainer(
        summarize_on_raise(train_loop_per_worker),
        train_loop_config={"config": cfg.to_dict(), "pipeline": pipe, "run_dir": str(run_dir), "sources": sources},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources, **elastic),
        torch_config=(
            torchft_config(use_gpu, cfg.collective_timeout_s) if cfg.fault_tolerance == "per-step"
            else TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=int(cfg.collective_timeout_s))
        ),
        # No `datasets=`: Ray's equal split drops tail rows and keeps no position. The
        # datasets travel in the config as descriptors (`prepare_datasets`), and each rank
        # reads its own units of a stream (raytrain.data.checks).
        run_config=RunConfig(
            name=cfg.name,
            storage_path=cfg.storage,
            # Node preemptions have their own, unlimited budget: losing a spot node does
            # not use up --max-failures, which is kept for real errors.
            failure_config=FailureConfig(max_failures=cfg.max_failures, max_preemption_failures=-1),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
            logging_config=LoggingConfig(log_level="INFO" if cfg.verbose else "ERROR"),
            worker_runtime_env={"env_vars": dict(WORKER_ENV)},
            callbacks=list(callbacks),
        ),
    )


# -- console and run files -------------------------------------------------------------------


def write_summary(
    run_dir: Path, cfg: TrainConfig, result: Any, error: Exception | None, started: float, *, interrupted: int = 0, status: str | None = None
) -> rundir.Summary:
    """summary.json (strict JSON, written atomically) from the run files of this invocation;
    returns it (with `summary_error` in `extra` when it could not be written)."""
    files = rundir.RunDir(run_dir)
    progress = files.progress()
    if progress is not None and progress.time < started:  # left by an earlier invocation
        progress = None
    rows = files.metrics()
    epoch_rows = [row for row in rows if row.epoch_end]
    last = epoch_rows[-1] if epoch_rows else (rows[-1] if rows else None)
    fault = find_user_fault(error)
    if status is None:
        status = (
            "interrupted" if interrupted else
            "diverged" if isinstance(fault, FloatingPointError) else
            "failed" if error is not None else "finished"
        )  # fmt: skip
    model_path = run_dir / MODEL_FILE
    at = progress or last
    summary = rundir.Summary(
        status=status,
        epochs=at.epoch if at else 0,
        steps=at.step if at else 0,
        samples_seen=at.samples_seen if at else 0,
        wall_time_s=round(time.time() - started, 3),
        steady_samples_per_s=progress.steady_samples_per_s if progress else None,
        steady_steps=progress.steady_steps if progress else None,
        world_sizes=(progress.world_sizes if progress else None) or sorted({row.world_size for row in rows if row.world_size}),
        failures_recovered=sum(event.recovers_a_failure for event in files.events(since=started - 1)),
        final_metrics={"loss": last.loss, **last.validation} if last else {},
        best_checkpoint=_best_checkpoint(result, run_dir),
        model_path=str(model_path) if model_path.exists() and status == "finished" else None,
        error=None if error is None else first_line(str(fault if fault is not None else error)) or type(error).__name__,
    )
    try:
        files.write_summary(summary)
    except StorageError as exc:  # a full disk must not hide the run's own error
        summary.extra["summary_error"] = str(exc)
    return summary


def _best_checkpoint(result: Any, run_dir: Path) -> str | None:
    if result is not None:
        with contextlib.suppress(Exception):
            best = result.get_best_checkpoint(metric="val_loss", mode="min")
            if best is not None:
                return best.path
        if result.checkpoint is not None:
            return result.checkpoint.path
    found = checkpoint_dirs(run_dir)
    return str(found[-1]) if found else None


def explain_failure(error: Exception, run_dir: Path, ray_logs: str | None = None) -> str:
    """Which rank failed with which exception, where in the user's code, then where the logs are."""
    from raytrain.observe.console import explain_worker_errors

    lines = explain_worker_errors(error)
    logs = ray_logs or "/tmp/ray/session_latest/logs"
    return (
        f"The run failed: {lines[0]}\n" + "".join(f"  {line}\n" for line in lines[1:])
        + f"Run files: {run_dir} (summary.json, events.jsonl, report.md). "
        f"Full worker logs: {logs} (worker-*.err; train/ for Ray Train), or the Ray dashboard; "
        "rerun with -v to see Ray's own logs."
    )
