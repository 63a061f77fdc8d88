"""The driver: one run, from the resolved configuration to the run files.

`fit` reads as the run goes: resolve the configuration, claim the run directory, start or
join Ray, prepare the datasets, check a resume, write config.yaml, fit Ray Train's
TorchTrainer (`raytrain.driver.launch`) while the run's records are followed
(`raytrain.observe`), then write summary.json and say how it ended. The per-worker
function is `raytrain.worker.loop`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from uuid import uuid4

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.sources import Source, StreamSource, build_datasets, prepare_datasets
from raytrain.driver import interrupts
from raytrain.driver.launch import build_torch_trainer
from raytrain.driver.session import (
    check_embedded_capacity,
    note_slow_node_death,
    ray_logs_dir,
    ray_session,
    resolve_gpu,
    will_embed_ray,
)
from raytrain.driver.summary import explain_failure, write_summary
from raytrain.errors import ConfigError, RunFailed, find_user_error
from raytrain.observe.tracking import RunTracker
from raytrain.parallel.strategy import check_compiler
from raytrain.pipeline import Pipeline, dated_name, load_pipeline, overrides, set_plan
from raytrain.rules import batch, resume
from raytrain.rundir import RunDir, Store, StoredRun, checkpoints, claimed, strict
from raytrain.rundir.checkpoints import forget_missing, model_shapes


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

    Raises ConfigError (bad configuration, nothing started), another UserError (bad data,
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
    echo = echo or (lambda line: None)
    embedded = will_embed_ray(cfg)
    if embedded:  # before anything is written or started
        from raytrain.worker.network import check_host_interfaces

        check_embedded_capacity(cfg, echo=echo)
        check_host_interfaces()  # its workers are this host's and inherit this environment
    invocation = uuid4().hex  # this run of the driver: the lock names it, and its workers check it does
    with claimed(Store.of(cfg.storage) / cfg.name, owner=invocation, echo=echo) as run_dir:
        stored = check_run_dir(run_dir, cfg, spec, replaced_options(pipe))
        tracker = RunTracker(cfg, run_dir, spec, echo=echo, progress=progress, pipeline=pipe)
        with ray_session(cfg), interrupts.stop_on_signals(run_dir, echo) as stop:
            use_gpu, ray_logs = resolve_gpu(cfg), ray_logs_dir()
            if cfg.compile and embedded:  # the workers are this machine: a missing compiler fails now
                check_compiler("cuda" if use_gpu else "cpu")
            show_planned_plan(cfg)  # what build_datasets sees of the plan (raytrain.context())
            sources = prepare_datasets(build_datasets(pipe, cfg), cfg, echo)
            check_validation_set(cfg, sources)
            if stored is not None:
                check_resume(pipe, cfg, stored, sources, echo)
            RunDir(run_dir).write_config(config_as_run(pipe, cfg, spec, use_gpu))
            trainer = build_torch_trainer(pipe, cfg, run_dir, sources, use_gpu, callbacks, invocation)
            echo(
                f"raytrain: {cfg.name} — {pipe.name} on {describe_workers(cfg)} "
                f"({'GPU, nccl' if use_gpu else 'CPU, gloo'}); run directory {run_dir}"
            )
            if not embedded:  # an embedded Ray has raytrain's health checks
                note_slow_node_death(echo)
            started, ends = time.time(), interrupts.EndsWhenDone(echo)
            example = sources.get("val", sources["train"]).sample  # a tracker's example of the model's input
            with tracker.follow(since=started, train_rows=sources["train"].rows, also=[ends], example=example):
                try:
                    result, error = trainer.fit(), None
                except Exception as exc:  # Ray wraps worker errors; re-raised below
                    result, error = None, exc
            ends.cancel()
            if ends.ended:  # training had finished: only its controller was ended
                result, error = None, None
        summary = write_summary(
            run_dir, cfg, result, error, started, interrupted=stop.signal, stop_requested_at=stop.requested_at
        )
        if summary.extra.get("summary_error"):
            echo(f"raytrain: summary.json not written: {summary.extra['summary_error']}")
        tracker.finish(summary)
    if stop.signal and summary.status != "finished":
        raise interrupts.Interrupted(stop.signal, run_dir, cfg, spec)
    if stop.signal:
        echo("raytrain: the run had finished when the signal came; nothing is left to resume")
    if error is not None:
        fault = find_user_error(error)
        if fault is not None:  # bad data, configuration, pipeline code or storage, or divergence: the user's to fix
            raise fault from None
        raise RunFailed(explain_failure(error, run_dir, ray_logs)) from None
    return FitResult(
        metrics=summary.final_metrics,
        checkpoint_path=summary.best_checkpoint,
        run_dir=run_dir.public_uri,
        summary=strict(summary.to_json()),
        model_path=summary.model_path,
    )


def resolve_config(pipe: Pipeline, cfg: TrainConfig, pipeline_name: str) -> TrainConfig:
    """Fill what depends on the run as a whole: the name, and the reference batch frozen once."""
    changes: dict[str, Any] = {}
    if cfg.name is None:
        changes["name"] = dated_name(pipeline_name)
    if cfg.reference_batch_size is None:
        changes["reference_batch_size"] = batch.default_reference_batch_size(
            max(1, cfg.max_workers),
            global_batch_size=cfg.global_batch_size,
            batch_size_per_worker=cfg.batch_size_per_worker,
        )
    return dataclasses.replace(cfg, **changes) if changes else cfg


def show_planned_plan(cfg: TrainConfig) -> None:
    """The plan at the largest worker count, in `raytrain.context()` for build_datasets."""
    set_plan(batch.batch_plan_for(cfg, max(1, cfg.max_workers)), cfg, total_steps=None)


def check_validation_set(cfg: TrainConfig, sources: dict[str, Source]) -> None:
    """Options that need a validation set, against the datasets the pipeline built."""
    if "val" in sources:
        return
    asked = [name for name in ("eval_every_steps", "eval_batches") if getattr(cfg, name) is not None]
    why = (
        "but the pipeline's build_datasets returns no 'val' dataset to validate on; return one, or leave the option out"
    )
    if asked:
        raise ConfigError([(name, f"got {getattr(cfg, name)}, {why}") for name in asked])


def replaced_options(pipe: Pipeline) -> list[str]:
    """The pipeline's hooks that replace options (its own build_optimizer, lr_factor)."""
    return [hook for hook in resume.HOOK_FIELDS if overrides(pipe, hook)]


