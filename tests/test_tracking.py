"""Driver-side tracking: tailing the run files, TensorBoard, MLflow, W&B.

Pure tests feed crafted metrics.jsonl / events.jsonl rows to the tailer and the sinks and
read the results back with the trackers' own readers; one CPU Ray test checks the TensorBoard
files and the report of the digits run it shares with test_train_ray.py (trained through the
command line: tests/conftest.py::digits_two_worker_run).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import raytrain
from pipelines.digits import DigitsPipeline
from raytrain.errors import ConfigError
from raytrain.observe.sinks import Dispatcher, Sink, follow
from raytrain.observe.trackers import MLflowSink, TensorBoardSink, WandbSink, step_scalars
from raytrain.observe.tracking import RunTracker, TrackingOptions, check_installed, config_params, example_io
from raytrain.rundir import Event, MetricsRow, Summary, Tail

T0 = 1_800_000_000.0


def append(path: Path, *rows: dict, newline: bool = True) -> None:
    with open(path, "a") as handle:
        for row in rows:
            handle.write(json.dumps(row if isinstance(row, dict) else row.to_json()) + ("\n" if newline else ""))


def metrics_row(
    step: int, *, epoch: int = 1, loss: float = 1.0, world_size: int = 2, epoch_end: bool = False, **extra
) -> dict:
    row = {
        "epoch": epoch,
        "step": step,
        "samples_seen": step * 64,
        "world_size": world_size,
        "global_batch_size": 32 * world_size,
        "lr": 1e-3 * step,
        "loss": loss,
        "samples_per_s": 1000.0 + step,
        "time_s": T0 + step,
    }
    if epoch_end:
        row["epoch_end"] = True
    return MetricsRow.from_json({**row, **extra})


def event(kind: str, message: str, at: float, **fields) -> Event:
    return Event.from_json({"time": at, "kind": kind, "message": message, **fields})


class Recorder(Sink):
    name = "recorder"

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def event(self, e):
        self.calls.append(("event", e.message))

    def metrics(self, row):
        self.calls.append(("metrics", row.step))

    def progress(self, row):
        self.calls.append(("progress", row["step"]))


# -- tailing -------------------------------------------------------------------------------


def test_tail_returns_new_complete_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = Tail(path)
    assert tail.read() == []  # no file yet
    append(path, {"step": 1}, {"step": 2})
    append(path, {"step": 3}, newline=False)  # rank 0 is mid-write
    assert [row["step"] for row in tail.read()] == [1, 2]
    with open(path, "a") as handle:
        handle.write("\nnot json\n")
    assert [row["step"] for row in tail.read()] == [3]
    assert tail.read() == []


def test_tail_skips_what_was_there_before(tmp_path):
    path = tmp_path / "events.jsonl"
    append(path, {"step": 1})
    tail = Tail(path)
    append(path, {"step": 2})
    assert [row["step"] for row in tail.read()] == [2]


@pytest.mark.parametrize(
    "new_rows",
    [
        [],
        [{"step": 3, "attempt": 2}],
        [{"step": 3, "attempt": 2}, {"step": 4, "attempt": 2}, {"step": 5, "attempt": 2}],
    ],
)
def test_tail_follows_a_rewrite_that_keeps_a_prefix(tmp_path, new_rows):
    """Rank 0 drops the rows after the checkpoint it resumes from, then appends again."""
    path = tmp_path / "metrics.jsonl"
    tail = Tail(path)
    append(path, *[{"step": s} for s in range(1, 6)])
    assert len(tail.read()) == 5
    kept = [json.dumps({"step": s}) + "\n" for s in (1, 2)]
    path.write_text("".join(kept))  # truncated to the checkpoint at step 2
    append(path, *new_rows)
    assert tail.read() == new_rows
    append(path, {"step": 9})
    assert tail.read() == [{"step": 9}]


def test_follow_sends_rows_of_all_files_in_time_order(tmp_path):
    recorder = Recorder()
    since = T0
    append(tmp_path / "events.jsonl", event("plan", "old session", T0 - 100))
    with follow(tmp_path, Dispatcher([recorder], warn=print), since=since, interval_s=0.05) as pump:
        append(tmp_path / "events.jsonl", event("plan", "stale", T0 - 50))  # an earlier driver's row
        append(tmp_path / "events.jsonl", event("plan", "plan", T0 + 0.5), event("epoch", "epoch 1", T0 + 3.5))
        append(tmp_path / "metrics.jsonl", metrics_row(1), metrics_row(3, epoch_end=True))
        append(tmp_path / "live.jsonl", {"time": T0 + 2, "step": 2})
        pump()
    assert recorder.calls == [("event", "plan"), ("metrics", 1), ("progress", 2), ("metrics", 3), ("event", "epoch 1")]


def test_a_failing_sink_is_dropped_with_one_warning_and_the_others_go_on(tmp_path):
    class Broken(Sink):
        name = "Broken tracker"

        def metrics(self, row):
            raise ConnectionError("server gone\nmore detail")

    warnings, recorder = [], Recorder()
    with follow(tmp_path, Dispatcher([Broken(), recorder], warn=warnings.append), since=T0) as pump:
        append(tmp_path / "metrics.jsonl", metrics_row(1), metrics_row(2))
        pump()
    assert warnings == ["raytrain: Broken tracker stopped tracking this run: ConnectionError: server gone"]
    assert recorder.calls == [("metrics", 1), ("metrics", 2)]


# -- what trackers get ---------------------------------------------------------------------


def test_step_scalars_split_window_epoch_and_validation_series():
    assert step_scalars(metrics_row(10)) == {
        "train/loss": 1.0,
        "train/lr": 1e-2,
        "train/samples_per_s": 1010.0,
        "train/global_batch_size": 64.0,
        "train/world_size": 2.0,
    }
    # a validation pass between epoch ends (--eval-every-steps) shows under val/ as an epoch's does
    assert step_scalars(metrics_row(12, val_loss=0.6))["val/loss"] == 0.6
    end = step_scalars(metrics_row(23, epoch_end=True, epoch_loss=1.25, val_loss=0.5, val_accuracy=0.9))
    assert end == {
        "train/loss": 1.0,  # the last window's, a step series like every row's
        "epoch/train_loss": 1.25,  # the epoch's mean, under its own name
        "epoch/samples_per_s": 1023.0,
        "train/lr": pytest.approx(0.023),
        "train/global_batch_size": 64.0,
        "train/world_size": 2.0,
        "epoch/epoch": 1.0,
        "val/loss": 0.5,
        "val/accuracy": 0.9,
    }


def test_config_params_are_the_resolved_config_flattened(tmp_path):
    params = config_params(raytrain.TrainConfig(epochs=3, workers="1:4", lr=3e-4), "digits", tmp_path)
    assert params["epochs"] == "3" and params["workers"] == "1:4" and params["lr"] == "0.0003"
    assert params["ddp.bucket_cap_mb"] == "25.0" and params["pipeline"] == "digits" and params["name"] == ""


def test_missing_trackers_are_configuration_errors_naming_the_fix():
    nothing = lambda module: False  # noqa: E731
    with pytest.raises(
        ConfigError, match=r"mlflow_uri: got 'sqlite:///m.db', but MLflow is not installed.*raytrain\[mlflow\]"
    ) as error:
        check_installed(TrackingOptions(mlflow_uri="sqlite:///m.db", wandb_project="p"), importable=nothing)
    assert "wandb_project: got 'p', but Weights & Biases is not installed; install it with pip install wandb" in str(
        error.value
    )
    with pytest.raises(ConfigError, match="progress: got 'fancy'; choose one of auto, bar, plain, off"):
        check_installed(TrackingOptions(progress="fancy"))
    check_installed(TrackingOptions())  # nothing asked for: fine


@pytest.mark.parametrize("bad", ["http://127.0.0.1:1", "nosuchstore://x"])
def test_an_mlflow_uri_that_cannot_work_is_a_configuration_error_before_anything_starts(tmp_path, bad, make_config):
    pytest.importorskip("mlflow")
    cfg = make_config(epochs=1, name="x")
    with pytest.raises(ConfigError, match=rf"mlflow_uri: got '{bad}', but MLflow cannot use it: .*give a server"):
        RunTracker(cfg, tmp_path / "x", "digits", options=TrackingOptions(mlflow_uri=bad))


def test_a_tracker_that_cannot_start_warns_and_training_goes_on(tmp_path):
    lines: list[str] = []
    tracker = RunTracker(raytrain.TrainConfig(epochs=1), tmp_path, "digits", echo=lines.append)
    sinks: list[Sink] = []

    def refuse():
        raise PermissionError("not logged in\nrun wandb login")

    tracker._start(sinks, "Weights & Biases", refuse)
    assert sinks == [] and lines == [
        "raytrain: Weights & Biases could not start a run, training without it: PermissionError: not logged in"
    ]


# -- TensorBoard ---------------------------------------------------------------------------


def load_tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def series(accumulator, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar tag; values rounded (TensorBoard stores float32)."""
    return [(e.step, round(e.value, 5)) for e in accumulator.Scalars(tag)]


