"""An in-memory dataset (`Table`): one Ray task read and checked it once; its columns sit in
Ray's object store, every worker maps them and draws a full permutation per epoch
(`raytrain.rules.steps.epoch_order`), taking its slice of every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from raytrain.data.checks import num_rows, to_device
from raytrain.rules import steps


@dataclass
class Table:
    """Columns of equal length, as numpy arrays."""

    columns: dict[str, np.ndarray]
    dropped_rows: int = 0  # rows skipped for NaN/inf (with skip_nan_rows)

    def __len__(self) -> int:
        return num_rows(self.columns) if self.columns else 0

    def batch(self, rows: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        return to_device({name: col[rows] for name, col in self.columns.items()}, device)

    def epoch(self, seed: int, epoch: int, start: int, rank: int, world_size: int) -> "TableEpoch":
        return TableEpoch(self, steps.epoch_order(len(self), seed, epoch), rank, world_size)

    def eval_batches(
        self, rank: int, world_size: int, batch_size: int, device: torch.device, limit: int | None = None, seed: int = 0
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """This rank's contiguous share of one validation pass in batches: (row count, batch);
        (0, one row) when it has none. The pass is every row, or with `limit` that many rows
        drawn once from `seed` (the same rows every pass, at any worker count)."""
        rows = np.arange(len(self))
        if limit is not None and limit < len(self):
            rows = np.sort(np.random.default_rng([seed, steps.EVAL_DRAWS]).permutation(len(self))[:limit])
        start, end = steps.split_range(len(rows), world_size)[rank]
        if start >= end:
            yield 0, self.batch(np.arange(0, 1), device)
        for lo in range(start, end, batch_size):
            hi = min(end, lo + batch_size)
            yield hi - lo, self.batch(rows[lo:hi], device)


class TableEpoch:
    """One epoch of a Table: positions index a full permutation of the rows; a rank takes a
    contiguous slice of every step."""

    def __init__(self, table: Table, permutation: np.ndarray, rank: int, world_size: int):
        self.table, self.order, self.rank, self.world_size = table, permutation, rank, world_size

    def rows(self, step: steps.Step) -> list[tuple[int, int]]:
        return [steps.rank_rows(step, self.rank, self.world_size)]

    def batch(self, rows: list[tuple[int, int]], device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """The rows as one batch and their count; for none, one row (the caller weights it 0)."""
        if len(rows) == 1:  # the common case, one contiguous slice: no concatenation
            index = self.order[rows[0][0] : rows[0][1]]
        else:
            index = np.concatenate([self.order[lo:hi] for lo, hi in rows]) if rows else np.zeros(0, dtype=np.int64)
        count = len(index)
        return self.table.batch(index if count else self.order[:1], device), count
