"""How a run ended, in its files and in one paragraph: `summary.json`, and the explanation of
a failure (which rank raised what, where in the user's code, and where the logs are)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from raytrain.config import TrainConfig
from raytrain.errors import NOT_RETRIED, StorageError, explain_worker_errors, find_error
from raytrain.rules import flops
from raytrain.rules.accounting import account
from raytrain.rules.attempt import tally
from raytrain.rules.budget import Budget
from raytrain.rundir import EPOCH_LOSS, MODEL, MetricsRow, RunDir, Summary
from raytrain.rundir.checkpoints import checkpoint_dirs
from raytrain.rundir.storage import Store
from raytrain.text import first_line, is_number


def write_summary(
    run_dir: Any,
    cfg: TrainConfig,
    result: Any,
    error: Exception | None,
    started: float,
    *,
    interrupted: int = 0,
    stop_requested_at: float | None = None,
    status: str | None = None,
) -> Summary:
    """summary.json (strict JSON, written atomically) from the run files: the whole run across
    resumes (its position, its final figures, its wall time summed over the invocations that
    trained it), the status and error of this invocation; returns it (with `summary_error` in
    `extra` when it could not be written)."""
    files = RunDir(run_dir)
    progress = files.progress()
    if progress is not None and progress.time < started:  # left by an earlier invocation
        progress = None
    rows = files.metrics()
    last = rows[-1] if rows else None
    final_metrics, window = final_figures(rows)
    earlier = files.summary()  # an earlier invocation's (the run resumed since): its time counts too
    fault = find_error(error, NOT_RETRIED)  # its sentence is the error, not a wrapper's first line
    if status is None:
        # A signal that came after the last epoch's model was written stopped nothing.
        done = (
            progress is not None
            and progress.status == "finished"
            and Budget.of(cfg).done(progress.epoch, progress.step)
        )
        status = _status(error, fault, interrupted and not (done and error is None))
    has_model = files.has(MODEL)
    at = progress or last
    events = files.events(since=started - 1)
    counts = tally(events, interrupted=bool(interrupted), stop_requested_at=stop_requested_at)
    wall_time_s = round(time.time() - started + (earlier.wall_time_s or 0.0 if earlier else 0.0), 3)
    summary = Summary(
        status=status,
        epochs=at.epoch if at else 0,
        steps=at.step if at else 0,
        samples_seen=at.samples_seen if at else 0,
        wall_time_s=wall_time_s,
        steady_samples_per_s=progress.steady_samples_per_s if progress else None,
        steady_steps=progress.steady_steps if progress else None,
        world_sizes=(progress.world_sizes if progress else None)
        or sorted({row.world_size for row in rows if row.world_size}),
        failures_recovered=counts.failures_recovered,
        preemptions=counts.preemptions,
        resumes=counts.resumes,
        interruptions=counts.interruptions,
        checkpoints_skipped=counts.checkpoints_skipped,
        final_metrics=final_metrics,
        final_loss_steps=window,
        starts=(earlier.starts if earlier else 0) + 1,
        best_checkpoint=_best_checkpoint(result, run_dir),
        model_path=(files.store / MODEL).public_uri if has_model and status == "finished" else None,
        error=None if error is None else first_line(str(fault if fault is not None else error)) or type(error).__name__,
    )
    prior = earlier.goodput if earlier else None
    goodput = account(wall_s=wall_time_s, started=started, events=events, rows=rows, progress=progress, earlier=prior)
    summary.goodput = goodput.to_json() if goodput is not None else None
    if cfg.compile:
        graphs = progress.get("compile_graphs") if progress else None
        seconds = progress.get("compile_s") if progress else None
        summary.compile = {"compiled": bool(graphs) and min(graphs) > 0, "graphs": graphs, "seconds": seconds}
    cost = _cost(progress, cfg)
    if cost is not None:
        summary.extra["cost"] = cost
    if progress is not None and progress.get("checkpoints"):
        # the loop's mean wait per checkpoint (its files are written while training goes on)
        wait_s = progress.get("checkpoint_wait_s", 0.0) / progress.get("checkpoints")
        summary.extra["checkpoint_wait_s"] = round(wait_s, 4)
    try:
        files.write_summary(summary)
    except StorageError as exc:  # a full disk must not hide the run's own error
        summary.extra["summary_error"] = str(exc)
    return summary


def _cost(progress: Any, cfg: TrainConfig) -> dict[str, Any] | None:
    """The cost view of the run's steady throughput (`raytrain.rules.flops`), on the last worker count."""
    if progress is None or not progress.world_sizes:
        return None
    figures = progress.get("flops_per_sample"), progress.steady_samples_per_s, progress.world_sizes[-1]
    return flops.cost_view(*figures, progress.get("device_name") or "", cfg.precision, cfg.peak_tflops)


def final_figures(rows: list[MetricsRow]) -> tuple[dict[str, Any], list[int] | None]:
    """summary.json's final metrics from the whole run's rows, each what its name says: `loss`,
    the mean training loss of the last window (the steps since the row before; those steps are
    returned, [first, last]); `epoch_loss`, the mean over the last epoch (so far, when the run
    ended inside one); and the last validation figures."""
    scored = [row for row in rows if is_number(row.loss)]
    if not scored:
        return {}, None
    last = scored[-1]
    before = [row.step for row in rows if row.step < last.step]
    figures: dict[str, Any] = {"loss": last.loss}
    epoch_loss = next((row.get(EPOCH_LOSS) for row in reversed(rows) if is_number(row.get(EPOCH_LOSS))), None)
    if epoch_loss is not None:
        figures[EPOCH_LOSS] = epoch_loss
    validated = [row for row in rows if row.validation]
    figures.update(validated[-1].validation if validated else {})
    return figures, [max(before, default=0) + 1, last.step]


def _status(error: Exception | None, fault: Exception | None, interrupted: int) -> str:
    if interrupted:
        return "interrupted"
    if isinstance(fault, FloatingPointError):
        return "diverged"
    return "failed" if error is not None else "finished"


def _best_checkpoint(result: Any, run_dir: Any) -> str | None:
    """A path, or on an object store the checkpoint's URI."""
    store = Store.of(run_dir)
    if result is not None:
        best = None
        with contextlib.suppress(Exception):
            best = result.get_best_checkpoint(metric="val_loss", mode="min")
        best = best or result.checkpoint
        if best is not None:
            return (store / best.path.rstrip("/").rsplit("/", 1)[-1]).public_uri
    found = checkpoint_dirs(store)
    return Store.of(found[-1]).public_uri if found else None


def explain_failure(error: Exception, run_dir: Any, ray_logs: str | None = None) -> str:
    """Which rank failed with which exception, where in the user's code, then where the logs are."""
    lines = explain_worker_errors(error)
    logs = ray_logs or "/tmp/ray/session_latest/logs"
    return (
        f"The run failed: {lines[0]}\n"
        + "".join(f"  {line}\n" for line in lines[1:])
        + f"Run files: {run_dir} (summary.json, events.jsonl, report.md). "
        f"Full worker logs: {logs} (worker-*.err; train/ for Ray Train), or the Ray dashboard; "
        "rerun with -v to see Ray's own logs."
    )