def texts(accumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in accumulator.Tensors(tag)]


def test_tensorboard_events_have_step_series_validation_and_text_events(tmp_path):
    sink = TensorBoardSink(tmp_path, {"lr": "0.001", "epochs": "2"})
    sink.event(event("plan", "global 64 = 2 workers × 32 per worker", T0))
    for step in (5, 10, 15):
        sink.metrics(metrics_row(step, loss=2.0 / step))
    sink.metrics(metrics_row(20, epoch_end=True, loss=0.4, epoch_loss=0.6, val_loss=0.5, val_accuracy=0.875))
    sink.event(
        event("resize", "Resized 2 → 1 workers at step 20", T0 + 30, step=20, world_size=1, previous_world_size=2)
    )
    sink.metrics(metrics_row(25, epoch=2, world_size=1, loss=0.3))
    sink.tick()
    sink.finish(Summary.from_json({"status": "finished", "steps": 25, "final_metrics": {"val_loss": 0.5}}), tmp_path)

    tb = load_tensorboard(tmp_path)
    scalars = set(tb.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/global_batch_size", "train/world_size"} <= scalars
    assert {"val/loss", "val/accuracy", "epoch/train_loss", "epoch/samples_per_s", "epoch/epoch"} <= scalars
    assert series(tb, "train/loss") == [(5, 0.4), (10, 0.2), (15, 0.13333), (20, 0.4), (25, 0.3)]
    assert series(tb, "epoch/train_loss") == [(20, 0.6)]
    assert series(tb, "train/world_size") == [(5, 2), (10, 2), (15, 2), (20, 2), (25, 1)]
    assert series(tb, "val/accuracy") == [(20, 0.875)]
    assert texts(tb, "events/text_summary") == [
        (0, "**plan**: global 64 = 2 workers × 32 per worker"),
        (20, "**resize**: Resized 2 → 1 workers at step 20"),
    ]
    assert "| lr | 0.001 |" in texts(tb, "config/text_summary")[0][1]
    assert "| status | finished |" in texts(tb, "summary/text_summary")[0][1]


def test_tensorboard_shows_the_redone_steps_after_a_restart_once(tmp_path):
    """Steps after the checkpoint are trained again: TensorBoard keeps the second attempt's."""
    sink = TensorBoardSink(tmp_path, {})
    for step in (2, 4, 6):
        sink.metrics(metrics_row(step, loss=10.0 + step))
    sink.event(event("restore", "Restarted from the checkpoint at step 4", T0 + 50, step=4, world_size=2))
    for step in (6, 8):
        sink.metrics(metrics_row(step, loss=float(step)))
    sink.finish(None, tmp_path)
    tb = load_tensorboard(tmp_path)
    assert series(tb, "train/loss") == [(2, 12.0), (4, 14.0), (6, 6.0), (8, 8.0)]


# -- MLflow --------------------------------------------------------------------------------


def mlflow_uri(kind: str, tmp_path: Path) -> str:
    return f"file:{tmp_path / 'mlruns'}" if kind == "file" else f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_mlflow_run_holds_params_step_metrics_and_the_model(tmp_path, monkeypatch, kind, make_config):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # a sqlite store keeps artifacts in ./mlruns
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = make_config(epochs=2, workers=2, name="mlrun")
    uri = mlflow_uri(kind, tmp_path)
    lines = []
    tracker = RunTracker(cfg, run_dir, "digits", pipeline=DigitsPipeline())  # its model cannot load b"weights"
    params = config_params(cfg, "digits", run_dir)
    sink = MLflowSink(uri, "raytrain-tests", cfg, params, run_dir, echo=lines.append, model=tracker.final_model)
    for step in (5, 10):
        sink.metrics(metrics_row(step, loss=1.0 / step))
    sink.metrics(metrics_row(12, epoch_end=True, loss=0.3, epoch_loss=0.4, val_loss=0.25, val_accuracy=0.9))
    sink.tick()
    (run_dir / "model.pt").write_bytes(b"weights")
    (run_dir / "config.yaml").write_text("epochs: 2\n")
    sink.finish(
        Summary.from_json(
            {"status": "finished", "steady_samples_per_s": 1234.5, "wall_time_s": 9.0, "world_sizes": [2]}
        ),
        run_dir,
    )

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlrun"
    assert lines[0] == f"MLflow: experiment 'raytrain-tests', run {sink.run_id} at {uri}"
    assert lines[1].startswith(  # a model that cannot be logged: said, and the run finishes all the same
        "MLflow: the model is only the state dict run/model.pt; it could not be logged: CheckpointError: "
    )
    params = run.data.params
    assert (
        params["epochs"] == "2"
        and params["workers"] == "2"
        and params["pipeline"] == "digits"
        and params["ddp.static_graph"] == "False"
    )
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "loss")] == [
        (5, 0.2),
        (10, 0.1),
        (12, 0.3),
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "epoch_train_loss")] == [(12, 0.4)]
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "val_accuracy")] == [(12, 0.9)]
    assert {
        "lr",
        "samples_per_s",
        "global_batch_size",
        "world_size",
        "epoch_train_loss",
        "val_loss",
        "summary/steady_samples_per_s",
    } <= set(run.data.metrics)
    assert {"run/model.pt", "run/config.yaml"} <= {a.path for a in client.list_artifacts(sink.run_id, "run")}
    assert client.list_artifacts(sink.run_id, "model") == []
    assert run.data.tags["raytrain.world_sizes"] == "2"


