"""What an attempt measures of itself (`Measures`), and a step's instrumentation: where each
rank is (the heartbeat) and where its time goes (the phase timer), told by one mechanism so
that the step reads as the step.

Heartbeat phases (raytrain.rules.stall.PHASE_ORDER): data, forward, backward, optimizer — and,
outside the step, all_reduce, eval, report. Timer phases (progress.json's `phase_time_s`,
split by raytrain bench): data_wait, forward_backward, optimizer.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from raytrain.instruments.window import Throughput
from raytrain.rules.position import Telemetry
from raytrain.rules.stragglers import RankTimes
from raytrain.rundir.heartbeats import Heartbeat

if TYPE_CHECKING:
    import torch


@dataclass
class Measures:
    """What one attempt measures of itself and tells: the heartbeat, the telemetry a checkpoint
    keeps (`raytrain.rules.position.Telemetry`), the throughput between metrics rows, the FLOPs
    of a sample (rank 0, once per attempt), and the bytes of this rank's state after the first
    step. The step machinery (`raytrain.worker.step.StepRunner`) holds it; it changes through
    its own methods."""

    heartbeat: Heartbeat
    device: "torch.device"
    time_phases: bool = False  # --time-phases: a GPU sync at each phase's end (raytrain bench)
    count_flops: bool = False  # rank 0 counts the FLOPs of its next micro-batch with rows (once per attempt)
    telemetry: Telemetry = field(default_factory=Telemetry)
    throughput: Throughput = field(default_factory=lambda: Throughput(time.perf_counter(), 0))
    # Bytes of this rank's state, after the attempt's first step, until said ({} once said).
    memory: dict[str, int] | None = None
    compiled_from: tuple[int, float] | None = None  # --compile: this process's graphs, compile seconds before
    compile_said: bool = False
    first_step: int = 0  # the attempt's first step: where it was restored
    own: "OwnTime" = field(init=False)  # this rank's own time since the last sync
    step_phases: "StepPhases" = field(init=False)  # the attempt's, moved to each step (`phases`)

    def __post_init__(self) -> None:
        self.own = OwnTime(on_gpu=self.device.type == "cuda")
        self.step_phases = StepPhases(self.heartbeat, 0, PhaseTimer(None, self.sync), self.own)

    def restore(self, train_state: dict[str, Any], samples_seen: int, step: int) -> None:
        """A checkpoint's telemetry, and the throughput counted from its position (`step`,
        `samples_seen`). Its compile figures were another attempt's processes': this one compiles
        again and counts its own."""
        self.telemetry = Telemetry.restored(train_state)
        self.telemetry.compile_graphs = self.telemetry.compile_s = None
        self.throughput = Throughput(time.perf_counter(), samples_seen)
        self.first_step = step

    def phases(self, step: int, timed: bool) -> "StepPhases":
        """The instrumentation of the step at `step` (the attempt's, made once); `timed`: a steady
        step, whose phase times add to the telemetry's."""
        phases, timer = self.step_phases, self.step_phases.timer
        phases.step_index, phases.current = step, "data"
        timer.totals, timer.last = self.telemetry.phase_time_s if timed else None, time.perf_counter()
        return phases

    @property
    def sync(self) -> Callable[[], None] | None:
        """What the phase timer calls at each lap: a GPU sync under --time-phases (GPU kernels run
        asynchronously: without it, phase times land on whatever waits next; it costs overlap),
        else None."""
        if self.time_phases and self.device.type == "cuda":
            import torch

            return lambda: torch.cuda.synchronize(self.device)
        return None

    @contextlib.contextmanager
    def counting_flops(self, rows: int, eager: Callable[[], Any]):
        """The FLOPs of this micro-batch's forward and backward, per row, into the telemetry
        (`raytrain.rules.flops`): rank 0, the first micro-batch with rows of an attempt, run
        eagerly (`eager()`: a compiled model compiles at its next call)."""
        if not self.count_flops or rows == 0:
            yield
            return
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        # Eager, under --compile too: Dynamo skips a frame first seen under a dispatch mode
        # and never compiles its code afterwards.
        with eager(), counter:
            yield
        self.count_flops = False
        self.telemetry.flops_per_sample = counter.get_total_flops() / rows
        device = self.device
        self.telemetry.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type

    def compiled(self) -> tuple[int, float] | None:
        """Under --compile, the graphs Dynamo built in this attempt and the seconds it compiled."""
        if self.compiled_from is None:
            return None
        from raytrain.parallel.strategy import graphs_built

        graphs, seconds = graphs_built() or self.compiled_from
        return graphs - self.compiled_from[0], seconds - self.compiled_from[1]

    def note_compiled(self, every: list[tuple[int, float]], files: Any, step: int) -> None:
        """Each rank's compile figures as a sync shared them (none without --compile), into the
        telemetry (summary.json's `compile`); said once, at the first sync after the attempt's
        second step: by then every rank has run a compiled step (rank 0's first micro-batch, whose
        FLOPs it counts, runs eager)."""
        if not every:
            return
        self.telemetry.compile_graphs = [graphs for graphs, _ in every]
        self.telemetry.compile_s = [round(seconds, 3) for _, seconds in every]
        if self.compile_said or step - self.first_step < 2:
            return
        from raytrain.rundir.records import Kind

        self.compile_said = True
        line = compile_line(self.telemetry.compile_graphs, self.telemetry.compile_s, step)
        files.event(
            Kind.COMPILE, line, step=step, graphs=self.telemetry.compile_graphs, seconds=self.telemetry.compile_s
        )

    def note_state(self, held: Callable[[], dict[str, int]]) -> None:
        """The bytes of this rank's state (`held()`), once: after the attempt's first step, when
        the gradients and the optimizer's state all exist."""
        if self.memory is None:
            self.memory = held()

    def synced(self, loss: float) -> None:
        """The mean loss over all ranks of a sync's window."""
        self.telemetry.last_loss = loss

    def lap(self, samples_seen: int) -> float:
        """Samples per second since the last metrics row."""
        return self.throughput.lap(samples_seen)

    def checkpointed(self, stall_s: float) -> None:
        """A checkpoint saved, the loop having waited `stall_s` for it."""
        self.telemetry.checkpoint_wait_s += stall_s
        self.telemetry.checkpoints += 1

    def validated(self, seconds: float, between_steps: bool) -> None:
        """A validation pass took `seconds` (goodput's account of it); `between_steps`: left out
        of the throughput too."""
        self.telemetry.validation_s += seconds
        if between_steps:
            self.throughput.since_time += seconds

    def say_memory(self, runtime: Any, files: Any, *, note: str = "") -> None:
        """Once per attempt, after its first step (a collective): the bytes each worker holds of the
        parameters, their gradients and the optimizer's state (`note`: the strategy's word on
        them, " (its shards)"), and each process's peak RSS (and on a GPU, the allocator's peak)."""
        import psutil
        import torch

        from raytrain.rundir.records import Kind

        mine, self.memory = {**(self.memory or {}), "peak_rss": _peak_rss_bytes(psutil.Process())}, {}
        if self.device.type == "cuda":  # what the GPU's allocator held at most: activations included
            mine["peak_gpu_allocated"] = torch.cuda.max_memory_allocated(self.device)
        every = runtime.all_gather_object(mine)
        held = ", ".join(
            f"{_mib(mine[k])} {label}"
            for k, label in (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"))
        )
        rss = ", ".join(_mib(rank["peak_rss"]) for rank in every)
        gpu = ", ".join(_mib(rank["peak_gpu_allocated"]) for rank in every if "peak_gpu_allocated" in rank)
        files.event(
            Kind.MEMORY,
            f"memory per worker after the first step: {held}{note}; "
            f"peak RSS by rank: {rss}" + (f"; peak GPU memory allocated by rank: {gpu}" if gpu else ""),
            **{key: [rank.get(key, 0) for rank in every] for key in mine},
        )


def compile_line(graphs: list[int], seconds: list[float], step: int) -> str:
    """What --compile did by step `step`, `graphs` built and `seconds` compiling by rank; a rank
    that built no graph runs eager, and is said to."""
    eager = [str(rank) for rank, count in enumerate(graphs) if count == 0]
    built = f"graphs built by rank: {', '.join(map(str, graphs))}"
    if not eager:
        return f"Compiled by step {step}: {built}, in {', '.join(f'{s:.1f}' for s in seconds)} s of compiling"
    return (
        f"Not compiled on rank {', '.join(eager)} by step {step}: --compile built no graph there, so it runs eager "
        f"({built}); TORCH_LOGS=graph_breaks says which frames Dynamo skipped or broke"
    )


def _peak_rss_bytes(process) -> int:
    import resource

    return max(process.memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


class PhaseTimer:
    """Splits a step's time into phases (data wait, forward+backward, optimizer); `totals`
    None: not timed (a warm-up step). `sync`: called at each lap first (None: nothing)."""

    def __init__(self, totals: dict[str, float] | None, sync: Callable[[], None] | None):
        self.totals, self.sync = totals, sync
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.totals is None:
            return
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


# The phases in which a rank waits for no other (under ddp; the backward holds the gradient
# all-reduce's wait for the slowest rank): its own time, which names stragglers.
OWN_PHASES = {"data": "data_s", "forward": "compute_s", "optimizer": "compute_s"}
# Device-timed blocks whose times wait unread before the done ones are read without waiting.
EVENTS_HELD = 64


@dataclass
class OwnTime:
    """This rank's own seconds since the last sync (`raytrain.rules.stragglers`) in the phases of
    OWN_PHASES, and the steps they cover. The data wait is the host's time. The compute phases
    are too on a CPU; on a GPU (`on_gpu`) the host only queues their kernels, and would wait for
    a slow device wherever a full launch queue or a sync stops it, on every rank alike (each
    device waits for the slowest in the all-reduce): a CUDA event at each compute block's start
    and end times what the device itself took, read at the sync (`take`), with no sync in the
    step."""

    compute_s: float = 0.0
    data_s: float = 0.0
    steps: int = 0
    on_gpu: bool = False
    pending: list[tuple[Any, Any]] = field(default_factory=list)  # (start, end) events not yet read

    def held(self, started: Any) -> None:
        """A compute block timed on the device, begun at the event `started`, ended well: read at
        the sync, or sooner once many wait."""
        self.pending.append((started, recorded_event()))
        if len(self.pending) >= EVENTS_HELD:
            self._read(wait=False)

    def _read(self, wait: bool) -> None:
        """The device times of the pending blocks into `compute_s`: the ones done (`wait`: all,
        waiting for the device, as the sync is about to)."""
        done = 0
        for started, ended in self.pending:
            if wait:
                ended.synchronize()
            elif not ended.query():
                break
            self.compute_s += started.elapsed_time(ended) / 1e3  # milliseconds
            done += 1
        del self.pending[:done]

    def take(self) -> RankTimes:
        """The figures so far, and a fresh start."""
        self._read(wait=True)
        taken = RankTimes(self.compute_s, self.data_s, self.steps)
        self.compute_s = self.data_s = 0.0
        self.steps = 0
        return taken


def recorded_event() -> Any:
    """A CUDA event recorded on the current stream, with timing."""
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepPhases:
    """Where one optimizer step is, told to what watches it: the heartbeat (a stalled
    collective names the phase each rank was in), the phase timer (raytrain bench's split of
    the step time) and the rank's own time (`OwnTime`). Its blocks are the step's phases:
    `with phases.backward:` marks the heartbeat as the phase begins, and a timed block laps the
    timer as it ends (data: data_wait; backward: forward_backward, since the data's lap;
    optimizer), so the timed blocks tile the step. A block that raises laps nothing."""

    def __init__(self, heartbeat: Heartbeat, step_index: int, timer: PhaseTimer, own: OwnTime | None = None):
        self.heartbeat, self.step_index, self.timer = heartbeat, step_index, timer
        self.own = own if own is not None else OwnTime()
        self.current = "data"  # the last phase marked: where a failure happened
        self.data, self.forward = _Block(self, "data", "data_wait"), _Block(self, "forward", None)
        self.backward = _Block(self, "backward", "forward_backward")
        self.optimizer = _Block(self, "optimizer", "optimizer")


class _Block:
    """One phase of a step (`StepPhases.data`, ...): a plain class, not a generator context
    manager, made once, as several run every step."""

    __slots__ = ("phases", "mark", "timed", "own", "on_device", "started")

    def __init__(self, phases: StepPhases, mark: str, timed: str | None):
        self.phases, self.mark, self.timed = phases, mark, timed
        self.own = OWN_PHASES.get(mark)  # the rank's own time it adds to (None: the backward's)
        self.on_device = phases.own.on_gpu and self.own == "compute_s"  # timed by CUDA events (`OwnTime`)
        self.started: Any = 0.0

    def __enter__(self) -> None:
        phases = self.phases
        phases.current = self.mark
        phases.heartbeat.mark(phases.step_index, self.mark)
        if self.own is not None:
            self.started = recorded_event() if self.on_device else time.perf_counter()

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            return
        if self.on_device:
            self.phases.own.held(self.started)
        elif self.own is not None:
            own = self.phases.own
            setattr(own, self.own, getattr(own, self.own) + time.perf_counter() - self.started)
        if self.timed is not None:
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
        return recorded_event() if self.on_gpu else time.perf_counter()

    def stop(self, started: object, samples: int, telemetry: "Telemetry") -> None:
        if not self.on_gpu:
            telemetry.add_steady(samples, time.perf_counter() - started)
            return
        self.pending.append((started, recorded_event(), samples))

    def settle(self, telemetry: "Telemetry") -> None:
        """Add the steps timed on the GPU since the last settle (call it after a host sync: their
        events are done, and waiting for them costs nothing)."""
        for started, ended, samples in self.pending:
            ended.synchronize()
            telemetry.add_steady(samples, started.elapsed_time(ended) / 1e3)
        self.pending.clear()