def config_as_run(pipe: Pipeline, cfg: TrainConfig, spec: str, use_gpu: bool) -> dict[str, Any]:
    """config.yaml: the resolved configuration as it runs — an option a pipeline hook replaces
    names the hook (rank 0 adds what the optimizer is once it is built)."""
    return resume.recorded_config({**cfg.to_dict(), "pipeline": spec, "gpu": use_gpu}, replaced_options(pipe))


def check_run_dir(run_dir: Store, cfg: TrainConfig, spec: str, hooks: Sequence[str] = ()) -> StoredRun | None:
    """A new run needs a new name; a resume needs the run, and options it can honour
    (`raytrain.rules.resume`; `hooks`: the pipeline's hooks that replace options). Returns what
    the run directory holds, for a resume."""
    problems = resume.run_dir_problems(cfg.name, str(run_dir.parent), cfg.resume, RunDir(run_dir).has_run())
    if problems:
        raise ConfigError(problems)
    if not cfg.resume:
        return None
    stored = RunDir(run_dir).stored_run()
    _, refused = resume.changes(stored, cfg.to_dict(), spec, hooks)
    if refused:
        raise ConfigError(refused)
    resume.check_readable(stored)
    return stored


def check_resume(
    pipe: Pipeline, cfg: TrainConfig, stored: StoredRun, sources: dict[str, Source], echo: Callable[[str], None]
) -> None:
    """Before anything is written: the pipeline's model must load the checkpoint, and an
    epoch half done must continue on the same data; then say what the resume changes. A
    checkpoint pruned before it was read (an earlier attempt's workers still writing) is chosen
    again (`raytrain.rules.resume.read_chosen`). Ray's record of checkpoints that are gone is set
    aside (`checkpoints.forget_missing`)."""
    if stored.checkpoint is not None:
        stored, shapes = resume.read_chosen(
            stored,
            lambda run: model_shapes(run.checkpoint) if run.checkpoint is not None else {},
            lambda run: run.checkpoint is not None and checkpoints.gone(run.checkpoint),
            RunDir(stored.run_dir).stored_run,
        )
        resume.check_readable(stored)
    if stored.checkpoint is not None:
        resume.check_model_fits(shapes, hooks.call(pipe, "build_model", cfg), stored.checkpoint.name)
        train = sources["train"]
        if isinstance(train, StreamSource):  # in memory: checked on the workers, which read the table
            before = stored.position.get("data") or {}
            resume.check_same_data(before, train.layout.digest(), stored.position.get("step", 0), stored.mid_epoch)
    changed, _ = resume.changes(stored, cfg.to_dict(), stored.pipeline or "", replaced_options(pipe))
    echo(resume.resume_line(cfg.name, stored, changed))
    gone = forget_missing(stored.run_dir)
    if gone:
        echo(resume.forgotten_line(gone))


def describe_workers(cfg: TrainConfig) -> str:
    if cfg.max_workers == 0:
        return "this process (local mode)"
    if cfg.elastic:
        return f"{cfg.min_workers}–{cfg.max_workers} workers (elastic)"
    return f"{cfg.max_workers} worker{'s' if cfg.max_workers != 1 else ''}"
