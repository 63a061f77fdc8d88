"""The driver's Ray: join a cluster or start an embedded one, and what it can hold.

- `ray_session`: join the Ray given by --address/RAY_ADDRESS (checked first: a dead or
  foreign address fails in seconds, not minutes), or start an embedded local one bound to
  loopback, isolated from other Rays on the host, and stop it after;
- capacity: a worker count this machine can never hold is refused before anything starts;
- the environment every worker gets (`WORKER_ENV`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterator

from raytrain.config import TrainConfig
from raytrain.config.sections import ClusterSection
from raytrain.environ import scoped_env
from raytrain.errors import ConfigError, RunFailed
from raytrain.rules.head import (
    NO_HEAD_FIX,
    Diagnosis,
    address_form_problem,
    join_failure,
    slow_death_note,
    split_host_port,
    tried_address,
)

# Without this every print in the train function shows twice (RAY_NOTES).
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
# Ray starts its workers at nice 15, below its own processes at 0. When the training workers
# fill every core (2 workers on 2 CPUs), each wake-up of the raylet, GCS or dashboard (or of
# anything else on the machine) then preempts a rank while the others wait for it in the
# all-reduce; an embedded Ray starts its workers at this niceness instead (RAY_worker_niceness,
# if exported, wins). benchmarks/RESULTS.md, section 1.
EMBEDDED_WORKER_NICENESS = "0"
# The head's dashboard and autoscaler monitor each serve Prometheus /metrics on every interface
# (0.0.0.0) unless the node's address is loopback, which Ray never makes it (README
# "Exposure"); their ports are read from these variables, and no setting moves the address.
METRICS_PORT_VARIABLES = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")
# How soon the head declares a silent node dead (a host lost, frozen or cut off): Ray's
# defaults (a check every 3 s, each given 10 s, 5 misses) take 62–65 s
# (`raytrain.rules.head.seconds_to_declare_dead`), during which a
# restarting run waits for the node's workers and an elastic one cannot shrink. With these a
# cut-off node was declared dead 15 s after the cut (benchmarks/RESULTS.md section 30); a node
# busy enough to miss five 2 s answers in a row is not the common case.
# Set on the head (`ray start --head --system-config`), where the checks run: the Ray
# raytrain starts and `raytrain up` use them; docs/cluster.md says how to set them elsewhere.
NODE_HEALTH_CONFIG = {
    "health_check_initial_delay_ms": 2000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 5,
}
EMBEDDED_SYSTEM_CONFIG = {
    **NODE_HEALTH_CONFIG,
    # Ray binds its servers to the node's address even when asked for 127.0.0.1
    # (services.resolve_ip_for_localhost); its gRPC ports need the session token, but the
    # Prometheus /metrics exporters answer anyone: the per-node agent's is not started.
    "enable_metrics_collection": False,
    # The raylet would start one idle Python worker per CPU for the first driver; a run's
    # actors (Train's controller and workers, Ray Data's) start workers of their own, so on
    # a small machine those only take CPU from the start (RESULTS.md §22).
    "prestart_worker_first_driver": False,
}


def metrics_port_env(port: int) -> dict[str, str]:
    """The variables that send both /metrics servers to `port`, a port already taken on this
    machine: their bind fails (logged by Ray as "An exception occurred while starting the
    metrics server"), so nothing listens on 0.0.0.0 for them."""
    return {name: str(port) for name in METRICS_PORT_VARIABLES}


def hold_port() -> socket.socket:
    """A socket bound to a free loopback port and not listening: no one can connect to it, and a
    later bind of 0.0.0.0 on that port fails while it is open."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def ray_session(
    cfg: TrainConfig, *, num_cpus: int | None = None, resources: dict[str, float] | None = None
) -> Iterator[None]:
    """The module's `ray_session` (a Ray already initialized is joined too); `num_cpus` and
    `resources` (custom resources) apply to an embedded Ray only."""
    import ray
    from ray.data import DataContext

    os.environ.update(WORKER_ENV)
    DataContext.get_current().enable_progress_bars = False
    if not cfg.verbose:
        quiet_ray_data_console()
    if ray.is_initialized():
        note_cluster_capacity(cfg)
        yield
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {**WORKER_ENV, "PYTHONPATH": driver_pythonpath()}}
    # Worker and actor output (Ray's per-report lines, data-execution notes, C++
    # warnings) reaches the console only with -v. The run's own lines come from
    # events.jsonl and a failure is explained from the exception (rank + traceback),
    # so quiet mode hides no error; full logs stay under the Ray session directory.
    quiet = {"logging_level": logging.INFO if cfg.verbose else logging.ERROR, "log_to_driver": cfg.verbose}
    with contextlib.ExitStack() as held:
        if address:
            _join_cluster(address, runtime_env, quiet, from_env=not cfg.address)
        else:
            # Held while the embedded Ray lives: its /metrics servers start after ray.init returns.
            metrics_port = held.enter_context(contextlib.closing(hold_port()))
            cpus = num_cpus or max(os.cpu_count() or 1, int(cfg.max_workers * cfg.cpus_per_worker) + 2)
            _start_embedded(cpus, resources, runtime_env, quiet, metrics_port.getsockname()[1])
        note_cluster_capacity(cfg)
        try:
            yield
        finally:
            ray.shutdown()


def quiet_ray_data_console() -> None:
    """Ray Data's lines on the driver's console — per-execution notes, and the tracebacks of a
    read that failed, which raytrain explains in one message naming the file — go to its log
    file only (`logs/ray-data/` in the session directory, the full trace kept); -v shows them."""
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.CRITICAL)


def _join_cluster(address: str, runtime_env: dict, quiet: dict, from_env: bool) -> None:
    """ray.init at `address` (--address, or RAY_ADDRESS when `from_env`), checked first: a
    malformed, dead or foreign address is a ConfigError in seconds; a failed join is explained
    (`join_problem`)."""
    import ray

    def refused(message: str) -> ConfigError:
        return ConfigError([("", f"RAY_ADDRESS: {message}")] if from_env else [("address", message)])

    problem = address_problem(address)
    if problem:
        raise refused(f"got {address!r}: {problem[0]}; {problem[1]}")
    # Inside `ray job submit` the job's runtime_env may set the same variables; Ray
    # refuses to merge two values for one key, and the job's choice should win.
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}")
    job_env = job_config.get("runtime_env", {}).get("env_vars", {})
    runtime_env["env_vars"] = {k: v for k, v in runtime_env["env_vars"].items() if k not in job_env}
    try:
        ray.init(address=address, runtime_env=runtime_env, **quiet)
    except Exception as exc:  # connection errors come in several types
        cause = str(exc).splitlines()[0][:200]
        what, fix = join_problem(address, exc)
        raise refused(f"cannot join the Ray cluster at {address!r}: {what} (Ray: {cause}); {fix}") from None


def head_system_config() -> dict | None:
    """The system config of the head this driver joined: only the keys its `ray start
    --system-config` (or ray.init's `_system_config`) was given; None where it cannot be read
    (through Ray Client). Ray 2.60 has no public read of it."""
    try:
        from ray._private.state import state

        return state.get_system_config()
    except Exception:  # noqa: BLE001 - what is said of it is advice: a head not read gets none
        return None


def note_slow_node_death(echo: Callable[[str], None]) -> None:
    """Say once, in a run's plan, that the head it joined declares a silent node dead late
    (`raytrain.rules.head.slow_death_note`), with the fix."""
    config = head_system_config()
    note = slow_death_note(config, NODE_HEALTH_CONFIG) if config is not None else None
    if note:
        echo(f"raytrain: note: {note}")


def token_source(environ: Mapping[str, str] | None = None, home: Path | None = None) -> str:
    """Which token a Ray driver started here sends, in Ray 2.60's order (RAY_AUTH_TOKEN, then the
    file RAY_AUTH_TOKEN_PATH names, then ~/.ray/auth_token), and when its file last changed."""
    environ = os.environ if environ is None else environ
    path = Path(environ.get("RAY_AUTH_TOKEN_PATH") or (home or Path.home()) / ".ray" / "auth_token")
    if environ.get("RAY_AUTH_MODE", "").lower() != "token":
        unset = "RAY_AUTH_MODE is not `token` here"
        return (
            f"{unset}: it sends the token in {path}, if Ray takes token mode from that file"
            if path.exists()
            else f"{unset} and {path} does not exist: it sends no token"
        )
    if environ.get("RAY_AUTH_TOKEN"):
        return "the token in RAY_AUTH_TOKEN"
    try:
        changed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    except OSError:
        return f"no token: {path} does not exist"
    return f"the token in {path} (last changed {changed})"


def join_problem(address: str, exc: BaseException) -> Diagnosis:
    """What a failed ray.init at `address` means and its fix (`rules.head.join_failure`), from
    the exception and its causes (ray.init wraps a version mismatch in a ConnectionError) and
    whether a Ray server answers where it tried: the token is named only when one does."""
    causes, seen = [], exc
    while seen is not None and len(causes) < 5:
        causes.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    error = "\n".join(causes)
    tried = tried_address(address, error)
    return join_failure(address, error, answers=bool(tried) and gcs_answers(tried), sends=token_source())


def _start_embedded(
    cpus: int, resources: dict[str, float] | None, runtime_env: dict, quiet: dict, metrics_port: int
) -> None:
    """A local Ray on this machine: its dashboard on loopback, no open metrics exporters (the
    per-node agent's is off by system config; the dashboard's and monitor's are sent to
    `metrics_port`, held by this process: `metrics_port_env`)."""
    import ray

    dashboard_port = free_port()
    # Train's placement-group cleaner polls the dashboard (RAY_NOTES); name ours, or with
    # several Rays on one host it cannot tell which one to ask.
    runtime_env["env_vars"]["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
    # Read by the processes ray.init starts (the raylet; the dashboard and monitor), not by
    # this driver: set for the start only, so that nothing started later inherits them.
    for_start = {
        "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", EMBEDDED_WORKER_NICENESS),
        **metrics_port_env(metrics_port),
    }
    try:
        with scoped_env(for_start):
            ray.init(
                address="local",
                num_cpus=cpus,
                resources=resources,
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                dashboard_port=dashboard_port,
                runtime_env=runtime_env,
                _system_config=EMBEDDED_SYSTEM_CONFIG,
                **quiet,
            )
    except Exception as exc:
        raise RunFailed(
            f"could not start the embedded Ray ({str(exc).splitlines()[0][:300]}); "
            "is the machine overloaded, or /tmp full? Rerun with -v for Ray's logs."
        ) from None


def ray_logs_dir() -> str | None:
    """This Ray session's log directory (worker logs live under it), while Ray is up."""
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():  # the session's directory is the temp dir's, by its name
            context = ray.get_runtime_context()
            return os.path.join(context.get_temp_dir(), context.get_session_name(), "logs")
    return None


def address_problem(address: str, timeout_s: float = 5.0) -> Diagnosis | None:
    """Why `address` cannot be joined, judged in a few seconds (its form, then whether a Ray
    server answers there: ray.init would retry a dead one for minutes), with the fix; None if
    it may be joined."""
    form = address_form_problem(address)
    target = tried_address(address, "")
    if form or target is None:
        return form
    host, port = split_host_port(target)
    try:
        connection = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as exc:
        return f"nothing answers there ({exc.strerror or type(exc).__name__})", NO_HEAD_FIX
    with connection:
        if not speaks_grpc(connection, timeout_s):
            return "something answers there, but not a Ray cluster (Ray's GCS and Ray Client server speak gRPC)", (
                "give the head's GCS port (6379 unless `ray start --port` chose another), not the dashboard's (8265) "
                "or another service's"
            )
    return None


def gcs_answers(address: str, timeout_s: float = 3.0) -> bool:
    """Whether a gRPC server (Ray's GCS, or its Ray Client server) answers at HOST:PORT `address`."""
    return tried_address(address, "") is not None and address_problem(address, timeout_s) is None


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


def will_embed_ray(cfg: ClusterSection) -> bool:
    """Whether ray_session would start an embedded Ray (no address, none running)."""
    import ray

    return not (ray.is_initialized() or cfg.address or os.environ.get("RAY_ADDRESS"))


def note_cluster_capacity(cfg: ClusterSection, echo: Callable[[str], None] = print) -> None:
    """On a cluster that cannot hold MIN workers now, say that the run waits for nodes (an
    autoscaler may add them; nothing can be started until then)."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 0)
    need = cfg.min_workers * cfg.cpus_per_worker
    if need > cpus:
        echo(
            f"raytrain: note: the cluster has {cpus:g} CPUs and {cfg.min_workers} workers × {cfg.cpus_per_worker:g} "
            f"CPU need {need:g}: "
            "training starts when nodes join (an autoscaler); without one, stop it with Ctrl-C and use fewer --workers"
        )


def check_embedded_capacity(cfg: ClusterSection, echo: Callable[[str], None] = print) -> None:
    """Refuse a worker count this machine can never hold; warn about a small oversubscription."""
    import psutil

    cpus = os.cpu_count() or 1
    need = cfg.max_workers * cfg.cpus_per_worker
    if need > MAX_WORKERS_PER_CPU * cpus:
        most = int(MAX_WORKERS_PER_CPU * cpus // cfg.cpus_per_worker)
        why = (
            f"got {cfg.workers} workers × {cfg.cpus_per_worker:g} CPU = {need:g} CPUs, but this machine has {cpus} "
            f"and an embedded Ray runs every worker here; use at most {most} (or fewer --cpus-per-worker), or join a "
            "cluster with --address"
        )
        raise ConfigError([("workers", why)])
    available = psutil.virtual_memory().available
    if cfg.max_workers * WORKER_BASE_MEMORY_BYTES > available:
        why = (
            f"got {cfg.workers} workers; each takes about {WORKER_BASE_MEMORY_BYTES / 2**30:.1f} GiB before any data "
            f"and this machine has {available / 2**30:.1f} GiB available; use at most "
            f"{max(1, int(available // WORKER_BASE_MEMORY_BYTES))}, or join a cluster with --address"
        )
        raise ConfigError([("workers", why)])
    if need > cpus:
        echo(
            f"raytrain: note: {cfg.max_workers} workers × {cfg.cpus_per_worker:g} CPU on a {cpus}-CPU machine: "
            "oversubscribed — fine for a test, slow for training"
        )


def free_port() -> int:
    with hold_port() as sock:
        return sock.getsockname()[1]


def driver_pythonpath() -> str:
    """Workers import what the driver does: raytrain from where the driver has it, then the
    driver's path, then its working directory (for `module:attr` pipelines) — last, so that a
    folder there never shadows an installed package (`raytrain.pipeline.import_path`)."""
    from raytrain.pipeline import import_path

    return os.pathsep.join(import_path())


def resolve_gpu(cfg: ClusterSection) -> bool:
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if cfg.gpu and not gpus:
        why = "was asked for, but the Ray cluster has no GPUs; drop --gpu or connect to a cluster with GPUs (--address)"
        raise ConfigError([("gpu", why)])
    use_gpu = bool(gpus) if cfg.gpu is None else cfg.gpu
    if use_gpu:
        note_gpu_capacity(cfg, gpus)
    return use_gpu


def note_gpu_capacity(cfg: ClusterSection, gpus: float, echo: Callable[[str], None] = print) -> None:
    """Each worker takes one GPU, and Ray counts them like CPUs: more workers than the cluster's
    GPUs wait for GPUs that never come, in silence. On this machine alone (the cluster has one
    node) that is refused; on a cluster of several, said, as nodes may still join."""
    import ray

    if cfg.min_workers <= gpus:
        return
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    if nodes <= 1 and not cfg.address and not os.environ.get("RAY_ADDRESS"):
        fewer = f"{int(gpus)}{':' + str(cfg.max_workers) if cfg.elastic and cfg.max_workers > gpus else ''}"
        why = f"got {cfg.workers} with GPUs, one GPU each, but this machine has {gpus:g}; use --workers {fewer}"
        raise ConfigError(
            [("workers", f"{why}, --no-gpu to train on CPUs, or join a cluster with more GPUs (--address)")]
        )
    echo(
        f"raytrain: note: the cluster has {gpus:g} GPUs and {cfg.min_workers} workers need one each: training "
        "starts when nodes with GPUs join (an autoscaler); without one, stop it with Ctrl-C and use fewer --workers"
    )
