"""report.md's "Step time per rank" section and plots/ranks.png: which rank the steps waited for, and when.

In a synchronous step every rank's wall time is the same: a slow rank hides in the others'
waits, but not in its *own* time (data wait, forward, optimizer step: `raytrain.rules.stragglers`).
Every step row of a multi-worker run carries each rank's own seconds per step over its log
window (`RANK_STEP_S`, from `Watch.row_figures`); the world size may change, so a row's list is
as long as its world. Here they are gathered by rank over the run, tabulated and plotted, with
the run's straggler, eviction and replica-mismatch events.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from raytrain.observe.render import event_line, markdown_table
from raytrain.rundir.records import RANK_STEP_S, Event, Kind, MetricsRow
from raytrain.text import is_number

# The events of the faults a rank's step time tells of, listed under the table.
WATCHED = (Kind.STRAGGLER, Kind.EVICTED, Kind.REPLICA_MISMATCH)
# Above this many ranks the plot has no legend (the table names them).
LEGEND_RANKS = 10


def rank_times(rows: Sequence[MetricsRow]) -> tuple[list[int], list[list[float]]]:
    """The steps of the rows that carry `RANK_STEP_S`, in step order, and each rank's seconds
    per step at those steps (NaN where the rank was not in the run, or measured nothing)."""
    carrying = sorted(
        (row for row in rows if not row.epoch_end and isinstance(row.get(RANK_STEP_S), list)), key=lambda r: r.step
    )
    width = max((len(row.get(RANK_STEP_S)) for row in carrying), default=0)
    series = [[math.nan] * len(carrying) for _ in range(width)]
    for index, row in enumerate(carrying):
        for rank, seconds in enumerate(row.get(RANK_STEP_S)):
            if is_number(seconds) and seconds > 0:
                series[rank][index] = float(seconds)
    return [row.step for row in carrying], series


def rank_section(rows: Sequence[MetricsRow], events: Sequence[Event], start: float | None) -> list[str]:
    """report.md's "Step time per rank": a row per rank (its median and slowest own step time
    over the run, its median over the median of every rank's), then the straggler, eviction and
    replica-mismatch events; nothing for a run with neither."""
    steps, series = rank_times(rows)
    every = {rank: [(s, v) for s, v in zip(steps, values) if not math.isnan(v)] for rank, values in enumerate(series)}
    measured = {rank: points for rank, points in every.items() if points}
    watched = [e for e in events if e.kind in WATCHED]
    if not measured and not watched:
        return []
    lines = ["## Step time per rank", ""]
    if measured:
        medians = {rank: statistics.median(v for _, v in points) for rank, points in measured.items()}
        overall = statistics.median(medians.values())
        cells = []
        for rank, points in measured.items():
            slowest_step, slowest = max(points, key=lambda point: point[1])
            first, last = points[0][0], points[-1][0]
            cells.append(
                [
                    rank,
                    f"{first:,}–{last:,}" if first < last else f"{last:,}",
                    f"{medians[rank] * 1e3:,.1f}",
                    f"{slowest * 1e3:,.1f} (step {slowest_step:,})",
                    f"{medians[rank] / overall:.2f}×" if overall > 0 else "",
                ]
            )
        lines += [
            "Each rank's own time per step (its data wait, forward and optimizer step: the phases in which it "
            "waits for no other rank), per logged window. Every step waits for the slowest rank.",
            "",
            *markdown_table(["rank", "steps", "median ms", "max ms", "median / all ranks' median"], cells),
            "",
        ]
    if watched:
        lines += [event_line(e, start or 0) for e in watched]
        lines.append("")
    return lines


def plot_rank_times(rows: Sequence[MetricsRow], events: Sequence[Event], figure: Any) -> bool:
    """plots/ranks.png: each rank's own step time against the step, straggler events marked
    (False, nothing drawn, when no row carries the figures)."""
    steps, series = rank_times(rows)
    if not steps:
        return False
    axes = figure.add_subplot()
    for rank, values in enumerate(series):
        label = f"rank {rank}" if len(series) <= LEGEND_RANKS else None
        axes.plot(steps, [v * 1e3 for v in values], ".-", linewidth=1, markersize=3, label=label)
    named = [e for e in events if e.kind == Kind.STRAGGLER and not e.get("ended") and is_number(e.step)]
    for index, event in enumerate(named):
        label = "straggler named" if index == 0 else None
        axes.axvline(event.step, color="tab:red", linewidth=1, linestyle="--", alpha=0.6, zorder=0, label=label)
    axes.set(title="Own step time per rank", xlabel="optimizer step", ylabel="ms per step")
    axes.set_ylim(bottom=0)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small", ncol=1 + len(series) // 6)
    axes.grid(alpha=0.3)
    return True
