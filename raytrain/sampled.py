"""A dataset drawn rather than walked, as a pipeline declares it (`raytrain.Sampled`).

A walked dataset (a Ray Dataset, a torch Dataset) trains every row once per epoch, in a new
order each epoch. A sampled one trains fresh draws every step: `Sampled(num_items, take)`
draws items uniformly, with replacement, from `range(num_items)` and `take(items)` turns them
into rows — random windows of a token file (`Sampled.windows`) are the classic case
(nanoGPT's `get_batch`). The draws come from (seed, epoch, position in the epoch) alone, so
they are reproducible, the same after a resume, and the same at any worker count (the rows
of a step are split over the ranks as a walked step's are). What an epoch means stays: a
sampled epoch is `epoch_rows` draws (default `num_items`); exactly-once does not hold (docs/data.md).
Nothing here imports Ray or torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Sampled:
    """A dataset whose rows are drawn every step: `take(items)` gives the rows (a dict of numpy
    arrays, one row per item, one shape per column) of `items`, an int64 array of draws from
    `range(num_items)`. `take` runs on every worker: it must pickle (a module-level function or
    a callable object; `Sampled.windows` is one). `epoch_rows`: the draws of one (nominal) epoch
    — what --epochs, --warmup-epochs and the epoch's line count (default: `num_items`)."""

    num_items: int
    take: Callable[[np.ndarray], dict[str, Any]]
    epoch_rows: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_items, (int, np.integer)) or self.num_items < 1:
            raise ValueError(f"Sampled: num_items must be a positive integer, got {self.num_items!r}")
        if self.epoch_rows is not None and (not isinstance(self.epoch_rows, (int, np.integer)) or self.epoch_rows < 1):
            raise ValueError(f"Sampled: epoch_rows must be a positive integer, got {self.epoch_rows!r}")
        if not callable(self.take):
            raise ValueError(
                f"Sampled: take must be callable (items -> dict of arrays), got {type(self.take).__name__}"
            )

    @property
    def rows_per_epoch(self) -> int:
        return int(self.epoch_rows or self.num_items)

    @classmethod
    def windows(
        cls,
        tokens: "np.ndarray | str | os.PathLike",
        length: int,
        *,
        dtype: str = "uint16",
        column: str = "tokens",
        epoch_rows: int | None = None,
    ) -> "Sampled":
        """Random windows of `length` consecutive tokens (for a language model: block + 1, the
        inputs and the next-token targets) of a 1-D token array, or of a raw token file of
        `dtype` (nanoGPT's train.bin) that every worker maps from disk (give a path for large
        data: an array is copied to every worker). The column is int64."""
        take = TokenWindows(tokens, length, dtype=dtype, column=column)
        return cls(take.num_starts, take, epoch_rows)


class TokenWindows:
    """`take` for `Sampled.windows`: the windows starting at the drawn offsets. A file is mapped
    lazily in each process (the mapping is not pickled; the path is made absolute where the
    pipeline runs, as workers run in another directory)."""

    def __init__(self, tokens: "np.ndarray | str | os.PathLike", length: int, *, dtype: str, column: str):
        if isinstance(tokens, (str, os.PathLike)):
            self.path: str | None = os.path.abspath(os.path.expanduser(os.fspath(tokens)))
            self.array: np.ndarray | None = None
            if not os.path.isfile(self.path):
                raise ValueError(f"Sampled.windows: token file {self.path} not found")
            count = os.path.getsize(self.path) // np.dtype(dtype).itemsize
        else:
            self.path, self.array = None, np.asarray(tokens)
            if self.array.ndim != 1:
                raise ValueError(f"Sampled.windows: tokens must be 1-D, got shape {self.array.shape}")
            count = len(self.array)
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"Sampled.windows: length must be a positive integer, got {length!r}")
        if count < length:
            raise ValueError(f"Sampled.windows: {count} tokens are fewer than one window of {length}")
        self.length, self.dtype, self.column = int(length), dtype, column
        self.num_starts = count - self.length + 1
        self._mapped: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        if self.array is not None:
            return self.array
        if self._mapped is None:
            self._mapped = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._mapped

    def __call__(self, items: np.ndarray) -> dict[str, np.ndarray]:
        index = np.asarray(items, dtype=np.int64)[:, None] + np.arange(self.length)
        return {self.column: np.asarray(self.tokens()[index], dtype=np.int64)}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_mapped": None}
