"""Driver-side observability of one run (`RunTracker`): the console and the trackers
(TensorBoard always, MLflow with --mlflow-uri, Weights & Biases with --wandb-project) fed by
the follower of `raytrain.observe.sinks`, then closed and the report written. Tracking never
fails a run: a sink that raises is dropped with one warning.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from raytrain import hooks
from raytrain.environ import scoped_env
from raytrain.errors import ConfigError
from raytrain.fields import flag_name
from raytrain.observe.render import flatten
from raytrain.observe.sinks import Dispatcher, Sink, follow
from raytrain.observe.trackers import MLflowSink, TensorBoardSink, WandbSink, mlflow_store_uri
from raytrain.rundir import RunDir, Store, Summary
from raytrain.text import first_line


@dataclass(frozen=True)
class TrackingOptions:
    """The tracking knobs of a run, read from the config (fields may be absent)."""

    mlflow_uri: str | None = None
    mlflow_experiment: str = "raytrain"
    wandb_project: str | None = None
    progress: str = "auto"  # auto (bar on a terminal, lines elsewhere), bar, plain, off
    progress_interval_s: float = 10.0  # between plain progress lines
    report: bool = True  # write report.md and plots/ when the run ends

    @classmethod
    def from_config(cls, cfg: Any) -> "TrackingOptions":
        return cls(
            mlflow_uri=getattr(cfg, "mlflow_uri", None) or None,
            mlflow_experiment=getattr(cfg, "mlflow_experiment", None) or "raytrain",
            wandb_project=getattr(cfg, "wandb_project", None) or None,
            progress=getattr(cfg, "progress", None) or "auto",
            progress_interval_s=float(getattr(cfg, "progress_interval_s", None) or 10.0),
        )


class RunTracker:
    """Everything observability does for one `fit`: sinks opened before training, rows
    fed while it runs, trackers closed and the report written when it ends.

        tracker = RunTracker(cfg, run_dir, pipeline_name, echo=print, progress=True, pipeline=pipe)
        with tracker.follow(since=time.time(), train_rows=rows, example=source.sample):
            trainer.fit()
        tracker.finish(summary)

    Construction checks that the asked-for trackers are installed (ConfigError if not),
    so a missing extra is reported before Ray starts. `pipeline` (and one `example` row of
    the run's data) let MLflow log the final model as a model (`final_model`).
    """

    def __init__(
        self,
        cfg: Any,
        run_dir: "Path | Store",
        pipeline_name: str,
        *,
        echo: Callable[[str], None] | None = None,
        progress: bool = False,
        options: TrackingOptions | None = None,
        stream: Any = None,
        pipeline: Any = None,
    ):
        self.cfg = cfg
        self.pipeline = pipeline
        self.example: dict[str, Any] | None = None
        self.run_dir = Store.of(run_dir)
        self.pipeline_name = pipeline_name
        self.echo = echo or (lambda line: None)
        self.options = options or TrackingOptions.from_config(cfg)
        self.progress = progress
        self.stream = stream
        self.dispatcher = Dispatcher([], warn=self.echo)
        self._finished = False
        check_installed(self.options)
        if self.options.mlflow_uri:
            check_mlflow_uri(self.options.mlflow_uri)

    def open_sinks(self, train_rows: int | None = None) -> list[Sink]:
        from raytrain.observe.console import Console

        # config.yaml when written: it says what ran (a pipeline's own optimizer, not --optimizer's default)
        recorded = {k: v for k, v in RunDir(self.run_dir).config().items() if k != "pipeline"}
        params = config_params(recorded or self.cfg, self.pipeline_name, self.run_dir)
        mode = self.options.progress if self.progress else "off"
        if mode in ("auto", "bar") and getattr(self.cfg, "verbose", False):
            mode = "plain"  # with -v Ray's worker logs share the console: no bar to break
        sinks: list[Sink] = [
            Console(
                self.echo,
                epochs=getattr(self.cfg, "epochs", 0),
                max_steps=getattr(self.cfg, "max_steps", None),
                train_rows=train_rows,
                mode=mode,
                interval_s=self.options.progress_interval_s,
                stream=self.stream,
            ),
            TensorBoardSink(self.run_dir, params),
        ]
        if self.options.mlflow_uri:
            model = self.final_model if self.pipeline is not None else None
            mlflow = (self.options.mlflow_uri, self.options.mlflow_experiment, self.cfg, params, self.run_dir)
            self._start(sinks, "MLflow", lambda: MLflowSink(*mlflow, echo=self.echo, model=model))
        if self.options.wandb_project:
            self._start(
                sinks, "Weights & Biases", lambda: WandbSink(self.options.wandb_project, self.cfg, params, self.run_dir)
            )
        return sinks

    def _start(self, sinks: list[Sink], tracker: str, make: Callable[[], Sink]) -> None:
        """Training goes on when a tracker cannot start (server down, not logged in): one warning."""
        try:
            sinks.append(make())
        except Exception as exc:
            self.echo(f"raytrain: {tracker} could not start a run, training without it: {first_line(exc)}")

    def final_model(self, weights: Path) -> tuple[Any, "tuple[Any, Any] | str"]:
        """The pipeline's model with `weights` (the run's model.pt) loaded strictly, in eval mode,
        and its input and output on the example row (or why there are none: `example_io`)."""
        from raytrain.rundir.checkpoints import load_model_weights

        model = hooks.call(self.pipeline, "build_model", self.cfg)
        model.load_state_dict(load_model_weights(str(weights)), strict=True)
        model.eval()
        return model, example_io(self.pipeline, model, self.example)

    @contextlib.contextmanager
    def follow(
        self,
        since: float,
        train_rows: int | None = None,
        also: Sequence[Sink] = (),
        example: dict[str, Any] | None = None,
    ) -> Iterator[None]:
        """Send the run's records to the console and trackers (and `also`'s sinks) while the body
        runs. `example`: one row of the run's data (`raytrain.data.sources.MemorySource.sample`)."""
        self.example = example
        self.dispatcher.sinks = [*self.open_sinks(train_rows=train_rows if self.progress else None), *also]
        self.dispatcher.warn = self.dispatcher.sinks[0].write  # the console: above the bar, if any
        try:
            with follow(self.run_dir, self.dispatcher, since=since):
                yield
        except BaseException:
            self.dispatcher.send("stop")
            self.finish(None)
            raise
        self.dispatcher.send("stop")

    def finish(self, summary: Summary | None) -> None:
        """Close the trackers (MLflow gets the model and the report) once summary.json exists."""
        if self._finished:
            return
        self._finished = True
        if summary is not None and self.options.report:
            try:
                from raytrain.observe.report import write_report

                write_report(self.run_dir)
            except Exception as exc:  # a plot must never turn a finished run into a failed one
                self.echo(f"raytrain: could not write the report: {first_line(exc)}")
        self.dispatcher.send("finish", summary, self.run_dir)


