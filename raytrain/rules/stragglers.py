"""Which rank every step waits for: stragglers named from the ranks' own step times.

In a synchronous step every rank's wall time is the same: the fast ones wait for the slow one
inside the gradient all-reduce. What differs is each rank's *own* time, the phases in which it
waits for no other rank: its data wait, its forward and its optimizer step (DDP's reduction
overlaps the backward, so a fast rank's backward holds its wait; the backward is left out).

Every rank sums its own time over the steps between two log syncs; the sync shares the sums
(`RankTimes`, one slot per rank in the sync's one all-reduce) and `StragglerWatch` judges them:
a rank whose own step time is more than --straggler-factor × the median of the others' is slow
for that window's steps; slow for --straggler-steps steps running, it is a straggler. The
watch says a straggler once, and again only when the picture changes: it waits for data
instead of computing slowly (or the reverse), or it is no longer slow. Under --evict-stragglers
a rank slow for --straggler-evict-steps steps running is evicted (`StragglerWatch.to_evict`):
every rank keeps the watch, on the same figures, and reaches that decision at the same sync.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# A straggler whose data wait is more than this share of its own step time waits for its input.
DATA_BOUND_FRACTION = 0.5


@dataclass(frozen=True)
class RankTimes:
    """One rank's own time over the steps of a log window: seconds computing (forward, optimizer
    step) and waiting for its data."""

    compute_s: float
    data_s: float
    steps: int

    @property
    def step_s(self) -> float:
        """Its own seconds per step."""
        return (self.compute_s + self.data_s) / self.steps if self.steps else 0.0

    @property
    def data_wait_fraction(self) -> float:
        total = self.compute_s + self.data_s
        return self.data_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class Straggler:
    """A rank named a straggler (or, `ended`, no longer one)."""

    rank: int
    host: str
    step_ratio: float  # its own step time over the median of the others'
    data_wait_fraction: float
    steps: int  # the steps running it has been slow
    ended: bool = False

    @property
    def cause(self) -> str:
        return "data" if self.data_wait_fraction > DATA_BOUND_FRACTION else "compute"

    def record(self) -> dict:
        """The figures of its "straggler" event."""
        return {
            "rank": self.rank,
            "host": self.host,
            "step_ratio": round(self.step_ratio, 3),
            "data_wait_fraction": round(self.data_wait_fraction, 3),
            "slow_steps": self.steps,
            "ended": self.ended,
        }

    def line(self, factor: float) -> str:
        """The console line."""
        where = f"rank {self.rank} (host {self.host})"
        if self.ended:
            return f"Straggler gone: {where} steps within {factor:g}× of the others again ({self.step_ratio:.2f}×)."
        if self.cause == "data":
            why = f"it waits for its data ({self.data_wait_fraction:.0%} of its step): its input is slow"
        else:
            why = (
                f"it computes slowly (data wait {self.data_wait_fraction:.0%} of its step): a slow or busy device "
                "or host"
            )
        return (
            f"Straggler: {where} takes {self.step_ratio:.1f}× the others' median step time for {self.steps} steps "
            f"running, and every step waits for it; {why}."
        )


def step_ratios(times: list[RankTimes]) -> list[float]:
    """Each rank's own step time over the median of the others' (1.0 for a lone rank, or where
    the others measured nothing)."""
    per_step = [t.step_s for t in times]
    ratios = []
    for rank, mine in enumerate(per_step):
        others = [s for r, s in enumerate(per_step) if r != rank and times[r].steps]
        median = statistics.median(others) if others else 0.0
        ratios.append(mine / median if median > 0 and times[rank].steps else 1.0)
    return ratios


@dataclass
class StragglerWatch:
    """The account of the ranks' own step times over the log windows that every rank keeps, on the
    same figures (see the module's docstring)."""

    factor: float
    steps_needed: int
    evict_after: int | None = None  # --straggler-evict-steps under --evict-stragglers (None: never)
    slow_steps: dict[int, int] = field(default_factory=dict)  # rank: steps running it has been slow
    said: dict[int, str] = field(default_factory=dict)  # rank: the cause last said of it
    evicted: set[int] = field(default_factory=set)  # ranks decided on (`to_evict` names each once)

    def observe(self, times: list[RankTimes], hosts: list[str]) -> list[Straggler]:
        """One log window's times, by rank; returns what changed: ranks newly named (or whose
        cause changed), and named ranks no longer slow (`ended`)."""
        changed = []
        for rank, ratio in enumerate(step_ratios(times)):
            host = hosts[rank] if rank < len(hosts) else "?"
            if ratio > self.factor:
                self.slow_steps[rank] = self.slow_steps.get(rank, 0) + times[rank].steps
            else:
                self.slow_steps.pop(rank, None)
            run = self.slow_steps.get(rank, 0)
            found = Straggler(rank, host, ratio, times[rank].data_wait_fraction, run)
            if run >= self.steps_needed and self.said.get(rank) != found.cause:
                self.said[rank] = found.cause
                changed.append(found)
            elif not run and rank in self.said:
                del self.said[rank]
                changed.append(Straggler(rank, host, ratio, times[rank].data_wait_fraction, 0, ended=True))
        return changed

    def to_evict(self) -> int | None:
        """The rank a straggler for --straggler-evict-steps steps running, the slowest first (None:
        none, or eviction not asked for). Every rank holds the same figures after a sync, so every
        rank finds the same one."""
        if self.evict_after is None:
            return None
        due = [
            (steps, rank)
            for rank, steps in self.slow_steps.items()
            if steps >= self.evict_after and rank not in self.evicted
        ]
        return max(due)[1] if due else None

    def forget(self) -> None:
        """A new quorum or attempt: the ranks are not the same workers."""
        self.slow_steps.clear()
        self.said.clear()
        self.evicted.clear()


def workers_left(rank: int, hosts: list[str], group_size: int = 1) -> int:
    """The workers an eviction of `rank` leaves, in any fault-tolerance mode: its host is kept out
    to the run's end, so a worker stays only if no worker of its group (`group_size` consecutive
    ranks: a per-step replica group; 1 under restart, whose group restarts at any size) is on
    that host. On a single host, none."""
    out = hosts[rank]
    groups = [hosts[start : start + group_size] for start in range(0, len(hosts), group_size)]
    return sum(len(group) for group in groups if out not in group)
