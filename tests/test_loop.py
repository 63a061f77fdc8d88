"""Pure tier: the per-worker loop's pieces without Ray — what an attempt is and the line it
says, a step's instrumentation (heartbeat marks and phase laps), the data notes, and rank 0's
writer of the run files."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from design import METRICS_KEYS

from raytrain.data.sources import cost_notes
from raytrain.data.table import Table
from raytrain.instruments.phases import PhaseTimer, StepPhases
from raytrain.instruments.window import FOLD_EVERY, LossWindow
from raytrain.rules.attempt import Attempt
from raytrain.rules.position import Position, Telemetry
from raytrain.rules.position import progress as progress_of
from raytrain.rundir import RunDir
from raytrain.rundir.records import Event, Kind, MetricsRow
from raytrain.rundir.writer import RunWriter

# -- what an attempt is ------------------------------------------------------------------


@pytest.mark.parametrize(
    "resumed, world_sizes, world_size, expected",
    [
        (False, [], 4, Attempt.FRESH),
        (False, [2], 4, Attempt.FRESH),  # no checkpoint restored: whatever ran before, training starts
        (True, [4], 4, Attempt.RESTART),
        (True, [2, 4], 4, Attempt.RESTART),  # the last worker count is the one that counts
        (True, [], 4, Attempt.RESTART),  # a checkpoint without worker counts: taken as this attempt's
        (True, [4], 2, Attempt.RESIZE),
        (True, [4, 2], 4, Attempt.RESIZE),
    ],
)
def test_the_attempt_follows_from_the_checkpoint_and_the_worker_counts(resumed, world_sizes, world_size, expected):
    assert Attempt.of(resumed, world_sizes, world_size) is expected


def test_each_attempt_is_announced_by_its_own_kind_of_event():
    assert [a.value for a in Attempt] == [Kind.PLAN, Kind.RESTORE, Kind.RESIZE]


def test_a_fresh_start_says_the_plan():
    event = Attempt.FRESH.event(Position(), 2, "global 64 = 2 workers × 32", lr_now=2e-3)
    assert (event.kind, event.message, event.extra) == ("plan", "global 64 = 2 workers × 32", {"world_size": 2})


def test_a_resize_says_where_training_continues_and_the_new_rate():
    position = Position(epoch=1, epoch_offset=1200, step=30, samples_seen=3000, world_sizes=[4])
    event = Attempt.RESIZE.event(position, 2, "global 64 = 2 workers × 32", lr_now=1e-3, lr_before=2e-3)
    assert event.kind == Kind.RESIZE
    assert (
        event.message
        == "Resized 4 → 2 workers at step 30 (epoch 2, 1,200 samples into it): global 64 = 2 workers × 32; lr now "
        "1.0e-3 (was 2.0e-3)"
    )
    assert event.extra == {"world_size": 2, "previous_world_size": 4, "step": 30}
    assert event.recovers_a_failure  # fewer workers than before


def test_a_restart_says_the_rate_is_unchanged():
    position = Position(epoch=0, epoch_offset=64, step=1, samples_seen=64, world_sizes=[2])
    event = Attempt.RESTART.event(position, 2, "plan", lr_now=2e-3, lr_before=2e-3)
    assert event.kind == Kind.RESTORE
    assert (
        event.message
        == "Restarted from the checkpoint at step 1 (epoch 1, 64 samples into it) with 2 workers: plan; lr now "
        "2.0e-3 unchanged"
    )
    assert event.extra == {"world_size": 2, "step": 1}


# -- a step's instrumentation ------------------------------------------------------------


class Marks:
    def __init__(self, log: list):
        self.log = log

    def mark(self, step: int, phase: str) -> None:
        self.log.append(("mark", step, phase))


class Laps(PhaseTimer):
    """The phase timer, recording its laps (and its device syncs) in `log`."""

    def __init__(self, log: list, totals: dict[str, float] | None):
        super().__init__(totals, sync=lambda: log.append(("sync",)))
        self.log = log

    def lap(self, phase: str) -> None:
        self.log.append(("lap", phase))
        super().lap(phase)


def phases(log: list, timed: bool = True) -> tuple[StepPhases, dict[str, float]]:
    totals: dict[str, float] = {}
    return StepPhases(Marks(log), 7, Laps(log, totals if timed else None)), totals


def test_a_phase_marks_the_heartbeat_as_it_begins_and_a_timed_one_laps_as_it_ends():
    log: list = []
    phase, totals = phases(log)
    with phase.data:
        log.append("read")
    with phase.forward:
        log.append("forward")
    with phase.backward:
        log.append("backward")
    with phase.optimizer:
        log.append("step")
    assert [entry for entry in log if entry != ("sync",)] == [
        ("mark", 7, "data"),
        "read",
        ("lap", "data_wait"),
        ("mark", 7, "forward"),
        "forward",
        ("mark", 7, "backward"),
        "backward",
        ("lap", "forward_backward"),
        ("mark", 7, "optimizer"),
        "step",
        ("lap", "optimizer"),
    ]
    assert list(totals) == ["data_wait", "forward_backward", "optimizer"] and all(t >= 0 for t in totals.values())


def test_a_phase_that_raises_laps_nothing():
    log: list = []
    phase, totals = phases(log)
    with pytest.raises(ValueError), phase.backward:
        raise ValueError("boom")
    assert log == [("mark", 7, "backward")] and totals == {}


def test_an_untimed_step_marks_the_heartbeat_but_neither_syncs_nor_times():
    log: list = []
    phase, totals = phases(log, timed=False)
    with phase.data:
        pass
    assert log == [("mark", 7, "data"), ("lap", "data_wait")] and totals == {}  # the lap is a no-op: no sync


def test_the_loss_window_sums_finite_losses_and_notes_the_first_bad_step():
    window = LossWindow.on(torch.device("cpu"))
    window.add(torch.tensor([2.0], dtype=torch.float64), 3, step_index=5)  # one element, of another dtype
    window.add(torch.tensor(math.nan), 1, step_index=6)
    window.add(torch.tensor(math.inf), 1, step_index=7)
    assert float(window.loss_sum) == 6.0 and window.loss_count == 5
    assert float(window.first_bad_step) == 6
    assert window.mean_loss() == pytest.approx(6.0 / 5)
    assert LossWindow.on(torch.device("cpu")).mean_loss() is None


def test_the_loss_window_folds_many_steps_and_a_snapshot_undoes_an_uncommitted_one():
    window = LossWindow.on(torch.device("cpu"))
    for step in range(3 * FOLD_EVERY + 5):  # several folds, and some still pending
        window.add(torch.tensor(float(step)), 2, step_index=step)
    saved = window.snapshot()
    window.add(torch.tensor(math.nan), 1, step_index=999)  # the uncommitted step
    window.restore(saved)
    steps = 3 * FOLD_EVERY + 5
    assert float(window.loss_sum) == 2.0 * sum(range(steps)) and window.loss_count == 2 * steps
    assert math.isinf(float(window.first_bad_step))
    window.note_if_bad(torch.tensor(math.inf), step_index=4)  # a gradient norm: noted, adds no samples
    assert float(window.first_bad_step) == 4 and window.loss_count == 2 * steps
    window.clear()
    assert window.mean_loss() is None and math.isinf(float(window.first_bad_step))


# -- what the data costs -----------------------------------------------------------------


def test_cost_notes_say_the_rows_skipped_in_memory():
    table = Table({"x": np.zeros((10, 2))}, dropped_rows=3)
    assert cost_notes(table, 2) == ["dataset 'train': skipped 3 row(s) holding NaN or inf (--skip-nan-rows); 10 left"]
    assert cost_notes(Table({"x": np.zeros((10, 2))}), 2) == []


# -- rank 0's writer ---------------------------------------------------------------------


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_writer_writes_nothing_on_other_ranks(tmp_path):
    writer = RunWriter(tmp_path, enabled=False)
    writer.event(Kind.DATA, "x")
    writer.metrics(MetricsRow(epoch=1, step=1))
    writer.start_attempt(Event(Kind.PLAN, "plan"), 0)
    writer.interrupted(progress_of(Position(), Telemetry(), "interrupted"))
    assert not writer.live_due() and not writer.stop_requested()
    assert list(tmp_path.iterdir()) == []


def test_an_attempt_drops_the_rows_after_its_checkpoint_and_says_what_it_is(tmp_path):
    writer = RunWriter(tmp_path, enabled=True)
    for step in (10, 20, 30):
        writer.metrics(MetricsRow(epoch=1, step=step, loss=1.0, time_s=100.0 + step))
    writer.start_attempt(Event(Kind.RESTORE, "Restarted", extra={"world_size": 2, "step": 20}), 20)
    assert [row.step for row in RunDir(tmp_path).metrics()] == [10, 20]
    (event,) = lines(tmp_path / "events.jsonl")
    assert set(event) == {"time", "kind", "message", "world_size", "step", "last_step", "last_step_time"}
    assert event["kind"] == "restore"
    # the last training recorded before it (its row is dropped): goodput counts the steps redone from it
    assert (event["last_step"], event["last_step_time"]) == (30, 130.0)


def test_an_epochs_end_writes_its_row_and_its_line(tmp_path):
    writer = RunWriter(tmp_path, enabled=True)
    writer.metrics(MetricsRow(epoch=2, step=30, loss=0.7))  # the window before the epoch's last
    row = MetricsRow(
        epoch=2,
        step=40,
        samples_seen=1280,
        world_size=2,
        global_batch_size=32,
        lr=1e-3,
        loss=0.5,
        samples_per_s=1000.0,
        time_s=1.0,
        extra={"val_loss": 0.25, "epoch_loss": 0.625},
    )
    writer.epoch_end(row, epochs=3)
    _, metrics = lines(tmp_path / "metrics.jsonl")
    assert metrics["epoch_end"] is True and metrics["val_loss"] == 0.25
    assert METRICS_KEYS <= set(metrics)
    (event,) = lines(tmp_path / "events.jsonl")
    assert event["kind"] == "epoch" and event["epoch"] == 2
    # each loss named for what it is the mean of: the epoch, and the last window (the steps since the row before)
    assert (
        event["message"]
        == "epoch 2/3  epoch_loss 0.6250  loss 0.5000 (steps 31–40)  val_loss 0.2500  lr 1.00e-03  1,000 samples/s"
    )
    assert "epoch_end" not in row.to_json()  # the row reported to Ray stays without it


def test_finishing_writes_the_model_the_progress_and_the_last_event(tmp_path):
    writer = RunWriter(tmp_path, enabled=True)
    position = Position(epoch=2, step=40, samples_seen=1280, world_sizes=[2])
    telemetry = Telemetry(steady_steps=30, steady_samples=960, steady_time_s=2.0)
    writer.finish(torch.nn.Linear(2, 1).state_dict(), progress_of(position, telemetry, "finished"))
    assert set(torch.load(tmp_path / "model.pt", weights_only=True)) == {"weight", "bias"}
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert set(progress) == {
        "epoch",
        "epoch_offset",
        "step",
        "samples_seen",
        "world_sizes",
        "steady_steps",
        "steady_samples",
        "steady_time_s",
        "phase_time_s",
        "checkpoint_wait_s",
        "checkpoints",
        "validation_s",
        "data",
        "epoch_loss",
        "flops_per_sample",
        "device_name",
        "last_loss",
        "compile_graphs",
        "compile_s",
        "steady_samples_per_s",
        "status",
        "time",
    }
    assert (progress["status"], progress["steady_samples_per_s"]) == ("finished", 480.0)
    (event,) = lines(tmp_path / "events.jsonl")
    assert (event["kind"], event["message"], event["step"]) == ("done", "finished 2 epochs, 40 steps", 40)


def test_live_rows_come_about_once_a_second_with_the_rate_between_them(tmp_path):
    writer = RunWriter(tmp_path, enabled=True)
    fields = dict(epoch=1, step=1, epoch_rows=100, global_batch_size=10, world_size=1, loss=None)
    assert writer.live_due()
    writer.live(samples_seen=10, **fields)
    assert not writer.live_due()
    writer.last_live -= 1.0  # a second later
    assert writer.live_due()
    writer.live_mark = (writer.live_mark[0] - 2.0, 10)  # the last row two seconds ago, at 10 samples
    writer.live(samples_seen=50, **fields)
    first, second = lines(tmp_path / "live.jsonl")
    assert first["samples_per_s"] is None and second["samples_per_s"] == pytest.approx(20.0, rel=0.05)
    assert set(first) == {
        "time",
        "epoch",
        "step",
        "samples_seen",
        "epoch_rows",
        "global_batch_size",
        "world_size",
        "loss",
        "samples_per_s",
    }


def test_a_checkpoint_of_the_earlier_position_resumes_its_state_and_keeps_its_figures():
    """train_state.pt / position.json as earlier versions wrote them: the telemetry inside the
    position, the epoch's loss as a list [epoch, sum, samples]."""
    earlier = {
        "position": {
            "epoch": 1,
            "epoch_offset": 64,
            "step": 12,
            "samples_seen": 448,
            "world_sizes": [2, 3],
            "steady_steps": 10,
            "steady_samples": 320,
            "steady_time_s": 2.0,
            "phase_time_s": {"forward": 0.5},
            "checkpoint_wait_s": 0.25,
            "checkpoints": 3,
            "data": {"rows": 384},
            "flops_per_sample": 1e6,
            "device_name": "cpu",
            "epoch_loss": [1.0, 6.4, 64.0],
            "last_loss": 0.1,
        }
    }
    position, telemetry = Position.restored(earlier), Telemetry.restored(earlier)
    assert (position.epoch, position.epoch_offset, position.step, position.samples_seen) == (1, 64, 12, 448)
    assert position.world_sizes == [2, 3] and position.data == {"rows": 384}
    assert position.epoch_loss_so_far().mean() == pytest.approx(0.1) and position.epoch_loss_so_far().count == 64
    assert (telemetry.steady_steps, telemetry.checkpoints, telemetry.last_loss) == (10, 3, 0.1)
    assert telemetry.phase_time_s == {"forward": 0.5} and telemetry.device_name == "cpu"
    # written now: each under its own key, and read back the same
    now = {"position": dataclasses.asdict(position), "telemetry": dataclasses.asdict(telemetry)}
    assert Position.restored(now) == position and Telemetry.restored(now) == telemetry
    assert Position(epoch=2, epoch_loss=position.epoch_loss).epoch_loss_so_far().count == 0  # another epoch's


