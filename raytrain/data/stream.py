"""A streamed dataset (`Stream`): a list of units known from metadata (`raytrain.data.shards`);
each epoch deals them to lanes (`raytrain.rules.order`), and each rank reads with Ray Data
only the units of its own lanes, checking every batch as it comes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from raytrain.data.checks import Schema, Unit, check_units, concat, num_rows, to_device
from raytrain.rules import order, steps


@dataclass
class Stream:
    """A dataset each rank reads its own units of (worker side); see raytrain.rules.order."""

    name: str
    units: Any  # raytrain.data.shards.Units
    layout: order.StreamLayout
    schema: Schema
    sample: dict[str, np.ndarray]  # one checked row, for a rank with no rows in a step
    skip_nan_rows: bool = False

    def __len__(self) -> int:
        return self.layout.num_rows

    def epoch(self, seed: int, epoch: int, start: int, rank: int, world_size: int) -> "StreamEpoch":
        return StreamEpoch(self, order.EpochPlan.build(self.layout, seed, epoch), rank, world_size, start)

    def eval_batches(
        self, rank: int, world_size: int, batch_size: int, device: torch.device, limit: int | None = None, seed: int = 0
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """The rows of this rank's units (`order.deal_units`) in batches; (0, one row) if none.
        With `limit`, the pass is the dataset's first `limit` rows in stored order (the units
        that hold them; the same rows every pass, at any worker count)."""
        unit_rows, keep = list(self.units.rows), {}
        if limit is not None and limit < sum(unit_rows):
            unit_rows, keep = _first_rows(unit_rows, limit)
        mine = order.deal_units(unit_rows, world_size)[rank]
        served = False
        pending: list[dict[str, np.ndarray]] = []
        for unit_id, unit in check_units(self.units, mine, self.name, self.schema, skip_nan_rows=self.skip_nan_rows):
            columns, valid = unit.columns, unit.valid
            if unit_id in keep:  # the unit the pass ends in: its first rows only
                columns = {c: v[: keep[unit_id]] for c, v in columns.items()}
                valid = None if valid is None else valid[: keep[unit_id]]
            pending.append(columns if valid is None else {c: v[valid] for c, v in columns.items()})
            rows = concat(pending)
            while num_rows(rows) >= batch_size:
                yield batch_size, to_device({c: v[:batch_size] for c, v in rows.items()}, device)
                served, rows = True, {c: v[batch_size:] for c, v in rows.items()}
            pending = [rows] if num_rows(rows) else []
        if pending:
            rows = concat(pending)
            yield num_rows(rows), to_device(rows, device)
        elif not served:
            yield 0, to_device(self.sample, device)


def _first_rows(unit_rows: list[int], limit: int) -> tuple[list[int], dict[int, int]]:
    """The units holding the first `limit` rows (later ones counted empty), and the unit the
    rows end in with the rows of it that are kept."""
    kept, total, keep = [], 0, {}
    for unit, rows in enumerate(unit_rows):
        take = max(0, min(rows, limit - total))
        kept.append(take)
        if 0 < take < rows:
            keep[unit] = take
        total += take
    return kept, keep


@dataclass
class StreamEpoch:
    """One epoch of a Stream on one rank: reads the units of its lanes in the order they are
    needed (one Ray Data execution), builds each lane's shuffled blocks, and serves the rows
    of every step that belong to its lanes."""

    stream: Stream
    plan: order.EpochPlan
    rank: int
    world_size: int
    start: int
    lanes: list[int] = field(init=False)
    units: dict[tuple[int, int], Unit] = field(init=False, default_factory=dict)
    blocks: dict[tuple[int, int], Unit] = field(init=False, default_factory=dict)
    skipped_rows: int = field(init=False, default=0)  # rows served as skipped (NaN/inf), this epoch

    def __post_init__(self):
        owners = order.lane_owners(self.plan.lane_rows, self.world_size)
        self.lanes = [lane for lane, owner in enumerate(owners) if owner == self.rank]
        self.reading = self.plan.read_order(self.lanes, self.start)
        self._source: Iterator[tuple[int, Unit]] | None = None

    def rows(self, step: steps.Step) -> list[tuple[int, int, int]]:
        """This rank's rows of `step`: (lane, lo, hi) lane positions."""
        return self.plan.segments(self.lanes, step.start, step.end)

    def batch(self, rows: list[tuple[int, int, int]], device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """Lane positions (increasing from call to call) as one batch and its count of valid
        rows; none: one row the caller weights 0."""
        pieces = []
        size = self.plan.layout.block_rows
        for lane, lo, hi in rows:
            for block in range(lo // size, (hi - 1) // size + 1):
                built = self._block(lane, block)
                a, b = max(lo, block * size) - block * size, min(hi, (block + 1) * size) - block * size
                piece = {c: v[a:b] for c, v in built.columns.items()}
                if built.valid is not None:
                    keep = built.valid[a:b]
                    self.skipped_rows += int((~keep).sum())
                    piece = {c: v[keep] for c, v in piece.items()}
                pieces.append(piece)
            self._drop_blocks_before(lane, hi // size)
        columns = concat(pieces) if pieces else {}
        count = num_rows(columns) if columns else 0
        return to_device(columns if count else self.stream.sample, device), count

    def _block(self, lane: int, block: int) -> Unit:
        key = (lane, block)
        if key in self.blocks:
            return self.blocks[key]
        size, starts = self.plan.layout.block_rows, self.plan.lane_unit_starts[lane]
        lo, hi = block * size, min(self.plan.lane_rows[lane], (block + 1) * size)
        touching = [i for i in range(len(starts) - 1) if starts[i] < hi and starts[i + 1] > lo]
        while any((lane, i) not in self.units for i in touching):
            self._read_next()
        pieces, valid = [], []
        for i in touching:
            unit = self.units[(lane, i)]
            a, b = max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i]
            pieces.append({c: v[a:b] for c, v in unit.columns.items()})
            valid.append(unit.valid[a:b] if unit.valid is not None else np.ones(b - a, dtype=bool))
            if starts[i + 1] <= hi:  # all its rows are in blocks built by now
                del self.units[(lane, i)]
        shuffled = self.plan.block_order(lane, block)
        columns = {c: v[shuffled] for c, v in concat(pieces).items()}
        mask = np.concatenate(valid)[shuffled]
        self.blocks[key] = Unit(columns, None if mask.all() else mask)
        return self.blocks[key]

    def _read_next(self) -> None:
        if self._source is None:
            ids = [self.plan.lane_units[lane][index] for lane, index in self.reading]
            self._where = {unit: (lane, index) for unit, (lane, index) in zip(ids, self.reading)}
            self._source = check_units(
                self.stream.units, ids, self.stream.name, self.stream.schema, skip_nan_rows=self.stream.skip_nan_rows
            )
        try:
            unit_id, unit = next(self._source)
        except StopIteration:
            raise RuntimeError(
                f"dataset {self.stream.name!r}: rank {self.rank} needed a unit it had already read past"
            ) from None
        self.units[self._where[unit_id]] = unit

    def _drop_blocks_before(self, lane: int, block: int) -> None:
        for key in [k for k in self.blocks if k[0] == lane and k[1] < block]:
            del self.blocks[key]
