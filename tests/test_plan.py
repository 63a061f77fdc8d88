"""The pure rules of `raytrain.rules.batch`: batch plan, LR scaling and schedule, data order.

These are the invariants of DESIGN.md that need no Ray: every row exactly once per
epoch, the same step count on every rank, a new order each epoch, warmup counted in
samples, and a resume at another worker count that neither repeats nor skips a row.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from raytrain.rules.batch import BatchPlan, default_reference_batch_size, lr_scale, resolve_batch_plan
from raytrain.rules.schedule import LRSchedule
from raytrain.rules.steps import Step, epoch_order, epoch_steps, micro_batches, rank_rows, split_range

# -- batch plan ------------------------------------------------------------------------------


def shares(plan: BatchPlan, rows_in_step: int | None = None) -> list[int]:
    """The samples each rank trains in a step of `rows_in_step` samples (default: a full one)."""
    return [hi - lo for lo, hi in split_range(rows_in_step or plan.global_batch_size, plan.world_size)]


def test_global_batch_divisible():
    p = resolve_batch_plan(8, global_batch_size=256)
    assert p == BatchPlan(global_batch_size=256, world_size=8, accumulation_steps=1)
    assert shares(p) == [32] * 8
    assert p.describe() == "global 256 = 8 workers × 32 per worker × 1 accumulation step"


def test_global_batch_not_divisible():
    p = resolve_batch_plan(3, global_batch_size=64)
    assert shares(p) == [22, 21, 21]
    assert (p.per_worker_min, p.per_worker_max) == (21, 22)
    assert p.describe() == "global 64 = 3 workers × 21–22 per worker × 1 accumulation step"


def test_global_batch_is_fixed_whatever_the_worker_count():
    for world_size in range(1, 17):
        p = resolve_batch_plan(world_size, global_batch_size=256)
        assert p.global_batch_size == 256
        assert sum(shares(p)) == 256


def test_single_worker_wording():
    assert (
        resolve_batch_plan(1, global_batch_size=32).describe()
        == "global 32 = 1 worker × 32 per worker × 1 accumulation step"
    )


def test_per_worker_mode_grows_with_the_workers():
    for world_size in (1, 2, 3, 8):
        p = resolve_batch_plan(world_size, batch_size_per_worker=32)
        assert p.global_batch_size == 32 * world_size
        assert shares(p) == [32] * world_size
    assert (
        resolve_batch_plan(4, batch_size_per_worker=32).describe()
        == "global 128 = 4 workers × 32 per worker × 1 accumulation step"
    )


def one_range(begin: int, end: int, parts: int) -> list[tuple[int, int]]:
    """The production split (`micro_batches`) of one range of rows, as (lo, hi) per part."""
    out, at = [], begin
    for piece in micro_batches([(begin, end)], parts):
        lo, hi = piece[0] if piece else (at, at)
        out.append((lo, hi))
        at = hi
    return out


@pytest.mark.parametrize(
    "world_size, global_batch, micro, steps",
    [
        (2, 64, 32, 1),
        (2, 64, 16, 2),
        (2, 64, 10, 4),
        (1, 256, 64, 4),
        (3, 64, 11, 2),
        (3, 64, 22, 1),
        (3, 64, 21, 2),
        (8, 64, 100, 1),
    ],
)
def test_micro_batch_size_sets_accumulation(world_size, global_batch, micro, steps):
    p = resolve_batch_plan(world_size, global_batch_size=global_batch, micro_batch_size=micro)
    assert p.accumulation_steps == steps
    assert p.global_batch_size == global_batch  # accumulation never changes what the optimizer sees
    for rank in range(world_size):
        parts = one_range(0, shares(p)[rank], p.accumulation_steps)
        assert max(b - a for a, b in parts) <= micro


def test_micro_batch_with_per_worker_mode_and_plural_wording():
    p = resolve_batch_plan(2, batch_size_per_worker=64, micro_batch_size=16)
    assert p.accumulation_steps == 4
    assert p.describe() == "global 128 = 2 workers × 64 per worker × 4 accumulation steps"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0, "global_batch_size": 8}, "world_size must be >= 1"),
        ({"world_size": 2}, "set exactly one"),
        ({"world_size": 2, "global_batch_size": 8, "batch_size_per_worker": 4}, "set exactly one"),
    ],
)
def test_batch_plan_rejects_internal_misuse(kwargs, match):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        resolve_batch_plan(world_size, **kwargs)


def test_rank_shares_of_a_partial_step():
    p = resolve_batch_plan(4, global_batch_size=64)
    assert shares(p, 6) == [2, 2, 1, 1]
    assert shares(p, 2) == [1, 1, 0, 0]


# -- learning rate ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule, global_batch, reference, factor",
    [
        ("linear", 256, 32, 8.0),
        ("linear", 32, 32, 1.0),
        ("linear", 16, 32, 0.5),
        ("sqrt", 256, 64, 2.0),
        ("sqrt", 128, 32, 2.0),
        ("sqrt", 32, 32, 1.0),
        ("none", 256, 32, 1.0),
        ("none", 1, 1024, 1.0),
    ],
)
def test_lr_scale(rule, global_batch, reference, factor):
    assert lr_scale(rule, global_batch, reference) == pytest.approx(factor)


def test_lr_scale_unknown_rule():
    with pytest.raises(ValueError, match="unknown lr scaling rule 'cubic'"):
        lr_scale("cubic", 64, 32)


@pytest.mark.parametrize("rule", ["linear", "sqrt", "none"])
def test_schedule_cosine_with_warmup(rule):
    base = 1e-3
    peak = base * lr_scale(rule, 256, 32)
    lr = LRSchedule("cosine", peak, base, warmup_samples=1000, total_samples=5000).lr
    assert lr(0) == pytest.approx(base)
    assert lr(500) == pytest.approx((base + peak) / 2)
    assert lr(1000) == pytest.approx(peak)
    assert lr(3000) == pytest.approx(peak / 2)  # cosine midpoint
    assert lr(5000) == pytest.approx(0.0, abs=1e-15)
    assert lr(6000) == pytest.approx(0.0, abs=1e-15)  # past the end it stays at 0


@pytest.mark.parametrize("rule", ["linear", "sqrt", "none"])
def test_schedule_constant_with_warmup(rule):
    base = 2e-3
    peak = base * lr_scale(rule, 512, 64)
    lr = LRSchedule("constant", peak, base, warmup_samples=640, total_samples=6400).lr
    assert lr(0) == pytest.approx(base)
    assert lr(320) == pytest.approx((base + peak) / 2)
    assert lr(640) == pytest.approx(peak)
    assert lr(3200) == pytest.approx(peak)
    assert lr(6400) == pytest.approx(peak)


def test_schedule_without_warmup_starts_at_peak():
    lr = LRSchedule("cosine", 8e-3, 1e-3, warmup_samples=0, total_samples=1000).lr
    assert lr(0) == pytest.approx(8e-3)
    assert lr(500) == pytest.approx(4e-3)
    assert lr(1000) == pytest.approx(0.0, abs=1e-15)


def test_lr_is_monotone_in_warmup_then_decay():
    lr = LRSchedule("cosine", 4e-3, 1e-3, warmup_samples=1000, total_samples=4000).lr
    values = [lr(s) for s in range(0, 4001, 50)]
    warm, decay = values[:21], values[20:]
    assert all(a <= b for a, b in zip(warm, warm[1:]))
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_warmup_is_keyed_to_samples_not_steps():
    """Stepping with global batch 32 or 128 gives the same lr at the same samples_seen."""
    lr = LRSchedule("cosine", 8e-3, 1e-3, warmup_samples=1437, total_samples=1437 * 5).lr
    small = {s: lr(s) for s in range(0, 1437 * 5, 32)}
    large = {s: lr(s) for s in range(0, 1437 * 5, 128)}
    common = sorted(set(small) & set(large))
    assert len(common) > 10
    assert [small[s] for s in common] == [large[s] for s in common]
    # and the warmup ends at the same sample count, not after a fixed number of steps
    assert lr(1437) == pytest.approx(8e-3)
    assert lr(1436) < 8e-3


def test_default_reference_batch_size():
    assert default_reference_batch_size(8, batch_size_per_worker=32) == 32
    assert default_reference_batch_size(1, batch_size_per_worker=16) == 16
    assert default_reference_batch_size(8, global_batch_size=256) == 32
    assert default_reference_batch_size(3, global_batch_size=100) == 34
    assert default_reference_batch_size(0, global_batch_size=64) == 64  # local mode: one process
    assert default_reference_batch_size(128, global_batch_size=64) == 1


def test_default_reference_makes_lr_of_the_single_gpu_recipe():
    """global 256 on up to 8 workers: the reference is 32, so the scaled peak is lr × 8."""
    reference = default_reference_batch_size(8, global_batch_size=256)
    assert lr_scale("linear", 256, reference) == pytest.approx(8.0)


# -- data order -------------------------------------------------------------------------------


def test_epoch_order_is_a_seeded_permutation():
    first = epoch_order(1001, seed=7, epoch=3)
    assert np.array_equal(np.sort(first), np.arange(1001))
    assert np.array_equal(first, epoch_order(1001, seed=7, epoch=3))
    assert not np.array_equal(first, epoch_order(1001, seed=7, epoch=4))
    assert not np.array_equal(first, epoch_order(1001, seed=8, epoch=3))


def test_every_epoch_has_a_different_order():
    orders = {tuple(epoch_order(100, seed=0, epoch=e)) for e in range(20)}
    assert len(orders) == 20


def test_split_range():
    assert split_range(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_range(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert split_range(0, 2) == [(0, 0), (0, 0)]


def test_epoch_steps_keeps_the_partial_last_step():
    assert epoch_steps(10, 4) == [Step(0, 0, 4), Step(1, 4, 8), Step(2, 8, 10)]
    assert epoch_steps(10, 4, start_offset=6) == [Step(0, 6, 10)]
    assert epoch_steps(10, 4, start_offset=10) == []
    assert epoch_steps(3, 64) == [Step(0, 0, 3)]


def rows_per_rank(num_rows: int, global_batch: int, world_size: int, accumulation: int = 1, start: int = 0):
    """For each rank, the epoch-order offsets it trains on, step by step (via micro-batches)."""
    steps = epoch_steps(num_rows, global_batch, start)
    seen: list[list[int]] = [[] for _ in range(world_size)]
    step_counts = [0] * world_size
    for rank in range(world_size):
        for step in steps:  # what every rank computes on its own
            step_counts[rank] += 1
            begin, end = rank_rows(step, rank, world_size)
            parts = one_range(begin, end, accumulation)
            assert parts[0][0] == begin and parts[-1][1] == end
            assert all(a <= b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
            for a, b in parts:
                seen[rank].extend(range(a, b))
    return seen, step_counts


GRID = [
    # (rows, global batch, world size)
    (1001, 64, 3),
    (1001, 96, 3),
    (1001, 1001, 3),
    (1001, 2000, 3),
    (7, 4, 2),
    (7, 7, 2),
    (3, 8, 5),  # fewer rows than workers
    (1, 4, 4),
    (100, 10, 3),  # global batch not divisible by world size
    (100, 7, 4),
    (1437, 256, 8),
    (1437, 250, 6),
    (64, 64, 1),
    (65, 8, 8),
]


@pytest.mark.parametrize("rows, global_batch, world_size", GRID)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_every_row_exactly_once_and_same_step_count(rows, global_batch, world_size, accumulation):
    seen, step_counts = rows_per_rank(rows, global_batch, world_size, accumulation)
    union = [offset for rank_rows_ in seen for offset in rank_rows_]
    assert sorted(union) == list(range(rows))  # none dropped, none duplicated
    assert len(set(step_counts)) == 1
    assert step_counts[0] == math.ceil(rows / global_batch)


@pytest.mark.parametrize("rows, global_batch, world_size", GRID)
def test_rank_slices_are_balanced(rows, global_batch, world_size):
    for step in epoch_steps(rows, global_batch):
        sizes = [b - a for a, b in (rank_rows(step, r, world_size) for r in range(world_size))]
        assert sum(sizes) == step.size
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "rows, before, after, stop_after_steps",
    [
        # (rows, (global batch, world size) before, (global batch, world size) after, steps done before)
        (1001, (64, 3), (64, 2), 5),
        (1001, (64, 3), (64, 4), 1),
        (1001, (96, 3), (64, 5), 7),  # per-worker mode: the global batch changes with the workers
        (7, (4, 2), (3, 1), 1),
        (100, (10, 3), (7, 4), 9),
        (1437, (256, 8), (192, 6), 4),
        (50, (8, 2), (8, 8), 6),  # resume onto the last, partial step
    ],
)
def test_resume_mid_epoch_at_another_world_size(rows, before, after, stop_after_steps):
    """Train some steps at one size, stop, continue from the stored offset at another size."""
    order = epoch_order(rows, seed=3, epoch=2)
    first_steps = epoch_steps(rows, before[0])[:stop_after_steps]
    offset = first_steps[-1].end  # what the checkpoint stores
    trained_before = [
        offset_
        for step in first_steps
        for rank in range(before[1])
        for offset_ in range(*rank_rows(step, rank, before[1]))
    ]
    seen_after, step_counts = rows_per_rank(rows, after[0], after[1], start=offset)
    trained_after = [o for rank_rows_ in seen_after for o in rank_rows_]
    assert sorted(trained_after) == list(range(offset, rows))  # exactly the remaining rows
    assert len(set(step_counts)) == 1
    assert sorted(order[trained_before + trained_after]) == list(range(rows))  # each sample once


def test_the_rules_are_pure():
    """The rules (raytrain/rules/) import neither Ray nor torch."""
    import raytrain.rules

    files = sorted(Path(raytrain.rules.__file__).parent.glob("*.py"))
    assert len(files) > 5
    for path in files:
        source = path.read_text()
        assert "import ray" not in source and "import torch" not in source, path.name