def test_steady_steps_on_the_cpu_are_timed_by_the_host_at_once():
    import torch

    from raytrain.instruments.phases import SteadyClock
    from raytrain.rules.position import Telemetry

    clock, telemetry = SteadyClock(torch.device("cpu")), Telemetry()
    clock.stop(clock.start(), 32, telemetry)
    assert telemetry.steady_steps == 1 and telemetry.steady_samples == 32 and telemetry.steady_time_s >= 0
    clock.settle(telemetry)  # nothing pending on a CPU
    assert telemetry.steady_steps == 1


def test_the_state_held_is_measured_after_the_first_step_and_said_once(tmp_path):
    from types import SimpleNamespace

    from raytrain.instruments.phases import Measures
    from raytrain.rundir.heartbeats import Heartbeat

    measures = Measures(Heartbeat(tmp_path / "heartbeats", 0, enabled=False), torch.device("cpu"))
    said = []
    files = SimpleNamespace(event=lambda kind, line, **figures: said.append((kind, line, figures)))
    runtime = SimpleNamespace(all_gather_object=lambda mine: [mine, mine])  # two ranks
    assert not measures.memory  # nothing to say before the first step
    measures.note_state(lambda: {"parameters": 4 << 20, "gradients": 4 << 20, "optimizer": 8 << 20})
    assert measures.memory
    measures.say_memory(runtime, files)
    measures.note_state(lambda: pytest.fail("measured again"))  # the next steps measure nothing
    assert not measures.memory and len(said) == 1
    kind, line, figures = said[0]
    assert kind == Kind.MEMORY and line.startswith("memory per worker after the first step: 4 MiB parameters")
    assert figures["optimizer"] == [8 << 20, 8 << 20] and len(figures["peak_rss"]) == 2
