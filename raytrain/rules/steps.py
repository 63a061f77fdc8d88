"""The rows of every step: the order of an epoch, its optimizer steps, each rank's share.

An epoch's order depends on (seed, epoch) and the dataset only, never on the worker count;
a step is a range of that order; a rank trains a contiguous slice of each step. That is
what lets an interrupted epoch continue at another worker count from one stored offset.
Pure: nothing here touches Ray or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def split_range(count: int, parts: int) -> list[tuple[int, int]]:
    """Split `count` items into `parts` contiguous ranges whose sizes differ by at most 1."""
    base, extra = divmod(count, parts)
    starts = [i * base + min(i, extra) for i in range(parts + 1)]  # the first `extra` ranges hold one more
    return list(zip(starts, starts[1:]))


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The global order of rows in `epoch`: a permutation of (seed, epoch) only, never of the worker count."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


# A sampled epoch's draws come in blocks of this many positions, each block from its own
# generator: any range of positions is drawn without drawing the epoch before it.
DRAW_BLOCK = 4096
TRAIN_DRAWS, EVAL_DRAWS = 0, 1  # the streams of draws: training epochs, and the validation pass


def drawn_items(num_items: int, seed: int, epoch: int, lo: int, hi: int, stream: int = TRAIN_DRAWS) -> np.ndarray:
    """The items at positions [lo, hi) of a sampled epoch: uniform draws, with replacement, from
    range(num_items), each block of DRAW_BLOCK positions from a generator of (seed, epoch,
    block, stream). They depend on the position alone — not on the worker count, the batch or
    where a run resumed — which is what makes a sampled run reproducible and resumable."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    pieces = []
    for block in range(lo // DRAW_BLOCK, (hi - 1) // DRAW_BLOCK + 1):
        rng = np.random.default_rng([seed, epoch, block, stream])
        draws = rng.integers(0, num_items, size=DRAW_BLOCK, dtype=np.int64)
        start = block * DRAW_BLOCK
        pieces.append(draws[max(lo, start) - start : min(hi, start + DRAW_BLOCK) - start])
    return np.concatenate(pieces)


@dataclass(frozen=True)
class Step:
    """One optimizer step of an epoch: rows [start, end) of the epoch's order."""

    index: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def epoch_steps(num_rows: int, global_batch_size: int, start_offset: int = 0) -> list[Step]:
    """The optimizer steps that train rows [start_offset, num_rows) of an epoch's order.

    Every row exactly once; the last step may be partial and is never dropped. The
    step count is the same on every rank because every rank computes it from the
    same numbers.
    """
    steps, offset = [], start_offset
    while offset < num_rows:
        steps.append(next_step(num_rows, global_batch_size, offset, index=len(steps)))
        offset = steps[-1].end
    return steps


def next_step(num_rows: int, global_batch_size: int, offset: int, index: int = 0) -> Step:
    """The step that trains the rows from `offset` on: the same rows as `epoch_steps` gives
    when the global batch stays the same. Per-step fault tolerance takes steps one at a time,
    as the global batch may change with the quorum (and an uncommitted step is taken again
    from the same offset)."""
    return Step(index=index, start=offset, end=min(num_rows, offset + global_batch_size))


def gradient_weight(count: int, world_size: int, step_size: int) -> float:
    """The factor on a rank's mean loss over its `count` rows of a step that makes DDP's mean
    over the `world_size` ranks (or a quorum's participants) the mean over the step's rows."""
    return count * world_size / step_size


def rank_rows(step: Step, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's slice [start, end) of a step's rows, in epoch-order offsets."""
    start, end = split_range(step.size, world_size)[rank]
    return step.start + start, step.start + end


def micro_batches(rows: list[tuple], parts: int) -> list[list[tuple]]:
    """A rank's rows of a step, as ranges whose last two fields are (lo, hi), cut into `parts`
    micro-batches of near-equal size (some may be empty)."""
    sizes = [r[-1] - r[-2] for r in rows]
    out: list[list[tuple]] = [[] for _ in range(parts)]
    taken = 0  # rows of `rows` handed out so far
    for part, (_, end) in enumerate(split_range(sum(sizes), parts)):
        while taken < end:
            offset = taken
            for r, size in zip(rows, sizes):
                if offset < size:
                    lo = r[-2] + offset
                    hi = min(r[-1], lo + end - taken)
                    out[part].append((*r[:-2], lo, hi))
                    taken += hi - lo
                    break
                offset -= size
    return out
