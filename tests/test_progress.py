"""The driver's console: progress from rank 0's rows, one bar or plain lines, failures explained."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from raytrain.errors import explain_worker_errors, summarize_traceback
from raytrain.observe.console import Console, EpochProgress, format_duration
from raytrain.rundir import Event, MetricsRow

RAYTRAIN = Path(__import__("raytrain").__file__).resolve().parent


def row(
    step: int,
    *,
    epoch: int = 1,
    rows_per_epoch: int = 1438,
    batch: int = 64,
    loss: float = 0.5,
    rate: float = 2000.0,
    **extra,
) -> dict:
    per_epoch = -(-rows_per_epoch // batch)  # steps per epoch, the last one partial
    seen = (epoch - 1) * rows_per_epoch + min(rows_per_epoch, (step - (epoch - 1) * per_epoch) * batch)
    return MetricsRow.from_json(
        {
            "epoch": epoch,
            "step": step,
            "samples_seen": seen,
            "global_batch_size": batch,
            "loss": loss,
            "samples_per_s": rate,
            "world_size": 2,
            **extra,
        }
    )


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- where the run is ----------------------------------------------------------------------


def test_steps_in_the_epoch_from_the_training_set_size():
    progress = EpochProgress(epochs=3, train_rows=1438)  # 23 steps of 64, the last one 30 rows
    snap = progress.update(row(10, loss=0.25))
    assert (snap.epoch, snap.epoch_step, snap.epoch_steps) == (1, 10, 23)
    assert snap.eta_s == pytest.approx((1438 - 640) / 2000.0)
    assert snap.line() == "epoch 1/3  step 10/23 (43%)  ETA 0:00  loss 0.2500  2,000 samples/s  2 workers"
    snap = progress.update(row(30, epoch=2, loss=0.1, rate=100.0))  # 7 steps into epoch 2: 448 rows
    assert (snap.epoch, snap.epoch_step, snap.epoch_steps) == (2, 7, 23)
    assert format_duration(snap.eta_s) == "0:10"  # 990 rows left at 100/s


def test_epoch_size_is_learned_at_the_first_epoch_end_when_not_given():
    progress = EpochProgress(epochs=2)
    assert progress.update(row(10)).epoch_steps is None
    end = progress.update(row(23, epoch_end=True))
    assert (end.epoch_step, end.epoch_steps, progress.train_rows) == (23, 23, 1438)
    upcoming = progress.next_epoch(end, 64)
    assert (upcoming.epoch, upcoming.epoch_step, upcoming.epoch_steps) == (2, 0, 23)
    assert progress.update(row(33, epoch=2)).epoch_step == 10
    assert progress.next_epoch(progress.update(row(46, epoch=2, epoch_end=True)), 64) is None  # the last epoch


def test_progress_rows_give_the_steps_or_the_epoch_size():
    progress = EpochProgress(epochs=1, train_rows=1000)
    snap = progress.update(row(5, epoch_step=4, epoch_steps=17))
    assert (snap.epoch_step, snap.epoch_steps) == (4, 17)
    live = EpochProgress(epochs=2)
    snap = live.update(row(7, time=1.0, epoch_rows=1438))  # a live.jsonl row
    assert (snap.epoch_step, snap.epoch_steps, live.train_rows) == (7, 23, 1438)


# -- plain lines (not a terminal) ------------------------------------------------------------


def test_plain_output_is_lines_every_interval_without_carriage_returns():
    out, clock = io.StringIO(), FakeClock()
    console = Console(
        lambda line: out.write(line + "\n"),
        epochs=2,
        train_rows=1438,
        mode="auto",
        interval_s=10,
        stream=out,
        clock=clock,
    )
    assert console.mode == "plain"
    console.event(Event.from_json({"kind": "plan", "message": "global 64 = 2 workers × 32 per worker"}))
    for second in range(1, 26):
        clock.now = float(second)
        if second % 2 == 0:
            console.metrics(row(second))
        console.tick()
    console.metrics(row(23, epoch_end=True))
    console.event(Event.from_json({"kind": "epoch", "message": "epoch 1/2  loss 0.5000"}))
    console.stop()
    lines = out.getvalue().splitlines()
    assert lines == [
        "global 64 = 2 workers × 32 per worker",
        "epoch 1/2  step 10/23 (43%)  ETA 0:00  loss 0.5000  2,000 samples/s  2 workers",
        "epoch 1/2  step 20/23 (87%)  ETA 0:00  loss 0.5000  2,000 samples/s  2 workers",
        "epoch 1/2  loss 0.5000",
    ]
    assert "\r" not in out.getvalue()


def test_off_prints_the_run_lines_only():
    lines: list[str] = []
    console = Console(lines.append, epochs=1, mode="off", interval_s=0)
    console.metrics(row(5))
    console.tick()
    console.event(Event.from_json({"kind": "done", "message": "finished 1 epochs, 23 steps"}))
    assert lines == ["finished 1 epochs, 23 steps"]


# -- the bar (a terminal) --------------------------------------------------------------------


def test_one_bar_on_a_terminal_with_the_run_lines_printed_above_it():
    from tqdm import tqdm

    screen = TTY()
    console = Console(lambda line: screen.write(line + "\n"), epochs=2, train_rows=1438, mode="auto", stream=screen)
    assert console.mode == "bar"
    console.event(Event.from_json({"kind": "plan", "message": "global 64 = 2 workers"}))
    console.metrics(row(10, loss=0.25))
    bar = console.bar
    assert (bar.n, bar.total, bar.desc) == (10, 23, "epoch 1/2")
    assert "loss 0.2500" in str(bar) and "2,000 samples/s" in str(bar) and "ETA 0:00" in str(bar)
    console.metrics(row(23, epoch_end=True))
    console.event(Event.from_json({"kind": "epoch", "message": "epoch 1/2  loss 0.5000"}))
    assert console.bar is bar and (bar.n, bar.total, bar.desc) == (0, 23, "epoch 2/2")  # one bar, reset
    console.metrics(row(30, epoch=2))
    assert len(tqdm._instances) == 1
    console.event(Event.from_json({"kind": "done", "message": "finished 2 epochs, 46 steps"}))
    assert console.bar is None and len(tqdm._instances) == 0
    text = screen.getvalue()
    # Each run line starts on a line of its own: the bar was cleared before it was printed.
    for line in ("global 64 = 2 workers\n", "\repoch 1/2  loss 0.5000\n", "finished 2 epochs, 46 steps\n"):
        assert line in text
    assert text.count("epoch 1/2  loss 0.5000") == 1


def test_verbose_runs_get_plain_lines_instead_of_a_bar(tmp_path):
    from raytrain.config import TrainConfig
    from raytrain.observe.console import Console as ConsoleSink
    from raytrain.observe.tracking import RunTracker

    tracker = RunTracker(TrainConfig(verbose=True, epochs=1), tmp_path, "digits", progress=True, stream=TTY())
    console = next(sink for sink in tracker.open_sinks() if isinstance(sink, ConsoleSink))
    assert console.mode == "plain"


# -- failures --------------------------------------------------------------------------------


def snippet(user_file: str = "/home/me/project/mypipe.py") -> str:
    return f"""Traceback (most recent call last):
  File "{RAYTRAIN}/loop.py", line 108, in run_attempt
    train_loss = train_epoch(trainer, train_table, position, cfg, files)
                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{RAYTRAIN}/loop.py", line 257, in optimizer_step
    loss, _ = split_loss(self.pipeline.compute_loss(self.model, batch))
  File "{user_file}", line 11, in compute_loss
    helper(batch)
  File "{user_file}", line 5, in helper
    return x["nope"]
           ~^^^^^^^^
