"""What a rank sees of its training between two syncs, and the sync that shares it.

Steps add their loss to a `LossWindow` on the device, without a host sync. Every
--log-every-steps steps (and at an epoch's end, and before every checkpoint) all ranks
`sync`: one collective gives the sample-weighted mean loss over all ranks, whether anyone
was asked to stop, whether any rank saw a NaN/inf loss or gradient norm, and each rank's own
step time (`raytrain.rules.stragglers`), and under --compile the graphs each rank built. A non-finite
loss ends the run there (`TrainingDiverged`), before any checkpoint saves its weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from raytrain.errors import EXIT_FAILED, UserError
from raytrain.instruments import notice as notices
from raytrain.rules import agreement
from raytrain.rules.stragglers import RankTimes
from raytrain.rundir.files import DriverGone
from raytrain.text import sci

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.rundir.heartbeats import Heartbeat
    from raytrain.worker.runtime import Runtime


class TrainingDiverged(UserError, FloatingPointError):
    """A NaN/inf training loss: retrying from the last checkpoint would diverge the same way,
    so it is never retried; the run failed (status "diverged", exit status 1)."""

    exit_status = EXIT_FAILED


# Losses wait in a list and are summed on the device this many at a time: a step costs a
# list append instead of a handful of tiny kernels (benchmarks/RESULTS.md, section 15).
FOLD_EVERY = 64


@dataclass
class LossWindow:
    """This rank's steps since the last sync: the sample-weighted training loss, and the first
    step whose loss or gradient norm was NaN/inf (inf: none). On the device: a step adds to
    it without a host sync (its detached loss waits in a list, summed on the device every
    FOLD_EVERY entries and when read); `sync` reads and clears it."""

    device: torch.device
    folded_sum: torch.Tensor
    folded_bad_step: torch.Tensor
    loss_count: int = 0
    pending: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (value, samples, step)

    @classmethod
    def on(cls, device: torch.device) -> "LossWindow":
        return cls(device, *cls._empty(device))

    @staticmethod
    def _empty(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros((), device=device), torch.full((), math.inf, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, count: int, step_index: int) -> None:
        """A micro-batch's loss over `count` samples (a non-finite one is noted, not summed)."""
        self.loss_count += count
        self.note_if_bad(loss, step_index, count)

    def note_if_bad(self, value: torch.Tensor, step_index: int, count: int = 0) -> None:
        """Note the step if `value` (a loss, a gradient norm; one element) is NaN/inf."""
        value = value.detach()
        self.pending.append((value.reshape(()) if value.dim() else value, count, step_index))
        if len(self.pending) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """The pending values into the device sums: a few kernels, no host sync (the counts and
        steps reach the device by an asynchronous copy). New tensors, so a snapshot stays valid."""
        if not self.pending:
            return
        values = torch.stack([v for v, _, _ in self.pending]).float()  # stack promotes mixed dtypes
        counts = torch.tensor([c for _, c, _ in self.pending], dtype=torch.float32)
        at = torch.tensor([s for _, _, s in self.pending], dtype=torch.float64)
        counts, at = counts.to(self.device, non_blocking=True), at.to(self.device, non_blocking=True)
        finite = torch.isfinite(values)
        self.folded_sum = self.folded_sum + (torch.where(finite, values, 0.0) * counts).sum()
        first = torch.where(finite, math.inf, at).min()
        self.folded_bad_step = torch.minimum(self.folded_bad_step, first)
        self.pending = []

    @property
    def loss_sum(self) -> torch.Tensor:
        self._fold()
        return self.folded_sum

    @property
    def first_bad_step(self) -> torch.Tensor:
        self._fold()
        return self.folded_bad_step

    def clear(self) -> None:
        self.folded_sum, self.folded_bad_step = self._empty(self.device)
        self.loss_count, self.pending = 0, []

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, int, list]:
        return self.folded_sum, self.folded_bad_step, self.loss_count, list(self.pending)

    def restore(self, saved: tuple[torch.Tensor, torch.Tensor, int, list]) -> None:
        """Back to `snapshot`: a step that was not committed counts for nothing."""
        self.folded_sum, self.folded_bad_step, self.loss_count, pending = saved
        self.pending = list(pending)

    def mean_loss(self) -> float | None:
        """This rank's mean loss so far (a host sync; rank 0's live row only)."""
        return float(self.loss_sum.item()) / self.loss_count if self.loss_count else None


class Synced(NamedTuple):
    """What a sync shares (`sync`)."""

    loss: float  # the sample-weighted mean training loss over all ranks since the last sync
    count: int  # the samples it covers
    stop: bool  # a rank was asked to stop
    diverged: dict[int, int]  # {rank: first step whose loss or gradient norm was NaN/inf}; empty when all is well
    times: list[RankTimes]  # each rank's own time over the window's steps (raytrain.rules.stragglers)
    hosts: list[str]  # each rank's node address (IPv4; "?" for another kind)
    # --compile: each rank's graphs built and seconds compiling; [] without, or where a reduction lost a rank's
    compiled: list[tuple[int, float]]
    # {rank: its preemption notice, what gave it and its seconds left (`raytrain.instruments.notice.Leaving`)}
    # of the ranks with one; empty when none has one
    leaving: dict[int, notices.Leaving]


