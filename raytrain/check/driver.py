"""The check's driver: the configuration both sides share, one Ray Train run of N workers
(rank 0 takes the 1-worker reference first: `raytrain.check.worker`), then the comparison,
the table and the verdict (`raytrain.check.verdict`).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Callable

from raytrain import fields
from raytrain.check.options import CheckOptions
from raytrain.check.verdict import Comparison, Verdict, compare, horizon_of, table_rows, tolerance_for
from raytrain.check.worker import PAYLOAD, CheckPayload, Outcome, check_loop_per_worker
from raytrain.config import TrainConfig
from raytrain.config.checks import parse_workers
from raytrain.errors import ConfigError, RunFailed, find_user_error
from raytrain.observe.render import text_table
from raytrain.pipeline import Pipeline, load_pipeline
from raytrain.rules.attempt import describe_plan
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.schedule import run_schedule
from raytrain.text import plural


def check_configs(pipe: Pipeline, cfg: TrainConfig, spec: str) -> tuple[TrainConfig, TrainConfig]:
    """(the N-worker run's configuration, the 1-worker reference's): the same global batch
    (a per-worker batch becomes the global batch it makes at N), the same reference batch
    and so the same rate at every step, the same seed; the reference without
    --sync-batchnorm, which one worker does not need."""
    from raytrain.driver.run import resolve_config

    low, high = parse_workers(cfg.workers)
    if low != high or high < 2:
        why = f"got {cfg.workers!r}; raytrain check compares N workers with 1: give N ≥ 2, e.g. --workers 2"
        raise ConfigError([("workers", why)])
    if cfg.fault_tolerance != fields.option(TrainConfig, "fault_tolerance").default:
        why = "raytrain check compares the default DDP run; leave --fault-tolerance out"
        raise ConfigError([("fault_tolerance", why)])
    if cfg.global_batch_size is None:
        global_batch = batch_plan_for(cfg, high).global_batch_size
        cfg = dataclasses.replace(cfg, global_batch_size=global_batch, batch_size_per_worker=None)
    run = resolve_config(pipe, cfg, spec)
    # --strategy fsdp compares fsdp at N workers with ddp at 1 (rank 0 by itself holds the whole model).
    return run, dataclasses.replace(run, workers=1, sync_batchnorm=False, strategy="ddp")


def run_check(
    pipeline: "str | Pipeline", cfg: TrainConfig, opts: CheckOptions, echo: Callable[[str], None] = print
) -> Verdict:
    """Train `opts.steps` steps at 1 worker and at N from the same weights over the same rows;
    say whether they agree within the tolerance, and if not from which step and why."""
    from raytrain.data.sources import build_datasets, prepare_datasets
    from raytrain.driver.session import check_embedded_capacity, ray_session, resolve_gpu, will_embed_ray

    pipe = load_pipeline(pipeline)
    spec = pipeline if isinstance(pipeline, str) else pipe.name
    run, reference = check_configs(pipe, cfg, spec)
    tolerance = tolerance_for(run.precision, opts.tolerance)
    if will_embed_ray(run):
        check_embedded_capacity(run, echo=echo)
    started = time.perf_counter()
    with ray_session(run):
        use_gpu = resolve_gpu(run)
        sources = prepare_datasets(build_datasets(pipe, run), run, echo)
        for line in plan_lines(pipe, run, opts, tolerance, sources["train"].rows, use_gpu):
            echo(line)
        outcome = fit_check(pipe, run, reference, sources, opts, tolerance, use_gpu)
    verdict = judge(outcome, tolerance, run.max_workers)
    for line in report_lines(outcome, verdict):
        echo(line)
    echo(f"Checked in {time.perf_counter() - started:.1f} s.")
    return verdict


def plan_lines(
    pipe: Pipeline, run: TrainConfig, opts: CheckOptions, tolerance: float, rows: int, use_gpu: bool
) -> list[str]:
    n = run.max_workers
    plan = batch_plan_for(run, n)
    return [
        f"raytrain check: {pipe.name}, 1 worker against {n} ({'GPU, nccl' if use_gpu else 'CPU, gloo'}): "
        f"{plural(opts.steps, 'step')} from the same initial weights over the same rows (seed {run.seed})",
        f"{n} workers: {describe_plan(run, pipe, plan, run_schedule(run, plan, rows), 'nccl' if use_gpu else 'gloo')}",
        f"1 worker: global {plan.global_batch_size} in one share, the same rate at every step; "
        f"{run.precision}, tolerance {tolerance:.0e} relative per step"
        + (" (TF32 off)" if use_gpu and run.precision == "fp32" else ""),
    ]


def fit_check(
    pipe: Pipeline,
    run: TrainConfig,
    reference: TrainConfig,
    sources: dict,
    opts: CheckOptions,
    tolerance: float,
    use_gpu: bool,
) -> Outcome:
    """One Ray Train run of N workers; rank 0's Outcome. An error in the pipeline's code or data
    is raised as such (exit 2, never retried); any other failure is RunFailed."""
    from ray.train import LoggingConfig, RunConfig, ScalingConfig

    from raytrain.driver.failfast import FailFastTrainer
    from raytrain.driver.launch import apply_train_timers
    from raytrain.driver.session import WORKER_ENV, ray_logs_dir
    from raytrain.errors import explain_worker_errors, summarize_on_raise
    from raytrain.faults import mode_of

    apply_train_timers(run)
    mode = mode_of(run)  # restart: check_configs refuses the others
    payload = CheckPayload(run, reference, pipe, sources, opts.steps, tolerance)
    resources = {"CPU": run.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    # The check writes no run: Ray Train's own records go to a directory removed after.
    with tempfile.TemporaryDirectory(prefix="raytrain-check-", ignore_cleanup_errors=True) as storage:
        trainer = FailFastTrainer(
            summarize_on_raise(check_loop_per_worker),
            train_loop_config={PAYLOAD: payload},
            scaling_config=ScalingConfig(num_workers=run.max_workers, use_gpu=use_gpu, resources_per_worker=resources),
            torch_config=mode.torch_config(use_gpu),
            run_config=RunConfig(
                name="check",
                storage_path=storage,
                logging_config=LoggingConfig(log_level="INFO" if run.verbose else "ERROR"),
                worker_runtime_env={"env_vars": dict(WORKER_ENV)},
            ),
            mode=mode,
        )
        try:
            result = trainer.fit()
        except Exception as exc:  # Ray wraps worker errors
            fault = find_user_error(exc)
            if fault is not None:
                raise fault from None
            lines = explain_worker_errors(exc)
            logs = ray_logs_dir() or "/tmp/ray/session_latest/logs"
            raise RunFailed(
                f"The check failed: {lines[0]}\n"
                + "".join(f"  {line}\n" for line in lines[1:])
                + f"Full worker logs: {logs} (worker-*.err); rerun with -v to see Ray's own logs."
            ) from None
    return result.return_value


def judge(outcome: Outcome, tolerance: float, workers: int) -> Verdict:
    """The verdict from rank 0's records: the comparison up to the pipeline's horizon, the
    probes' causes, whether the --sync-batchnorm rerun closed the gap, and the replicas'
    fingerprints."""
    horizon = horizon_of(outcome.reference, outcome.reordered, tolerance)
    comparison = compare(outcome.reference, outcome.run, tolerance, workers, horizon)
    verdict = Verdict(comparison, causes=list(outcome.causes), replicas=outcome.replicas)
    synced = outcome.reruns.get("sync_batchnorm")
    if synced:
        rerun = compare(outcome.reference, synced, tolerance, workers, horizon)
        steps = f"steps 1–{len(rerun.judged_rows)}"
        if rerun.equivalent:
            verdict.confirmed.append(
                f"rerun with --sync-batchnorm on {workers} workers, {steps} agree with 1 worker "
                f"(largest relative difference {rerun.largest.difference:.1e}): the BatchNorm gap closes."
            )
        else:
            verdict.confirmed.append(
                f"rerun with --sync-batchnorm on {workers} workers still differs from step {rerun.first_difference} "
                f"({steps}): BatchNorm is not the only cause."
            )
    return verdict


ROW_BY_ROW = (
    "transform_batch runs one row at a time on both sides, each row's draws seeded by its place in the epoch: "
    "the augmentation does not depend on how the rows are split."
)


def report_lines(outcome: Outcome, verdict: Verdict) -> list[str]:
    """What was neutralized, the side-by-side table (with the replicas' fingerprints), then the verdict."""
    c: Comparison = verdict.comparison
    dropout = (
        f"{plural(outcome.dropout_layers, 'dropout layer')} in evaluation mode on both sides (their masks "
        "legitimately differ with the worker count)"
        if outcome.dropout_layers
        else "no dropout layers (any would be put in evaluation mode: their masks legitimately differ with the "
        "worker count)"
    )
    header, rows = table_rows(c, outcome.reordered, verdict.replicas)
    augmented = [ROW_BY_ROW] if outcome.augmented_row_by_row else []
    legend = (
        "1 vs 1 reordered: the 1-worker run against itself with each step's rows rotated by half (the same math, "
        "summed in another order): how far this pipeline's training amplifies rounding."
    )
    fingerprints = []
    if verdict.replicas is not None and verdict.replicas.compared:
        fingerprints.append(
            f"replica fingerprint: the first 8 hex digits of the fingerprint every one of the {c.workers} workers' "
            "weights and optimizer state had after the step (or the ranks that differ)."
        )
    return [dropout + ".", *augmented, legend, *fingerprints, *text_table(header, rows), *verdict.lines()]
