"""Pure decisions for streamed datasets: which rows every step trains, and who reads them.

A streamed training set is a list of *units* — the pieces Ray Data can read on their own
(a Parquet row group or file, a read task, a block) — whose row counts are known from
metadata before anything is read. Each epoch:

1. the units are drawn in a new order (a permutation from `(seed, epoch)`) and dealt to
   `partitions` *lanes*, balancing rows (MosaicML Streaming's "canonical nodes": a fixed
   number that does not depend on the worker count);
2. each lane is a stream of its units, shuffled inside consecutive blocks of
   `ceil(window_rows / lanes)` rows, so a window of about `window_rows` rows is in flight
   across the job;
3. the lanes are interleaved in proportion to their rows (Sainte-Laguë order: lane L's
   j-th row sits at (j + ½) / rows_L of the epoch), so every lane ends with the epoch and
   every step draws from every lane;
4. optimizer step k trains epoch positions [k·G, (k+1)·G), and each lane belongs to one
   rank: a rank trains — and reads — only the rows of its lanes.

Which rows make up a step depends on (seed, epoch, the units, window_rows, partitions),
never on the worker count; the worker count decides only who holds which lane. The
position is one number (the epoch offset), and `lane_prefix` turns it into each lane's
offset, so a run continues at any worker count with exactly the rows not yet trained, and
a restarted rank skips whole units it no longer needs without reading them.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

# Keep these draws apart from each other and from `steps.epoch_order`'s.
_UNIT_ORDER, _BLOCK_ORDER = 101, 102


@dataclass(frozen=True)
class StreamLayout:
    """A streamed dataset as the driver saw it in metadata; fixed for the whole run."""

    unit_rows: tuple[int, ...]
    window_rows: int
    partitions: int

    def __post_init__(self):
        if not self.unit_rows or min(self.unit_rows) < 0 or sum(self.unit_rows) == 0:
            raise ValueError(f"a stream needs units with rows, got {self.unit_rows[:8]}")
        if self.window_rows < 1 or self.partitions < 1:
            raise ValueError(f"window_rows and partitions must be >= 1, got {self.window_rows}, {self.partitions}")

    @property
    def num_rows(self) -> int:
        return int(sum(self.unit_rows))

    @property
    def lanes(self) -> int:
        """Lanes actually used: no more than the units with rows, nor the window's rows."""
        return max(1, min(self.partitions, sum(1 for n in self.unit_rows if n), self.window_rows))

    @property
    def block_rows(self) -> int:
        """Rows shuffled together inside one lane."""
        return max(1, math.ceil(self.window_rows / self.lanes))

    @cached_property
    def unit_starts(self) -> np.ndarray:
        """Global id of each unit's first row (units in their stored order)."""
        return np.concatenate([[0], np.cumsum(self.unit_rows)[:-1]]).astype(np.int64)

    def digest(self) -> dict:
        """What a checkpoint's position depends on (compared on resume)."""
        return {
            "rows": self.num_rows,
            "units": len(self.unit_rows),
            "window_rows": self.window_rows,
            "partitions": self.partitions,
        }


