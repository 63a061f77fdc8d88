"""The trackers a run feeds: TensorBoard event files in the run directory (always), MLflow
(`--mlflow-uri`) and Weights & Biases (`--wandb-project`). Each is a `Sink`
(`raytrain.observe.sinks`); a tracker that fails is dropped with one warning, never failing
the run."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

from raytrain.environ import scoped_env
from raytrain.observe.render import markdown_table
from raytrain.observe.sinks import Sink, number, record_time
from raytrain.rundir import (
    CONFIG,
    EPOCH_LOSS,
    EVENTS,
    METRICS,
    MODEL,
    PLOTS,
    REPORT,
    SUMMARY,
    Event,
    Kind,
    MetricsRow,
    Summary,
)
from raytrain.rundir.storage import Store
from raytrain.text import first_line

# Metrics of a row that are series over steps (the rest are identifiers or flags).
STEP_SERIES = ("loss", "lr", "samples_per_s", "global_batch_size", "world_size")
# Run files logged under run/ when the run ends (MLflow artifacts): model.pt is the plain state dict.
RUN_ARTIFACTS = (MODEL, CONFIG, SUMMARY, METRICS, EVENTS, REPORT)
# The MLflow model's name in its run: runs:/RUN_ID/model.
MLFLOW_MODEL = "model"
# A run on an object store: its TensorBoard files are uploaded at most this often (and at the end).
UPLOAD_INTERVAL_S = 30.0

_WATCHED: list = []  # TensorBoard sinks whose writer threads report to them


def _watch_writer_threads(sink) -> None:
    """tensorboardX writes and flushes in its own thread, where an OSError (a full disk)
    would print a traceback; route such an error to the sink instead, which then fails on
    its next call and is dropped with one warning."""
    if sink not in _WATCHED:
        _WATCHED.append(sink)
    if getattr(threading.excepthook, "_raytrain", False):
        return
    previous = threading.excepthook

    def hook(args):
        if isinstance(args.exc_value, OSError) and "tensorboardX" in type(args.thread).__module__:
            for watched in _WATCHED:
                watched.failed = watched.failed or args.exc_value
            return
        previous(args)

    hook._raytrain = True
    threading.excepthook = hook


def mlflow_store_uri(uri: str) -> str:
    """A directory becomes a file: URI; MLflow 3 refuses file stores unless told, and the
    user asked for one explicitly."""
    if uri.startswith(("/", ".", "~")):
        uri = Path(uri).expanduser().resolve().as_uri()
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def step_scalars(row: MetricsRow) -> dict[str, float]:
    """The scalars of a metrics row, by tracker tag.

    Every row's loss (the mean over the steps since the previous row), rate and plan are
    per-step series under `train/`; the row at an epoch's end adds the epoch's mean loss and
    throughput under `epoch/`; a row with validation figures (every epoch's, and those of
    --eval-every-steps) gives them under `val/`.
    """
    epoch_end = row.epoch_end
    scalars: dict[str, float] = {}
    for key in STEP_SERIES:
        value = number(row.get(key))
        if value is None:
            continue
        if epoch_end and key == "samples_per_s":
            scalars["epoch/samples_per_s"] = value
        else:
            scalars[f"train/{key}"] = value
    if epoch_end:
        if (epoch := number(row.epoch)) is not None:
            scalars["epoch/epoch"] = epoch
        if (epoch_loss := number(row.get(EPOCH_LOSS))) is not None:
            scalars["epoch/train_loss"] = epoch_loss
    for key, value in row.validation.items():
        if (figure := number(value)) is not None:
            scalars[f"val/{key[4:]}"] = figure
    return scalars


class TensorBoardSink(Sink):
    """Event files in the run directory: `tensorboard --logdir RUN_DIR` (or STORAGE, to
    compare runs). Scalars by step; plan, resizes, restarts and the end as text.

    Each attempt after a restore or resize opens a new event file that purges the steps
    after the checkpoint, so TensorBoard shows the curve the run really followed.
    """

    name = "TensorBoard"

    def __init__(self, run_dir: "Path | Store", params: dict[str, str], flush_secs: int = 5):
        self.store = Store.of(run_dir)
        # On an object store the event files are written on this machine and uploaded (they grow
        # by appends, which a store does not have) every UPLOAD_INTERVAL_S and at the end.
        self.run_dir = self.store.local_dir
        self.uploaded = 0.0
        self.params = params
        self.flush_secs = flush_secs
        self.writer = None
        self.files_opened = 0
        self.dirty = False

    def _open(self, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        if self.writer is not None:
            self.writer.close()
        _watch_writer_threads(self)
        self.files_opened += 1
        # Unique per writer: two writers opened within a second would share a file name.
        suffix = f".{os.getpid()}.{self.files_opened:03d}"
        self.writer = SummaryWriter(
            logdir=str(self.run_dir), purge_step=purge_step, flush_secs=self.flush_secs, filename_suffix=suffix
        )
        if self.files_opened == 1:
            table = "\n".join(f"| {key} | {value} |" for key, value in self.params.items())
            self.writer.add_text("config", "| option | value |\n|---|---|\n" + table, 0)
        return self.writer

    def metrics(self, row: MetricsRow) -> None:
        self._raise_if_failed()  # (a dead writer thread would block add_scalar on its full queue)
        writer = self.writer or self._open()
        step = int(row.step)
        walltime = record_time(row) if math.isfinite(record_time(row)) else None
        for tag, value in step_scalars(row).items():
            writer.add_scalar(tag, value, step, walltime=walltime)
        self.dirty = True

    def event(self, event: Event) -> None:
        self._raise_if_failed()
        kind, step = event.kind, int(event.step or 0)
        if kind in Kind.MARKED and event.step is not None:
            self._open(purge_step=step + 1)  # later rows redo the steps after the checkpoint
        writer = self.writer or self._open()
        if kind != Kind.EPOCH:  # epoch lines are the epoch/ and val/ scalars already
            writer.add_text("events", f"**{kind}**: {event.message}", step, walltime=event.time)
            self.dirty = True

    def tick(self) -> None:
        self._raise_if_failed()
        if self.dirty and self.writer is not None:
            self.writer.flush()
            self.dirty = False
            if time.monotonic() - self.uploaded >= UPLOAD_INTERVAL_S:
                self._upload()

    def _upload(self) -> None:
        """The event files, copied to the object store (nothing on a file system)."""
        self.uploaded = time.monotonic()
        self.store.upload_from(self.run_dir, ("events.out.tfevents.*",))

    failed: BaseException | None = None  # set by the writer's own thread (a full disk, say)

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    def abandon(self) -> None:
        """Stop writing after a failure: close what can be closed, and make tensorboardX's
        exit hook a no-op (it would retry the failed flush at interpreter exit)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:
                writer.event_writer._closed = True

    def finish(self, summary: Summary | None, run_dir: Path) -> None:
        self._raise_if_failed()
        if summary is not None:
            writer = self.writer or self._open()
            rows = [(key, value) for key, value in summary.to_json().items() if not isinstance(value, dict)]
            rows += [
                (key, f"{value:.6g}") for key, value in summary.final_metrics.items() if isinstance(value, (int, float))
            ]
            writer.add_text("summary", "\n".join(markdown_table(["", ""], rows)), int(summary.steps or 0))
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self._upload()


