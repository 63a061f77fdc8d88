"""The Ray Train side of a run: the TorchTrainer that runs the per-worker function.

Ray Train runs `raytrain.worker.loop.train_loop_per_worker` on every worker, restarts the
worker group on a failure (or replaces one replica, in per-step mode) and resizes an
elastic run. raytrain sets its timers for the run (`apply_train_timers`), its failure
policy (deterministic errors are not retried: `raytrain.driver.failfast`), and hands the
workers a typed payload (`raytrain.worker.loop.WorkerPayload`).
"""

from __future__ import annotations

import os
from typing import Any, Sequence
from uuid import uuid4

from raytrain.config import TrainConfig
from raytrain.data.sources import Source
from raytrain.driver.session import WORKER_ENV
from raytrain.pipeline import Pipeline

NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # the fault-tolerance mode's `nccl_error_handling`

# Ray checks for a bigger worker group every this many seconds when the run is elastic
# (Ray's default, 60 s, leaves new nodes idle for a minute).
ELASTIC_MONITOR_INTERVAL_S = 15.0
# After a node loss Ray may first retry the old size and waits this long for it before
# trying a smaller one (Ray's default: 60 s of idle cluster per lost node). A killed node's
# workers fail before the head has declared the node dead, so the cluster still counts it:
# on two real hosts (benchmarks/real_hosts.py, restart mode, a host lost) this wait was most
# of the 41 s from the fault to training again at 30 s (21 s at 10 s). The size the policy
# asks for is one it counted in the cluster: one not placed within 10 s is taken as gone.
ELASTIC_START_TIMEOUT_S = 10.0
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
        # Ray Train's preemption watcher (an actor per worker group, polling every 5 s) would hold the
        # group until a drained node's deadline; raytrain's workers read the notice themselves, at
        # the sync, and leave at a step boundary after a checkpoint (raytrain.instruments.notice).
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    }
    if cfg.elastic:
        timers["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(ELASTIC_START_TIMEOUT_S)
    from raytrain.faults import mode_class

    silent_s = mode_class(cfg.fault_tolerance).silent_worker_s
    if silent_s is not None:  # a worker that stops answering is taken as gone (raytrain.faults.evict.Suspects)
        timers["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(silent_s)
    for key in _TIMERS_SET_HERE - set(timers):  # an earlier run's in this process, not this one's
        os.environ.pop(key, None)
        _TIMERS_SET_HERE.discard(key)
    for key, value in timers.items():
        if key not in os.environ or key in _TIMERS_SET_HERE:
            os.environ[key] = value
            _TIMERS_SET_HERE.add(key)


def nccl_env(mode: Any) -> dict[str, str]:
    """NCCL's error handling for the fault-tolerance mode (its `nccl_error_handling`); a value
    the user exported wins."""
    return {NCCL_ERROR_HANDLING_ENV: os.environ.get(NCCL_ERROR_HANDLING_ENV) or mode.nccl_error_handling}


def _passed_on(*names: str) -> dict[str, str]:
    return {name: os.environ[name] for name in names if name in os.environ}


def build_torch_trainer(
    pipe: Pipeline,
    cfg: TrainConfig,
    run_dir: Any,
    sources: dict[str, Source],
    use_gpu: bool,
    callbacks: Sequence[Any] = (),
    invocation: str = "",
):
    """The TorchTrainer of the run: the worker count (elastic: MIN, MAX), the backend (gloo,
    NCCL, or torchft's replica groups in per-step mode), the failure and checkpoint policies.
    `invocation`: this run of the driver, the owner its lock names (its workers write only while
    the lock names it: `raytrain.rundir.files.DriverWatch`)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

    from raytrain.driver.failfast import FailFastTrainer
    from raytrain.errors import summarize_on_raise
    from raytrain.faults import mode_of
    from raytrain.faults.evict import run_key
    from raytrain.rules.network import INTERFACE_VARIABLES
    from raytrain.rundir.storage import RETRY_ENV, Store
    from raytrain.worker.loop import PAYLOAD, WorkerPayload, train_loop_per_worker

    workers: int | tuple[int, int] = cfg.max_workers if not cfg.elastic else (cfg.min_workers, cfg.max_workers)
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    apply_train_timers(cfg)
    mode = mode_of(cfg)  # the fault-tolerance mode, picked once: its worker half rides in the payload
    elastic = {"elastic_resize_monitor_interval_s": ELASTIC_MONITOR_INTERVAL_S} if cfg.elastic else {}
    invocation = invocation or uuid4().hex
    payload = WorkerPayload(cfg, pipe, Store.of(run_dir), sources, mode.recovery, invocation=invocation)
    return FailFastTrainer(
        summarize_on_raise(train_loop_per_worker),
        train_loop_config={PAYLOAD: payload},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources, **elastic),
        torch_config=mode.torch_config(use_gpu),
        # No `datasets=`: Ray's equal split drops tail rows and keeps no position. The
        # datasets travel in the payload as sources (`raytrain.data.sources`), and each rank
        # reads its own units of a stream.
        run_config=RunConfig(
            name=cfg.name,
            # On an object store Ray Train gets the file system object the driver built (its
            # snapshot and its pruning of old checkpoints go through it): Ray wants the
            # bucket/prefix path beside it, not the URI.
            **Store.of(run_dir).parent.ray_storage(),
            # Node preemptions have their own, unlimited budget: losing a spot node does
            # not use up --max-failures, which is kept for real errors.
            failure_config=FailureConfig(max_failures=cfg.max_failures, max_preemption_failures=-1),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
            logging_config=LoggingConfig(log_level="INFO" if cfg.verbose else "ERROR"),
            worker_runtime_env={
                "env_vars": {**WORKER_ENV, **nccl_env(mode), **_passed_on(RETRY_ENV, *INTERFACE_VARIABLES)}
            },
            callbacks=list(callbacks),
        ),
        mode=mode,
        run_dir=run_dir,
        evict_key=run_key(cfg.storage, cfg.name, invocation),
    )