@dataclass
class EpochPlan:
    """One epoch of a stream: the units of every lane, in order."""

    layout: StreamLayout
    seed: int
    epoch: int
    lane_units: list[list[int]]  # unit ids per lane, in the lane's stream order
    lane_rows: list[int]

    @classmethod
    def build(cls, layout: StreamLayout, seed: int, epoch: int) -> "EpochPlan":
        order = np.random.default_rng([seed, epoch, _UNIT_ORDER]).permutation(len(layout.unit_rows))
        lanes = layout.lanes
        heap = [(0, lane) for lane in range(lanes)]  # (rows so far, lane): the emptiest lane takes the next unit
        lane_units: list[list[int]] = [[] for _ in range(lanes)]
        for unit in order:
            rows = layout.unit_rows[unit]
            if not rows:
                continue
            total, lane = heapq.heappop(heap)
            lane_units[lane].append(int(unit))
            heapq.heappush(heap, (total + rows, lane))
        lane_rows = [sum(layout.unit_rows[u] for u in units) for units in lane_units]
        return cls(layout, seed, epoch, lane_units, lane_rows)

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    @cached_property
    def lane_unit_starts(self) -> list[np.ndarray]:
        """Offset of each of a lane's units in the lane's stream."""
        return [
            np.concatenate([[0], np.cumsum([self.layout.unit_rows[u] for u in units])]).astype(np.int64)
            for units in self.lane_units
        ]

    def prefix(self, position: int) -> list[int]:
        """Rows of each lane among the epoch's first `position` rows (they sum to `position`)."""
        return lane_prefix(self.lane_rows, position)

    def block_order(self, lane: int, block: int) -> np.ndarray:
        """The shuffled order of the rows of `block` inside `lane` (offsets within the block)."""
        size = self.layout.block_rows
        rows = min(size, self.lane_rows[lane] - block * size)
        return np.random.default_rng([self.seed, self.epoch, _BLOCK_ORDER, lane, block]).permutation(rows)

    def lane_stream_offsets(self, lane: int, lo: int, hi: int) -> np.ndarray:
        """Stream offsets (in the lane's unshuffled stream) of lane positions [lo, hi)."""
        size = self.layout.block_rows
        parts = []
        for block in range(lo // size, (hi - 1) // size + 1 if hi > lo else lo // size):
            a, b = max(lo, block * size) - block * size, min(hi, (block + 1) * size) - block * size
            parts.append(block * size + self.block_order(lane, block)[a:b])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def global_ids(self, lane: int, lo: int, hi: int) -> np.ndarray:
        """Global row ids (units in stored order) of lane positions [lo, hi): for checks."""
        offsets = self.lane_stream_offsets(lane, lo, hi)
        starts = self.lane_unit_starts[lane]
        index = np.searchsorted(starts, offsets, side="right") - 1
        units = np.asarray(self.lane_units[lane], dtype=np.int64)[index]
        return self.layout.unit_starts[units] + offsets - starts[index]

    def segments(self, lanes: Sequence[int], start: int, end: int) -> list[tuple[int, int, int]]:
        """The rows of epoch positions [start, end) that belong to `lanes`: (lane, lo, hi) each."""
        before, after = self.prefix(start), self.prefix(end)
        return [(lane, before[lane], after[lane]) for lane in lanes if after[lane] > before[lane]]

    def read_order(self, lanes: Sequence[int], start: int) -> list[tuple[int, int]]:
        """The units a rank holding `lanes` must read to train from epoch position `start`,
        as (lane, index in the lane), in the order they are first needed.

        Units wholly before the block each lane resumes in are skipped: after a restart
        nothing already trained is read again, but for the start of that one block.
        """
        size = self.layout.block_rows
        offsets = self.prefix(start)
        needed = []
        for lane in lanes:
            first_block = offsets[lane] // size
            starts = self.lane_unit_starts[lane]
            for index in range(len(self.lane_units[lane])):
                if starts[index + 1] <= first_block * size:
                    continue
                block = max(first_block, int(starts[index]) // size)
                # The block opens when the lane reaches its first row, at about this
                # fraction of the epoch; every unit it touches must be read by then.
                needed.append((block * size / self.lane_rows[lane], lane, index))
        return [(lane, index) for _, lane, index in sorted(needed)]


def lane_prefix(lane_rows: Sequence[int], position: int) -> list[int]:
    """How many rows of each lane come first among the first `position` rows of the epoch.

    Lanes are interleaved in Sainte-Laguë order: row j of lane L has the key
    (2j + 1) / (2 · rows_L), ties go to the lower lane, and the epoch is all rows sorted by
    key. The result is exact (integer arithmetic), sums to `position`, and only grows with
    `position`; every lane ends when the epoch ends.
    """
    rows = [int(n) for n in lane_rows]
    total = sum(rows)
    if position <= 0:
        return [0] * len(rows)
    if position >= total:
        return rows
    # Keys strictly below position / total: j < (2·position·rows_L − total) / (2·total).
    counts = [min(max(-((total - 2 * position * n) // (2 * total)), 0), n) for n in rows]
    have = sum(counts)
    # That threshold set is within len(rows) / 2 of `position`; settle the rest key by key.
    while have < position:  # add the smallest next key
        best = None
        for lane, n in enumerate(rows):
            if counts[lane] < n and (best is None or (2 * counts[lane] + 1) * rows[best] < (2 * counts[best] + 1) * n):
                best = lane
        counts[best] += 1
        have += 1
    while have > position:  # drop the largest key taken (of equal keys, the higher lane's)
        worst = None
        for lane, n in enumerate(rows):
            if counts[lane] > 0 and (
                worst is None or (2 * counts[lane] - 1) * rows[worst] >= (2 * counts[worst] - 1) * n
            ):
                worst = lane
        counts[worst] -= 1
        have -= 1
    return counts


def lane_owners(lane_rows: Sequence[int], world_size: int) -> list[int]:
    """The rank that reads and trains each lane: the largest lanes first, each to the rank
    with the fewest rows so far (ties to the lower rank)."""
    owners = [0] * len(lane_rows)
    heap = [(0, rank) for rank in range(world_size)]
    for lane in sorted(range(len(lane_rows)), key=lambda lane: (-lane_rows[lane], lane)):
        total, rank = heapq.heappop(heap)
        owners[lane] = rank
        heapq.heappush(heap, (total + lane_rows[lane], rank))
    return owners


def deal_units(unit_rows: Sequence[int], world_size: int) -> list[list[int]]:
    """Units per rank for evaluation (every unit to one rank, rows balanced), in stored order."""
    owners = lane_owners(list(unit_rows), world_size)
    return [
        [unit for unit, owner in enumerate(owners) if owner == rank and unit_rows[unit]] for rank in range(world_size)
    ]


def epoch_step_ids(
    layout: StreamLayout, seed: int, epoch: int, global_batch_size: int, start: int = 0
) -> list[np.ndarray]:
    """Global row ids trained by each step of an epoch from `start`, sorted within a step:
    the reference the tests and `raytrain bench` check a run against."""
    from raytrain.rules.steps import epoch_steps

    plan = EpochPlan.build(layout, seed, epoch)
    out = []
    for step in epoch_steps(layout.num_rows, global_batch_size, start):
        ids = [
            plan.global_ids(lane, lo, hi) for lane, lo, hi in plan.segments(range(layout.lanes), step.start, step.end)
        ]
        out.append(np.sort(np.concatenate(ids)))
    return out


def label_mix_distance(batch_labels: Sequence[np.ndarray], num_classes: int) -> float:
    """Shuffle quality: the mean total-variation distance between each batch's label mix and
    the whole epoch's (0 for perfectly mixed batches; 1 − 1/classes for one-label batches)."""
    every = np.concatenate(batch_labels)
    overall = np.bincount(every, minlength=num_classes) / len(every)
    distances = [
        0.5 * np.abs(np.bincount(b, minlength=num_classes) / len(b) - overall).sum() for b in batch_labels if len(b)
    ]
    return float(np.mean(distances))