def test_mlflow_gets_the_model_as_a_pytorch_model_with_its_signature(tmp_path, monkeypatch, make_config):
    """runs:/RUN_ID/model loads with mlflow.pytorch.load_model as the pipeline's own class with the
    run's weights; its signature comes from the example row the driver passes; the plain state
    dict is run/model.pt."""
    pytest.importorskip("mlflow")
    import mlflow.pytorch
    import torch
    from mlflow.tracking import MlflowClient

    from pipelines.digits.model import DigitsCNN
    from pipelines.digits.pipeline import load_arrays

    uri, run_dir = mlflow_uri("file", tmp_path), tmp_path / "run"
    run_dir.mkdir()
    cfg = make_config(epochs=1, name="signed")
    torch.manual_seed(7)
    trained = DigitsPipeline().build_model(cfg).eval()
    torch.save(trained.state_dict(), run_dir / "model.pt")
    images, labels = load_arrays()
    lines: list[str] = []
    options = TrackingOptions(mlflow_uri=uri, report=False)
    tracker = RunTracker(cfg, run_dir, "digits", echo=lines.append, options=options, pipeline=DigitsPipeline())
    with tracker.follow(since=T0 - 1, example={"image": images[:1], "label": labels[:1]}):
        append(run_dir / "metrics.jsonl", metrics_row(23, epoch_end=True, val_loss=0.5))
    tracker.finish(Summary.from_json({"status": "finished", "steps": 23}))

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("raytrain").experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert lines[-1] == (
        f"MLflow: the model is runs:/{run_id}/model "
        "(signature [Tensor('float32', (-1, 1, 8, 8))] -> [Tensor('float32', (-1, 10))])"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    batch = torch.from_numpy(images[:64])
    assert type(loaded) is DigitsCNN and torch.equal(loaded(batch), trained(batch))
    signature = mlflow.models.get_model_info(f"runs:/{run_id}/model").signature
    assert [(s.type, s.shape) for s in signature.inputs.inputs] == [(np.dtype("float32"), (-1, 1, 8, 8))]
    assert [s.shape for s in signature.outputs.inputs] == [(-1, 10)]
    (logged,) = client.search_logged_models([run.info.experiment_id])
    assert (logged.name, logged.source_run_id, str(logged.status)) == ("model", run_id, "READY")
    assert "run/model.pt" in {a.path for a in client.list_artifacts(run_id, "run")}

    # Resumed and finished again, with no example row at hand: runs:/ gives the new model, unsigned.
    retrained = DigitsPipeline().build_model(cfg).eval()
    torch.save(retrained.state_dict(), run_dir / "model.pt")
    resumed = dataclasses.replace(cfg, resume=True)
    again = RunTracker(resumed, run_dir, "digits", echo=lines.append, options=options, pipeline=DigitsPipeline())
    with again.follow(since=T0 - 1):
        pass
    again.finish(Summary.from_json({"status": "finished", "steps": 46}))
    assert lines[-1] == f"MLflow: the model is runs:/{run_id}/model (no signature: the run's data gave no example row)"
    assert torch.equal(mlflow.pytorch.load_model(f"runs:/{run_id}/model")(batch), retrained(batch))
    assert mlflow.models.get_model_info(f"runs:/{run_id}/model").signature is None

    # A run that did not finish (its model.pt an earlier invocation's) logs no model.
    failed = RunTracker(resumed, run_dir, "digits", echo=lines.append, options=options, pipeline=DigitsPipeline())
    with failed.follow(since=T0 - 1):
        pass
    said = len(lines)
    failed.finish(Summary.from_json({"status": "failed", "steps": 50}))
    assert not any("the model is" in line for line in lines[said:])
    assert len(client.search_logged_models([run.info.experiment_id])) == 2  # the finished invocations' only


def test_example_io_is_the_models_one_tensor_in_and_out_or_says_why_not():
    import torch

    class Pipe(raytrain.Pipeline):
        def __init__(self, call):
            self.call = call

        def compute_loss(self, model, batch):
            return self.call(model, batch).sum()

    model = torch.nn.Linear(3, 2).eval()  # as final_model gives it
    rows = {"x": np.ones((1, 3), np.float32), "y": np.zeros(1, np.int64)}
    inputs, outputs = example_io(Pipe(lambda m, b: m(b["x"])), model, rows)
    assert inputs.shape == (1, 3) and outputs.shape == (1, 2) and outputs.dtype == np.float32
    assert example_io(Pipe(lambda m, b: m(b["x"])), model, None) == "the run's data gave no example row"
    assert example_io(Pipe(lambda m, b: m(input=b["x"])), model, rows) == "the model takes other than one tensor"
    assert example_io(Pipe(lambda m, b: b["x"]), model, rows) == "compute_loss did not call the model"
    said = example_io(Pipe(lambda m, b: m(b["y"])), model, rows)  # int64 rows into a float layer
    assert said.startswith("compute_loss failed on an example row: PipelineCodeError: ")

    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    assert example_io(Pipe(lambda m, b: m(b["x"])[0]), Pair().eval(), rows) == "the model returns a tuple, not a tensor"


def test_mlflow_resume_continues_the_same_run(tmp_path, make_config):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri, run_dir = mlflow_uri("file", tmp_path), tmp_path / "run"
    first_cfg = make_config(epochs=1, name="again")
    first = MLflowSink(
        uri, "raytrain", first_cfg, config_params(first_cfg, "digits", run_dir), run_dir, echo=lambda line: None
    )
    first.metrics(metrics_row(1))
    first.finish(None, run_dir)  # the driver was interrupted
    again_cfg = make_config(epochs=2, name="again", resume=True)
    again = MLflowSink(
        uri, "raytrain", again_cfg, config_params(again_cfg, "digits", run_dir), run_dir, echo=lambda line: None
    )
    again.metrics(metrics_row(2))
    again.finish(Summary.from_json({"status": "finished"}), run_dir)
    assert again.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(again.run_id, "loss")] == [1, 2]
    assert client.get_run(again.run_id).info.status == "FINISHED"