class OwnFigures(Protocol):
    """A rank's own time since the last sync (`raytrain.instruments.phases.OwnTime`)."""

    def take(self) -> RankTimes: ...


def sync(
    runtime: "Runtime",
    heartbeat: "Heartbeat",
    window: LossWindow,
    step: int,
    stop_requested: bool = False,
    own: "OwnFigures | None" = None,
    host: int = 0,
    compiled: tuple[int, float] | None = None,
    driver_gone: str | None = None,
    notice: notices.Notice | None = None,
) -> Synced:
    """One collective at the logging cadence (every rank calls it at the same steps, after the
    step to `step`): the mean loss, whether to stop, the ranks that diverged, every rank's own
    time (`own`: this rank's since the last call, taken) and its host (`host`: this rank's IPv4
    address as an integer, `raytrain.rules.agreement.ipv4`) and, under --compile, its graphs
    built and seconds compiling (`compiled`: the same on every rank, given or not). The window is
    cleared. `notice`: this rank's preemption notice (None: none).
    A driver gone (`driver_gone`: why, rank 0's look) ends the attempt on every rank here
    (DriverGone), before the metrics row or a checkpoint is written."""
    # In the step just taken; from here on a GPU waits for its device, which may wait in the
    # all-reduce for a stalled peer.
    heartbeat.mark(step - 1, "all_reduce")
    world, rank = runtime.world_size, runtime.world_rank
    # Sum-reduce: each rank fills only its own slots of the per-rank vectors (others 0).
    slots = [0.0] * world
    # A bad step as step + 1: a slot left 0 is a rank with none, or one a failed reduction lost
    # (per-step: its own group's figures only), never a divergence at step 0.
    bad = float(window.first_bad_step.item())
    slots[rank] = bad + 1.0 if math.isfinite(bad) else 0.0
    mine = own.take() if own is not None else RankTimes(0.0, 0.0, 0)
    times = [0.0] * (3 * world)
    times[3 * rank : 3 * rank + 3] = [mine.compute_s, mine.data_s, float(mine.steps)]
    hosts = agreement.to_slots(host, rank, world)
    leaving = notices.slots(notice, rank, world, time.time())
    compiles = [0.0] * (2 * world if compiled is not None else 0)
    if compiled is not None:  # graphs + 1: a slot left 0 is a rank whose figures a failed reduction lost
        compiles[2 * rank : 2 * rank + 2] = [compiled[0] + 1.0, compiled[1]]
    totals = runtime.all_reduce_sum(
        [float(window.loss_sum.item()), float(window.loss_count), float(stop_requested), *slots, *times, *hosts]
        + compiles
        + leaving
        + [float(driver_gone is not None)]
    )
    totals, gone = totals[:-1], totals[-1] > 0
    totals, noticed = totals[: len(totals) - world], totals[len(totals) - world :]
    if gone:
        why = driver_gone or "rank 0 found this attempt's driver gone"
        raise DriverGone(f"{why}; this attempt stops without writing more")
    total, count, stop = totals[0], int(totals[1]), totals[2] > 0
    bad_steps, shared = totals[3 : 3 + world], totals[3 + world : 3 + 4 * world]
    window.clear()
    diverged = {r: int(bad) - 1 for r, bad in enumerate(bad_steps) if bad > 0}
    ranks = [RankTimes(shared[3 * r], shared[3 * r + 1], int(shared[3 * r + 2])) for r in range(world)]
    addresses = [agreement.address(value) for value in agreement.from_slots(totals[3 + 4 * world :], world)]
    shared_compiles = totals[len(totals) - len(compiles) :] if compiles else []
    built = [(int(shared_compiles[2 * r]) - 1, shared_compiles[2 * r + 1]) for r in range(world)] if compiles else []
    if any(graphs < 0 for graphs, _ in built):  # per-step: some replica's figures missing, none said from this sync
        built = []
    return Synced(
        (total / count if count else float("nan")), count, stop, diverged, ranks, addresses, built,
        notices.leaving(noticed),
    )  # fmt: skip


def divergence_message(
    diverged: dict[int, int], stopped_at: int, *, lr: float, peak_lr: float, precision: str, last_good: str | None
) -> str:
    """The sentence a diverged run ends with: where, what was saved, and what to change."""
    step = min(diverged.values())
    ranks = ", ".join(str(r) for r, s in sorted(diverged.items()) if s == step)
    if precision == "fp16":
        other_precision = " or train in bf16 or fp32 instead of fp16 (--precision)"
    elif precision == "bf16":
        other_precision = " or use --precision fp32"
    else:
        other_precision = ""
    return (
        f"The training loss became NaN or inf at step {step} on rank {ranks}; the run stopped at step {stopped_at} "
        f"and saved nothing from these weights. Last good checkpoint: {last_good or 'none yet'}. Lower the learning "
        f"rate (--lr, now {sci(lr)}, peak {sci(peak_lr)}; or a longer --warmup-epochs){other_precision}, "
        "then --resume continues from that checkpoint"
    )


@dataclass
class Throughput:
    """Samples per second from one metrics row to the next."""

    since_time: float
    since_samples: int

    def lap(self, samples_seen: int) -> float:
        now = time.perf_counter()
        rate = (samples_seen - self.since_samples) / max(1e-9, now - self.since_time)
        self.since_time, self.since_samples = now, samples_seen
        return rate
