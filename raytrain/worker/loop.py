"""The per-worker training function: restore → build → loop → report.

Ray Train calls `train_loop_per_worker` once per attempt: at the start, after every
failure and after every resize. Resume is the only way in: a fresh run is "no
checkpoint". The batch plan and the learning rate are re-derived from the rules
(`raytrain.rules`) at every attempt, for the world size this attempt has.

`raytrain.worker.epoch.Training` owns one attempt: its recovery object (`raytrain.faults.restart`:
the fault-tolerance mode, and the runtime), run files, data, position, the step machinery
(`raytrain.worker.step`) and the checkpoints (`raytrain.worker.checkpointer`). Its one loop
runs epochs, whatever the mode.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable

from raytrain.config import TrainConfig
from raytrain.data.sources import Source
from raytrain.errors import NOT_RETRIED, find_error, find_user_error
from raytrain.parallel.device import device_failure
from raytrain.pipeline import Pipeline
from raytrain.rules.budget import Budget
from raytrain.rules.stall import diagnose
from raytrain.rundir.heartbeats import Heartbeat, read_heartbeats
from raytrain.rundir.records import HEARTBEATS
from raytrain.rundir.storage import Store
from raytrain.rundir.writer import RunWriter
from raytrain.worker.checkpointer import Checkpointer
from raytrain.worker.epoch import Training
from raytrain.worker.runtime import Runtime


@dataclass(frozen=True)
class WorkerPayload:
    """What the driver hands every worker (Ray Train's `train_loop_config`, under `PAYLOAD`)."""

    config: TrainConfig
    pipeline: Pipeline
    run_dir: Store  # a local directory or an object store's prefix
    sources: dict[str, Source]  # "train", optional "val"
    # The fault-tolerance mode's worker half (`raytrain.faults`): its recovery class, called
    # (cfg, run_dir, invocation=...) where the worker starts, as Ray passes `backend_cls`.
    recovery: Callable[..., Any]
    invocation: str = ""  # this run of the driver: an attempt that restores its own checkpoint follows a failure


PAYLOAD = "raytrain"
# When a run ends on the user's error, how long a rank waits for its checkpoint being written.
FINISH_ON_ERROR_S = 60.0


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    payload: WorkerPayload = loop_config[PAYLOAD]
    cfg, run_dir = payload.config, Store.of(payload.run_dir)
    recovery = payload.recovery(cfg, run_dir, invocation=payload.invocation)
    runtime = recovery.runtime
    files = RunWriter(run_dir, enabled=runtime.is_rank0, driver=payload.invocation)
    heartbeat = Heartbeat(run_dir.local_dir / HEARTBEATS, runtime.world_rank, enabled=runtime.world_size > 1)
    checkpointer = Checkpointer(cfg, recovery, run_dir, files, invocation=payload.invocation)
    try:
        files.driver.check()  # an attempt its ended driver's controller restarted: before it writes a file
        if recovery.open(files, Budget.of(cfg)):
            Training.begin(cfg, payload.pipeline, recovery, files, heartbeat, payload.sources, checkpointer).run()
    except Exception as exc:
        # A device's failure outside a step's phases (an assert shows at the host's next wait on
        # the GPU: the loss sync, a checkpoint's copy), as the user's too.
        failure = None if find_user_error(exc) else device_failure(exc, runtime.world_rank, "training", runtime.device)
        if failure is not None:
            raise failure from exc
        if runtime.world_size > 1 and looks_like_timeout(exc):
            raise StallError(explain_stall(cfg, runtime, heartbeat, run_dir, exc)) from exc
        if find_error(exc, NOT_RETRIED) is not None:
            # The run ends here (never retried): the checkpoint being written holds a good step
            # (it passed its replica check), so let it complete, and --resume loses nothing more.
            with contextlib.suppress(Exception):
                checkpointer.finish(timeout_s=FINISH_ON_ERROR_S)
        raise
    finally:
        heartbeat.stop()
        files.close()
        recovery.close()


class StallError(RuntimeError):
    """A collective timed out; the message names the stalled rank(s) and where each rank was."""


def explain_stall(cfg: TrainConfig, runtime: Runtime, heartbeat: Heartbeat, run_dir: Store, exc: Exception) -> str:
    heartbeat.write()
    records = read_heartbeats(run_dir.local_dir / HEARTBEATS, runtime.world_size, since=heartbeat.attempt_start)
    cause = str(exc).splitlines()[0] if str(exc) else ""
    return (
        f"A collective timed out on rank {runtime.world_rank} after --collective-timeout-s "
        f"{cfg.collective_timeout_s:g}; "
        f"{diagnose(records, runtime.world_size, time.time())}\n  cause: {type(exc).__name__}: {cause}"
    )


def looks_like_timeout(exc: BaseException) -> bool:
    """A collective that gave up waiting (gloo's and NCCL's say so in words only: torch 2.13
    has no timeout type)."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "timeout" in text or "timed out" in text