# -- Weights & Biases ------------------------------------------------------------------------


def test_wandb_offline_run_gets_the_metrics(tmp_path, monkeypatch, make_config):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make_config(epochs=1, name="wb")
    sink = WandbSink("raytrain-tests", cfg, config_params(cfg, "digits", tmp_path), tmp_path)
    sink.metrics(metrics_row(5))
    sink.metrics(metrics_row(3))  # a step redone after a restart: W&B needs increasing steps
    sink.metrics(metrics_row(10, epoch_end=True, val_loss=0.5))
    sink.event(event("resize", "Resized 2 → 1 workers", T0, step=10))
    (tmp_path / "model.pt").write_bytes(b"weights")
    sink.finish(Summary.from_json({"status": "finished", "steps": 10}), tmp_path)
    assert sink.last_step == 10
    (offline,) = (tmp_path / "wandb").glob("offline-run-*-wb-*")  # the id derives from the run name
    (table,) = offline.glob("files/media/table/events_*.table.json")  # events, logged at the last step
    assert json.loads(table.read_text())["data"][0][1:] == ["resize", 10, "Resized 2 → 1 workers"]


# -- one run's tracker, without Ray ----------------------------------------------------------


def test_run_tracker_feeds_tensorboard_mlflow_and_writes_the_report(tmp_path, make_config):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = make_config(epochs=2, workers=2)
    lines: list[str] = []
    options = TrackingOptions(mlflow_uri=mlflow_uri("file", tmp_path))
    tracker = RunTracker(cfg, run_dir, "digits", echo=lines.append, progress=True, options=options)
    with tracker.follow(since=T0 - 1):
        # what rank 0 writes while training
        append(run_dir / "events.jsonl", event("plan", "global 64 = 2 workers", T0))
        append(run_dir / "metrics.jsonl", metrics_row(10), metrics_row(23, epoch_end=True, val_loss=0.5))
        append(run_dir / "events.jsonl", event("epoch", "epoch 1/2  loss 1.0", T0 + 24))
    summary = Summary.from_json(
        {
            "status": "finished",
            "epochs": 1,
            "steps": 23,
            "samples_seen": 1472,
            "wall_time_s": 3.0,
            "world_sizes": [2],
            "failures_recovered": 0,
            "final_metrics": {"val_loss": 0.5},
        }
    )
    (run_dir / "summary.json").write_text(json.dumps(summary.to_json()))
    tracker.finish(summary)

    assert lines[0].startswith("MLflow: experiment 'raytrain', run ")
    assert lines[1:] == ["global 64 = 2 workers", "epoch 1/2  loss 1.0"]  # not a terminal: no bar
    assert "train/loss" in load_tensorboard(run_dir).Tags()["scalars"]
    assert (run_dir / "report.md").exists() and (run_dir / "plots" / "loss.png").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=options.mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("raytrain").experiment_id])[0]
    assert {a.path for a in client.list_artifacts(run.info.run_id, "run")} >= {"run/report.md", "run/plots"}