def check_installed(options: TrackingOptions, importable: Callable[[str], bool] | None = None) -> None:
    """ConfigError naming the fix when a tracker is asked for but not installed."""
    importable = importable or _importable
    missing = {  # option: (its package, what it is, how to install it)
        "mlflow_uri": ("mlflow", "MLflow", "pip install 'raytrain[mlflow]' (or pip install mlflow)"),
        "wandb_project": ("wandb", "Weights & Biases", "pip install wandb (then wandb login)"),
    }
    problems = [
        (name, f"got {value!r}, but {what} is not installed; install it with {how}, or drop {flag_name(name)}")
        for name, (package, what, how) in missing.items()
        if (value := getattr(options, name)) and not importable(package)
    ]
    if options.progress not in ("auto", "bar", "plain", "off"):
        problems.append(("progress", f"got {options.progress!r}; choose one of auto, bar, plain, off"))
    if problems:
        raise ConfigError(problems)


def check_mlflow_uri(uri: str) -> None:
    """Reach the tracking store before anything starts: a typo is a usage error (exit 2)."""
    from mlflow.tracking import MlflowClient

    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}  # not minutes of retries
    try:
        with scoped_env(quick):
            MlflowClient(tracking_uri=mlflow_store_uri(uri)).search_experiments(max_results=1)
    except Exception as exc:
        why = f"got {uri!r}, but MLflow cannot use it: {first_line(exc)}"
        fix = "give a server (http://HOST:5000), sqlite:///mlflow.db or a directory"
        raise ConfigError([("mlflow_uri", f"{why}; {fix}")]) from None


def example_io(pipeline: Any, model: Any, rows: dict[str, Any] | None) -> "tuple[Any, Any] | str":
    """(input, output) as arrays of the model's first call in the pipeline's compute_loss on
    `rows`, when it takes one tensor and returns one (what a tensor signature describes); else
    why not, in words."""
    import numpy as np
    import torch

    if not rows:
        return "the run's data gave no example row"
    calls: list[tuple] = []
    handle = model.register_forward_hook(
        lambda _, args, kwargs, out: calls.append((args, kwargs, out)), with_kwargs=True
    )
    try:
        with torch.no_grad():
            hooks.call(pipeline, "compute_loss", model, {k: torch.from_numpy(np.array(v)) for k, v in rows.items()})
    except Exception as exc:
        return f"compute_loss failed on an example row: {first_line(exc)}"
    finally:
        handle.remove()
    if not calls:
        return "compute_loss did not call the model"
    args, kwargs, output = calls[0]
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return "the model takes other than one tensor"
    if not isinstance(output, torch.Tensor):
        return f"the model returns a {type(output).__name__}, not a tensor"
    arrays = [(t.float() if t.dtype == torch.bfloat16 else t).numpy() for t in (args[0], output)]  # numpy has no bf16
    return arrays[0], arrays[1]


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def config_params(cfg: Any, pipeline_name: str, run_dir: Path) -> dict[str, str]:
    """The resolved configuration, flattened (`ddp.bucket_cap_mb`), as tracker params."""
    values = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    flat = {key: "" if value is None else str(value) for key, value in flatten(values).items()}
    return {"pipeline": str(pipeline_name), "run_dir": str(run_dir), **flat}