class MLflowSink(Sink):
    """One MLflow run per raytrain run: params = the resolved config, per-step metrics
    (the metrics.jsonl names), the final model as an MLflow PyTorch model (`_log_model`), the
    report and run files (model.pt among them) as artifacts under run/.

    `--resume` continues the MLflow run of the same run directory (tag "raytrain.run_dir").
    Any MLflow URI works: a server (http://...), sqlite:///mlflow.db, file:./mlruns.
    `model(weights)` gives the model with the final weights of model.pt, and its input and
    output on an example (or why there are none): `raytrain.observe.tracking.RunTracker.final_model`.
    """

    name = "MLflow"

    def __init__(
        self,
        uri: str,
        experiment: str,
        cfg: Any,
        params: dict[str, str],
        run_dir: Path,
        echo: Callable[[str], None] = print,
        model: Callable[[Path], tuple[Any, Any]] | None = None,
    ):
        uri = mlflow_store_uri(uri)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.echo, self.model = uri, echo, model
        self.run_dir = Store.of(run_dir)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.experiment_id = experiment_id
        self.run_id = self._existing_run(experiment_id) if getattr(cfg, "resume", False) else None
        if self.run_id is None:
            run = self.client.create_run(
                experiment_id, run_name=getattr(cfg, "name", None), tags={"raytrain.run_dir": str(self.run_dir)}
            )
            self.run_id = run.info.run_id
            self._log_params(params)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self.pending: list[Any] = []
        echo(f"MLflow: experiment {experiment!r}, run {self.run_id} at {uri}")

    def _existing_run(self, experiment_id: str) -> str | None:
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`raytrain.run_dir` = '{self.run_dir}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0].info.run_id if runs else None

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value[:6000]) for key, value in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def metrics(self, row: MetricsRow) -> None:
        from mlflow.entities import Metric

        stamp = int((record_time(row) if math.isfinite(record_time(row)) else time.time()) * 1000)
        step = int(row.step)
        for key, value in step_scalars(row).items():
            self.pending.append(Metric(_mlflow_key(key), value, stamp, step))

    def tick(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:1000], self.pending[1000:]
            self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, summary: Summary | None, run_dir: Path) -> None:
        self.tick()
        if summary is None:
            self.client.set_terminated(self.run_id, status="KILLED")
            return
        for key in ("steady_samples_per_s", "wall_time_s", "failures_recovered", "checkpoints_skipped", "samples_seen"):
            if (value := number(summary.get(key))) is not None:
                self.client.log_metric(self.run_id, f"summary/{key}", value)
        self.client.set_tag(self.run_id, "raytrain.world_sizes", " → ".join(map(str, summary.world_sizes)))
        with Store.of(run_dir).local_copy((*RUN_ARTIFACTS, PLOTS)) as local:
            for name in RUN_ARTIFACTS:
                if (local / name).exists():
                    self.client.log_artifact(self.run_id, str(local / name), artifact_path="run")
            if (local / PLOTS).is_dir():
                self.client.log_artifacts(self.run_id, str(local / PLOTS), artifact_path="run/plots")
            if (local / MODEL).exists() and self.model is not None and summary.status == "finished":
                self._log_model(local / MODEL, int(summary.steps or 0))
        self.client.set_terminated(self.run_id, status="FINISHED" if summary.status == "finished" else "FAILED")

    def _log_model(self, weights: Path, step: int) -> None:
        """The model as an MLflow PyTorch model named `model` (`mlflow.pytorch.load_model(
        "runs:/RUN_ID/model")`, ready for the Model Registry), with a signature where the model
        takes one tensor and returns one. A model that cannot be logged is said once."""
        try:
            import mlflow.pytorch
            from mlflow.tracking._tracking_service.utils import _use_tracking_uri

            model, example = self.model(weights)
            signature = tensor_signature(*example) if isinstance(example, tuple) else None
            logged = self.client.create_logged_model(self.experiment_id, MLFLOW_MODEL, source_run_id=self.run_id)
            # log_model reads the process's tracking URI: this run's for the call, the caller's after it.
            with scoped_env({"MLFLOW_TRACKING_URI": self.uri}), _use_tracking_uri(self.uri), log_level("mlflow"):
                mlflow.pytorch.log_model(
                    model,
                    name=MLFLOW_MODEL,
                    model_id=logged.model_id,
                    run_id=self.run_id,
                    step=step,
                    signature=signature,
                    input_example=example[0] if signature else None,
                    serialization_format="pickle",  # any model, loaded back as its own class
                    pip_requirements=mlflow.pytorch.get_default_pip_requirements(),  # inferring them takes seconds
                )
        except Exception as exc:
            self.echo(
                f"MLflow: the model is only the state dict run/model.pt; it could not be logged: {first_line(exc)}"
            )
            return
        said = f"signature {signature.inputs} -> {signature.outputs}" if signature else f"no signature: {example}"
        self.echo(f"MLflow: the model is runs:/{self.run_id}/{MLFLOW_MODEL} ({said})")