# -- CPU Ray: digits end to end through the command line -------------------------------------


@pytest.mark.ray
def test_digits_run_leaves_tensorboard_files_and_a_report(digits_two_worker_run, monkeypatch):
    run = digits_two_worker_run  # 4 epochs of 23 steps, --log-every-steps 5 (tests/conftest.py)
    out, run_dir, mlflow_flags = run.out, run.run_dir, run.mlflow_flags
    assert run.code == 0, out
    assert "\r" not in out  # stdout is not a terminal here: plain lines, no bar
    assert f"Report: {run_dir / 'report.md'}" in out
    if mlflow_flags:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=mlflow_flags[1])
        (mlflow_run,) = client.search_runs([client.get_experiment_by_name("raytrain").experiment_id])
        assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["workers"] == "2"
        run_id = mlflow_run.info.run_id
        assert len(client.get_metric_history(run_id, "loss")) > 3
        assert "run/model.pt" in {a.path for a in client.list_artifacts(run_id, "run")}
        import mlflow.pytorch
        import torch

        monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_flags[1])  # where runs:/ URIs are read
        loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
        weights = torch.load(run_dir / "model.pt", weights_only=True)
        assert all(torch.equal(loaded.state_dict()[key], value) for key, value in weights.items())
        assert f"MLflow: the model is runs:/{run_id}/model (signature [Tensor('float32', (-1, 1, 8, 8))]" in out

    tb = load_tensorboard(run_dir)
    assert {
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "train/global_batch_size",
        "train/world_size",
        "val/loss",
        "val/accuracy",
    } <= set(tb.Tags()["scalars"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in tb.Scalars("train/loss")] == [row["step"] for row in rows]  # every row: its window's
    assert [e.step for e in tb.Scalars("val/accuracy")] == [row["step"] for row in rows if row.get("epoch_end")]
    assert [step for step, _ in texts(tb, "events/text_summary")][-1] == rows[-1]["step"]  # the "done" event

    from PIL import Image

    for name in ("loss", "val", "lr", "workers", "throughput"):
        with Image.open(run_dir / "plots" / f"{name}.png") as image:
            assert image.format == "PNG" and image.size[0] > 300
    report = (run_dir / "report.md").read_text()
    assert "**finished**" in report and "| 2 | 46 |" in report and "![loss](plots/loss.png)" in report


# Scenario stage (docs/testing.md): making the server's venv costs minutes the first time; the
# logging itself stays in CI through test_mlflow_gets_the_model_as_a_pytorch_model_with_its_signature
# and the digits run above (a file: store).
@pytest.mark.ray
@pytest.mark.scenario
def test_a_run_against_a_real_mlflow_server_gives_a_model_to_load_and_register(ray_session, tmp_path, monkeypatch):
    """`raytrain train digits --mlflow-uri http://…` against `mlflow server` (sqlite store,
    artifacts served by the server, tests/mlflow_server.py), read back with MLflow's client:
    the finished run, its params, step-indexed metrics and run files; runs:/RUN_ID/model loads
    with mlflow.pytorch.load_model as the digits CNN with model.pt's weights and its signature,
    predicts through pyfunc, and registers in the Model Registry as a version that loads."""
    import contextlib
    import io

    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.tracking import MlflowClient
    from mlflow_server import MlflowServer

    from pipelines.digits.model import DigitsCNN
    from pipelines.digits.pipeline import load_arrays
    from raytrain.cli import main

    server = MlflowServer(tmp_path / "mlflow")
    try:
        argv = ["train", "digits", "--workers", "1", "--epochs", "2", "--log-every-steps", "10"]
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = main([*argv, "--storage", str(tmp_path), "--name", "served", "--mlflow-uri", server.uri])
        out = stdout.getvalue()
        assert code == 0, out
        client = MlflowClient(tracking_uri=server.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("raytrain").experiment_id])
        run_id = run.info.run_id
        assert run.info.status == "FINISHED" and run.data.params["epochs"] == "2" and len(run.data.params) > 50
        rows = [json.loads(line) for line in (tmp_path / "served" / "metrics.jsonl").read_text().splitlines()]
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == [row["step"] for row in rows]
        assert len(client.get_metric_history(run_id, "val_accuracy")) == 2
        assert {f"run/{name}" for name in ("model.pt", "config.yaml", "summary.json", "metrics.jsonl")} <= {
            a.path for a in client.list_artifacts(run_id, "run")
        }

        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)  # where runs:/ and models:/ URIs are read
        loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
        weights = torch.load(tmp_path / "served" / "model.pt", weights_only=True)
        assert type(loaded) is DigitsCNN
        assert all(torch.equal(loaded.state_dict()[key], value) for key, value in weights.items())
        signature = mlflow.models.get_model_info(f"runs:/{run_id}/model").signature
        assert [s.shape for s in signature.inputs.inputs] == [(-1, 1, 8, 8)]
        assert [s.shape for s in signature.outputs.inputs] == [(-1, 10)]
        images = load_arrays()[0][:16]
        with torch.no_grad():
            expected = loaded.eval()(torch.from_numpy(images)).numpy()
        assert np.allclose(mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict(images), expected)

        version = mlflow.register_model(f"runs:/{run_id}/model", "digits-served")
        registered = mlflow.pytorch.load_model(f"models:/digits-served/{version.version}")
        with torch.no_grad():
            assert torch.equal(registered.eval()(torch.from_numpy(images)), torch.from_numpy(expected))
        assert (version.version, version.run_id) == ("1", run_id)
    finally:
        server.stop()
