"""A step's instrumentation: where each rank is (the heartbeat) and where its time goes (the
phase timer), told by one mechanism so that the step reads as the step.

Heartbeat phases (raytrain.rules.stall.PHASE_ORDER): data, forward, backward, optimizer — and,
outside the step, all_reduce, eval, report. Timer phases (progress.json's `phase_time_s`,
split by raytrain bench): data_wait, forward_backward, optimizer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from raytrain.rundir.heartbeats import Heartbeat

if TYPE_CHECKING:
    import torch

    from raytrain.rules.position import Telemetry


class PhaseTimer:
    """Splits a step's time into phases (data wait, forward+backward, optimizer); `totals`
    None: not timed (a warm-up step)."""

    def __init__(self, totals: dict[str, float] | None, sync: Callable[[], None]):
        self.totals, self.sync = totals, sync
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.totals is None:
            return
        self.sync()
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


class StepPhases:
    """Where one optimizer step is, told to what watches it: the heartbeat (a stalled
    collective names the phase each rank was in) and the phase timer (raytrain bench's
    split of the step time). `with phases("backward"):` marks the heartbeat as the phase
    begins; `timed="optimizer"` laps the timer as the block ends, so the timed blocks tile
    the step. A block that raises laps nothing."""

    def __init__(self, heartbeat: Heartbeat, step_index: int, timer: PhaseTimer):
        self.heartbeat, self.step_index, self.timer = heartbeat, step_index, timer
        self.current = "data"  # the last phase marked: where a failure happened

    def __call__(self, mark: str | None = None, *, timed: str | None = None) -> "_Block":
        return _Block(self, mark, timed)


class _Block:
    """One `with phases(...)` block: a plain class, not a generator context manager, as
    several run every step."""

    __slots__ = ("phases", "mark", "timed")

    def __init__(self, phases: StepPhases, mark: str | None, timed: str | None):
        self.phases, self.mark, self.timed = phases, mark, timed

    def __enter__(self) -> None:
        if self.mark is not None:
            self.phases.current = self.mark
            self.phases.heartbeat.mark(self.phases.step_index, self.mark)

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None and self.timed is not None:
            self.phases.timer.lap(self.timed)


class SteadyClock:
    """Times the steady steps (past --timing-warmup-steps) for the run's steady throughput. On a
    CPU a step is done when the host returns from it. On a GPU the host only queues the step's
    kernels and catches up at the next host sync (the log sync, a checkpoint), outside every
    step: a CUDA event recorded at each step's start and end is read once the sync has passed
    (`settle`), so a step counts what the GPU took, and no step waits for its own kernels."""

    def __init__(self, device: "torch.device"):
        self.on_gpu = device.type == "cuda"
        self.pending: list[tuple[object, object, int]] = []

    def start(self) -> object:
        if not self.on_gpu:
            return time.perf_counter()
        import torch

        begun = torch.cuda.Event(enable_timing=True)
        begun.record()
        return begun

    def stop(self, started: object, samples: int, telemetry: "Telemetry") -> None:
        if not self.on_gpu:
            telemetry.add_steady(samples, time.perf_counter() - started)
            return
        import torch

        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        self.pending.append((started, ended, samples))

    def settle(self, telemetry: "Telemetry") -> None:
        """Add the steps timed on the GPU since the last settle (call it after a host sync: their
        events are done, and waiting for them costs nothing)."""
        for started, ended, samples in self.pending:
            ended.synchronize()
            telemetry.add_steady(samples, started.elapsed_time(ended) / 1e3)
        self.pending.clear()