def tensor_signature(inputs: Any, outputs: Any) -> Any:
    """A tensor signature, any number of rows (`mlflow.models.infer_signature` needs scipy,
    which mlflow-skinny lacks)."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    def spec(array: Any) -> Any:
        return Schema([TensorSpec(array.dtype, (-1, *array.shape[1:]))])

    return ModelSignature(inputs=spec(inputs), outputs=spec(outputs))


@contextlib.contextmanager
def log_level(logger: str, level: int = logging.ERROR):
    """`logger` at `level` for a block, then as it was: MLflow's advice (pickle, a local torch
    version) and Ray Data's progress are not the user's."""
    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


def _mlflow_key(tag: str) -> str:
    """MLflow keys as in metrics.jsonl: train/loss -> loss, val/accuracy -> val_accuracy."""
    group, name = tag.split("/", 1)
    return {"train": name, "val": f"val_{name}", "epoch": f"epoch_{name}" if name != "epoch" else "epoch"}[group]


class WandbSink(Sink):
    """A W&B run (`--wandb-project`); the id derives from the run directory, so `--resume`
    continues it. Offline runs (WANDB_MODE=offline) land in RUN_DIR/wandb."""

    name = "Weights & Biases"

    def __init__(self, project: str, cfg: Any, params: dict[str, str], run_dir: Path):
        import wandb

        self.wandb = wandb
        self.run_dir = Store.of(run_dir)
        name = getattr(cfg, "name", None) or self.run_dir.name
        run_id = (
            re.sub(r"[^A-Za-z0-9_-]", "-", name)[:48] + "-" + hashlib.sha1(str(self.run_dir).encode()).hexdigest()[:8]
        )
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir.local_dir),
            config=params,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.last_step = -1
        self.events: list[list[Any]] = []

    def metrics(self, row: MetricsRow) -> None:
        step = int(row.step)
        if step < self.last_step:
            return  # W&B keeps steps increasing: steps redone after a restart are dropped
        self.last_step = step
        self.run.log(step_scalars(row), step=step)

    def event(self, event: Event) -> None:
        if event.kind != Kind.EPOCH:
            self.events.append([event.time, event.kind, event.step, event.message])

    def finish(self, summary: Summary | None, run_dir: Path) -> None:
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.to_json().items() if isinstance(v, (int, float, str))})
            if self.events:
                self.run.log(
                    {"events": self.wandb.Table(columns=["time", "kind", "step", "message"], data=self.events)}
                )
            with Store.of(run_dir).local_copy((MODEL,)) as local:
                if (local / MODEL).exists():
                    artifact = self.wandb.Artifact(
                        re.sub(r"[^A-Za-z0-9_.-]", "-", self.run.name or "model") + "-model", type="model"
                    )
                    artifact.add_file(str(local / MODEL))
                    self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if summary and summary.status == "finished" else 1)