KeyError: 'nope'
"""


class WorkerGroupError(Exception):
    """The shape of ray.train.WorkerGroupError: per-rank snippets in the text."""

    def __init__(self, text: str, worker_failures: dict):
        super().__init__(text)
        self.worker_failures = worker_failures


def test_a_worker_error_names_rank_type_and_the_users_frames():
    error = WorkerGroupError(
        "Training failed due to worker errors:\n[Rank 1 Error Snippet]:\n" + snippet(), {1: KeyError("nope")}
    )
    assert explain_worker_errors(error) == [
        "rank 1 raised KeyError: 'nope'",
        "  at /home/me/project/mypipe.py:11, in compute_loss: helper(batch)",
        '  at /home/me/project/mypipe.py:5, in helper: return x["nope"]',
    ]


def test_ranks_failing_alike_are_grouped_and_long_messages_kept_for_the_first():
    stall = (
        "Traceback (most recent call last):\n"
        f'  File "{RAYTRAIN}/loop.py", line 80, in train_loop_per_worker\n'
        "    raise StallError(explain_stall(cfg, runtime, heartbeat, run_dir, exc)) from exc\n"
        "raytrain.worker.loop.StallError: A collective timed out on rank 0 after --collective-timeout-s 10; stalled "
        "rank(s): 1\n"
        "  rank 0 (waiting): step 3, in all_reduce for 10 s\n"
        "  rank 1 (STALLED): step 3, in forward for 11 s\n"
        "  cause: DistBackendError: timeout\n"
    )
    text = (
        f"Training failed due to worker errors:\n[Rank 0 Error Snippet]:\n{stall}[Rank 2,3 Error Snippet]:\n{snippet()}"
    )
    lines = explain_worker_errors(WorkerGroupError(text, {}))
    assert (
        lines[0] == "rank 0 raised raytrain.worker.loop.StallError: A collective timed out on rank 0 after "
        "--collective-timeout-s 10; stalled rank(s): 1"
    )
    assert "  rank 1 (STALLED): step 3, in forward for 11 s" in lines
    assert (
        f"  at {RAYTRAIN}/loop.py:80, in train_loop_per_worker: raise StallError(explain_stall(cfg, runtime, "
        "heartbeat, run_dir, exc)) from exc" in lines
    )
    assert "ranks 2, 3 raised KeyError: 'nope'" in lines


def test_chained_errors_report_the_last_exception_and_the_users_frame_of_the_cause():
    library = "/usr/lib/python3/site-packages/torch/nn/functional.py"
    text = (
        "Traceback (most recent call last):\n"
        '  File "/home/me/project/mypipe.py", line 20, in compute_loss\n'
        "    return F.cross_entropy(logits, labels)\n"
        f'  File "{library}", line 3500, in cross_entropy\n'
        "    return torch._C._nn.cross_entropy_loss(input, target)\n"
        "IndexError: Target 12 is out of bounds.\n"
        "\n"
        "The above exception was the direct cause of the following exception:\n"
        "\n"
        "Traceback (most recent call last):\n"
        f'  File "{library}", line 10, in wrapper\n'
        "    raise RuntimeError('wrapped') from exc\n"
        "RuntimeError: wrapped\n"
    )
    summary = summarize_traceback(text)
    assert summary.exception == ["RuntimeError: wrapped"]
    assert [frame.describe() for frame in summary.frames] == [
        "/home/me/project/mypipe.py:20, in compute_loss: return F.cross_entropy(logits, labels)"
    ]


def test_errors_without_snippets_fall_back_to_their_own_text():
    assert explain_worker_errors(RuntimeError("Training failed due to controller error:\nnccl is not available")) == [
        "RuntimeError: Training failed due to controller error:",
        "nccl is not available",
    ]
    lines = explain_worker_errors(WorkerGroupError("no snippets here", {0: ValueError("bad shape")}))
    assert lines == ["rank 0 raised ValueError: bad shape"]
    assert explain_worker_errors(TimeoutError("")) == ["TimeoutError"]


def test_library_only_tracebacks_show_the_innermost_frames():
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{RAYTRAIN}/loop.py", line 1, in a\n    a()\n'
        f'  File "{RAYTRAIN}/data.py", line 2, in b\n    b()\n'
        f'  File "{os.sep}usr/lib/python3/site-packages/numpy/core.py", line 3, in c\n    c()\n'
        "ValueError: boom\n"
    )
    summary = summarize_traceback(text)
    assert [frame.func for frame in summary.frames] == ["b", "c"]


def test_a_summary_made_on_the_worker_names_the_users_frames_without_reading_text(tmp_path):
    import pickle

    from raytrain.errors import summarize_on_raise

    user_file = tmp_path / "mypipe.py"
    user_file.write_text("def helper(x):\n    return x['nope']\n\ndef compute_loss(batch):\n    return helper(batch)\n")
    namespace: dict = {}
    exec(compile(user_file.read_text(), str(user_file), "exec"), namespace)
    failures = {}
    for rank in (0, 2):
        try:
            summarize_on_raise(namespace["compute_loss"])({})
        except KeyError as exc:
            failures[rank] = pickle.loads(pickle.dumps(exc))  # as it crosses from a worker
    error = WorkerGroupError("Training failed due to worker errors:\n(no snippets: the text is not read)", failures)
    assert explain_worker_errors(error) == [
        "ranks 0, 2 raised KeyError: 'nope'",
        f"  at {user_file}:5, in compute_loss: return helper(batch)",
        f"  at {user_file}:2, in helper: return x['nope']",
    ]


DEATH = (
    "A worker health check failed.\n"
    "Worker info: Worker(\n"
    "  actor=Actor(RayTrainWorker, 4d059412bac1c81e7854df0d01000000),\n"
    "  metadata=ActorMetadata(\n"
    "    hostname='vm',\n"
    "    node_id='64bf41699e935d79bc3f59408ffa15824fa5ca2cfd74f06a44530fdc',\n"
    "    node_ip='192.0.2.2',\n"
    "    pid=8283,\n"
    "  ),\n"
    "  distributed_context=DistributedContext(world_rank=1, world_size=2, local_rank=1, local_world_size=2, "
    "node_rank=0),\n"
    "  log_file_path='/tmp/ray/session_x/logs/train/ray-train-app-worker-dc69.log',\n"
    ")\n"
    "The actor died unexpectedly before finishing this task.\n"
    "\tclass_name: RayTrainWorker\n"
    "\tactor_id: 4d059412bac1c81e7854df0d01000000\n"
    "\tpid: 8283\n"
    "\tnamespace: ae1c2d01-8700-4835-86a8-76ec1ff12925\n"
    "\tip: 192.0.2.2\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
    "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the "
    "worker crashed unexpectedly due to SIGSEGV or another unexpected error."
)


def test_a_worker_process_that_died_is_one_line_and_comes_first_without_rays_dump_of_the_worker():
    from raytrain.errors import SUMMARY_ATTRIBUTE, ErrorSummary

    survivor = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:21411")
    setattr(survivor, SUMMARY_ATTRIBUTE, ErrorSummary.from_exception(survivor))
    error = WorkerGroupError("Training failed due to worker errors:\n...", {0: survivor, 1: RuntimeError(DEATH)})
    lines = explain_worker_errors(error)
    assert lines[0] == (
        "rank 1 lost its worker process (pid 8283): Worker unexpectedly exits with a connection error code 2. End of "
        "file. A process that vanishes like this was killed (out of memory, SIGKILL) or crashed (e.g. SIGSEGV in "
        "native code); its output: /tmp/ray/session_x/logs/train/ray-train-app-worker-dc69.log"
    )
    assert lines[1].startswith("rank 0 raised RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed")
    assert not any("Worker(" in line or "metadata=" in line for line in lines)
    # The same from the text alone (Ray Train's snippets), as the driver may get it.
    text = f"Training failed due to worker errors:\n[Rank 1 Error Snippet]:\n{DEATH}\n"
    assert explain_worker_errors(WorkerGroupError(text, {})) == [lines[0]]
