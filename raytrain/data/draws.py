"""A sampled dataset on a worker (`Draws`): the pipeline's `raytrain.Sampled`, its rows drawn
at each step's positions (`raytrain.rules.steps.drawn_items`) and taken by its `take`. It serves
the loop as a `Table` does: an epoch of positions, each rank a contiguous slice of every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from raytrain.data.checks import check_columns, num_rows, to_device
from raytrain.errors import PipelineCodeError, UserError, user_frames
from raytrain.rules import steps
from raytrain.sampled import Sampled


@dataclass
class Draws:
    """A sampled dataset: `len()` is the draws of one epoch."""

    name: str
    spec: Sampled

    def __len__(self) -> int:
        return self.spec.rows_per_epoch

    def rows_of(self, items: np.ndarray) -> dict[str, np.ndarray]:
        """The pipeline's rows of `items` (its `take`), checked: numeric columns, one row per item."""
        try:
            columns = self.spec.take(items)
        except UserError:
            raise
        except Exception as exc:
            where = "".join(f"\n  at {frame}" for frame in user_frames(exc))
            raise PipelineCodeError(
                f"dataset {self.name!r}: its Sampled take raised {type(exc).__name__}: {exc}{where}"
            ) from exc
        if not isinstance(columns, dict) or not columns:
            raise PipelineCodeError(
                f"dataset {self.name!r}: its Sampled take must return a dict of arrays (one row per item), it returned "
                f"a {type(columns).__name__}"
            )
        columns = check_columns(columns, self.name, "rows from its Sampled take")
        if num_rows(columns) != len(items) or any(len(v) != len(items) for v in columns.values()):
            raise PipelineCodeError(
                f"dataset {self.name!r}: its Sampled take returned {num_rows(columns)} row(s) for {len(items)} "
                "item(s); return one row per item in every column"
            )
        return columns

    def epoch(self, seed: int, epoch: int, start: int, rank: int, world_size: int) -> "DrawsEpoch":
        return DrawsEpoch(self, seed, epoch, rank, world_size)

    def eval_batches(
        self, rank: int, world_size: int, batch_size: int, device: torch.device, limit: int | None = None, seed: int = 0
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """This rank's contiguous share of one validation pass — `limit` draws (default: an epoch's)
        from the validation stream of `seed`, the same every pass — in batches; (0, one row) when
        it has none."""
        total = len(self) if limit is None else limit
        start, end = steps.split_range(total, world_size)[rank]
        if start >= end:
            yield 0, to_device(self.rows_of(np.zeros(1, dtype=np.int64)), device)
        for lo in range(start, end, batch_size):
            hi = min(end, lo + batch_size)
            items = steps.drawn_items(self.spec.num_items, seed, 0, lo, hi, stream=steps.EVAL_DRAWS)
            yield hi - lo, to_device(self.rows_of(items), device)


class DrawsEpoch:
    """One epoch of draws: a step's positions are its rows; a rank takes a contiguous slice."""

    def __init__(self, draws: Draws, seed: int, epoch: int, rank: int, world_size: int):
        self.draws, self.seed, self.epoch_index, self.rank, self.world_size = draws, seed, epoch, rank, world_size

    def rows(self, step: steps.Step) -> list[tuple[int, int]]:
        return [steps.rank_rows(step, self.rank, self.world_size)]

    def batch(self, rows: list[tuple[int, int]], device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """The draws at these positions as one batch, and their count; for none, one row (weight 0)."""
        num_items = self.draws.spec.num_items
        pieces = [steps.drawn_items(num_items, self.seed, self.epoch_index, lo, hi) for lo, hi in rows]
        items = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        count = len(items)
        chosen = items if count else np.zeros(1, dtype=np.int64)
        return to_device(self.draws.rows_of(chosen), device), count
