"""Pure tier: the streamed order (raytrain.rules.order) — exactly once, equal steps, the same rows
per step at any worker count, resumable anywhere, sharded reading, and shuffle quality."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raytrain.rules import order
from raytrain.rules.order import EpochPlan, StreamLayout, lane_owners, lane_prefix
from raytrain.rules.steps import epoch_steps, split_range


def brute_prefix(lane_rows, position):
    keys = sorted(((2 * j + 1) / (2 * n), lane) for lane, n in enumerate(lane_rows) for j in range(n))
    counts = [0] * len(lane_rows)
    for _, lane in keys[:position]:
        counts[lane] += 1
    return counts


@pytest.mark.parametrize("lane_rows", [[5], [3, 3], [7, 1, 4], [10, 10, 10, 1], [1, 2, 3, 4, 5, 6], [0, 4, 4]])
def test_lane_prefix_is_the_sainte_lague_merge_and_grows(lane_rows):
    previous = [0] * len(lane_rows)
    for position in range(sum(lane_rows) + 1):
        counts = lane_prefix(lane_rows, position)
        assert counts == brute_prefix(lane_rows, position)
        assert sum(counts) == position and all(a >= b for a, b in zip(counts, previous))
        previous = counts
    assert lane_prefix(lane_rows, 10**6) == list(lane_rows)


def test_lane_prefix_is_exact_for_large_counts():
    rows = [10**12 + 7, 3 * 10**11, 5]
    for position in (1, 10**11, 10**12, sum(rows) - 1):
        assert sum(lane_prefix(rows, position)) == position


def layout(units=(200, 201, 202, 200, 200), window=120, partitions=24):
    return StreamLayout(unit_rows=tuple(units), window_rows=window, partitions=partitions)


def rank_step_ids(plan: EpochPlan, rank: int, world_size: int, start: int, end: int) -> np.ndarray:
    owners = lane_owners(plan.lane_rows, world_size)
    mine = [lane for lane, owner in enumerate(owners) if owner == rank]
    parts = [plan.global_ids(lane, lo, hi) for lane, lo, hi in plan.segments(mine, start, end)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("units", [(200, 201, 202, 200, 200), (1003,), (64, 64, 64, 8) * 5, (3, 0, 500, 1, 499)])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("window", [1, 48, 120, 5000])
def test_every_row_once_per_epoch_and_the_same_rows_per_step_at_any_worker_count(units, world_size, window):
    lay = layout(units, window)
    for epoch in range(2):
        plan = EpochPlan.build(lay, seed=3, epoch=epoch)
        reference = order.epoch_step_ids(lay, 3, epoch, 48)
        steps = epoch_steps(lay.num_rows, 48)
        assert len(steps) == len(reference)  # equal step counts: every rank derives them from N and G
        seen = []
        for step, expected in zip(steps, reference):
            per_rank = [rank_step_ids(plan, rank, world_size, step.start, step.end) for rank in range(world_size)]
            together = np.sort(np.concatenate(per_rank))
            assert together.tolist() == expected.tolist()  # the step's rows do not depend on the worker count
            assert len(together) == step.size
            seen.extend(together.tolist())
        assert sorted(seen) == list(range(lay.num_rows))


def test_each_epoch_has_a_new_order_and_a_seed_repeats_it():
    lay = layout()
    first = [ids.tolist() for ids in order.epoch_step_ids(lay, 1, 0, 48)]
    assert first == [ids.tolist() for ids in order.epoch_step_ids(lay, 1, 0, 48)]
    assert first != [ids.tolist() for ids in order.epoch_step_ids(lay, 1, 1, 48)]
    assert first != [ids.tolist() for ids in order.epoch_step_ids(lay, 2, 0, 48)]
    units = [EpochPlan.build(lay, 1, epoch).lane_units for epoch in range(4)]
    assert len({str(u) for u in units}) > 1  # the units come in a new order too


@pytest.mark.parametrize("before, after, stop", [(2, 3, 7), (3, 1, 3), (1, 2, 12), (3, 2, 1)])
def test_resume_at_another_worker_count_and_batch_trains_the_rest_exactly_once(before, after, stop):
    lay = layout((150, 250, 203, 180, 220), window=100)
    plan = EpochPlan.build(lay, seed=9, epoch=0)
    trained = []
    first_steps = epoch_steps(lay.num_rows, 48)[:stop]
    for step in first_steps:
        for rank in range(before):
            trained.extend(rank_step_ids(plan, rank, before, step.start, step.end).tolist())
    offset = first_steps[-1].end
    # The new size runs another global batch (--batch-size-per-worker) from the stored offset.
    for step in epoch_steps(lay.num_rows, 30, offset):
        for rank in range(after):
            trained.extend(rank_step_ids(plan, rank, after, step.start, step.end).tolist())
    assert sorted(trained) == list(range(lay.num_rows))


def test_a_rank_reads_only_the_units_of_its_lanes_and_each_unit_once():
    lay = layout(tuple([100] * 30), window=600, partitions=6)
    plan = EpochPlan.build(lay, 0, 0)
    owners = lane_owners(plan.lane_rows, 3)
    read = []
    for rank in range(3):
        mine = [lane for lane, owner in enumerate(owners) if owner == rank]
        units = [plan.lane_units[lane][index] for lane, index in plan.read_order(mine, 0)]
        trained = {int(i) for i in np.concatenate([plan.global_ids(lane, 0, plan.lane_rows[lane]) for lane in mine])}
        needed = {u for u in range(30) if set(range(u * 100, u * 100 + 100)) & trained}
        assert set(units) == needed
        read.extend(units)
    assert sorted(read) == list(range(30))  # every unit read by exactly one rank
    assert [sum(plan.lane_rows[lane] for lane, o in enumerate(owners) if o == rank) for rank in range(3)] == [1000] * 3


def test_read_order_follows_need_and_a_restart_skips_finished_units():
    lay = layout(tuple([50] * 12), window=100, partitions=2)  # lanes of 6 units, blocks of 50 rows
    plan = EpochPlan.build(lay, 4, 1)
    full = plan.read_order([0, 1], 0)
    assert len(full) == 12
    # Interleaved: both lanes' first units before either lane's second.
    assert {lane for lane, index in full[:2]} == {0, 1} and all(index == 0 for _, index in full[:2])
    middle = plan.num_rows // 2
    resumed = plan.read_order([0, 1], middle)
    offsets = plan.prefix(middle)
    for lane, index in resumed:
        assert plan.lane_unit_starts[lane][index + 1] > (offsets[lane] // lay.block_rows) * lay.block_rows
    assert len(resumed) <= 12 // 2 + 2  # about half the units, plus the two being read when stopped


def test_lanes_are_balanced_and_owners_balance_ranks():
    lay = layout(tuple(range(1, 97)), window=9600, partitions=24)
    plan = EpochPlan.build(lay, 0, 0)
    assert max(plan.lane_rows) - min(plan.lane_rows) <= 96
    for world_size in (1, 2, 3, 4, 6, 8):
        owners = lane_owners(plan.lane_rows, world_size)
        loads = [sum(n for n, o in zip(plan.lane_rows, owners) if o == r) for r in range(world_size)]
        assert max(loads) / (sum(loads) / world_size) < 1.1


def test_lanes_are_never_more_than_units_or_window():
    assert layout((10, 10), window=100, partitions=24).lanes == 2
    assert layout((10,) * 30, window=5, partitions=24).lanes == 5
    assert layout((10,) * 30, window=100, partitions=24).block_rows == 5


def test_deal_units_gives_each_unit_to_one_rank():
    dealt = order.deal_units([5, 0, 7, 3, 9, 1], 3)
    assert sorted(itertools.chain(*dealt)) == [0, 2, 3, 4, 5]
    assert order.deal_units([5], 3) == [[0], [], []]


def test_layout_rejects_empty_streams():
    with pytest.raises(ValueError):
        StreamLayout(unit_rows=(0, 0), window_rows=10, partitions=4)


# -- shuffle quality (docs/data.md gives these figures) ----------------------------------------


def sorted_by_label(num_units=40, rows=250, classes=10):
    """Data stored sorted by label: units hold one or two labels each, as files written from
    sorted data do."""
    labels = np.repeat(np.arange(classes), num_units * rows // classes)
    return [labels[i * rows : (i + 1) * rows] for i in range(num_units)], classes


def batches_of(labels_by_id: np.ndarray, steps: list[np.ndarray]) -> list[np.ndarray]:
    return [labels_by_id[ids] for ids in steps]


def quality(window_rows: int, partitions: int = 24, batch: int = 64) -> dict[str, float]:
    units, classes = sorted_by_label()
    labels = np.concatenate(units)
    n = len(labels)
    full = [labels[np.random.default_rng(0).permutation(n)[lo:hi]] for lo, hi in _ranges(n, batch)]
    old_window = []  # the previous design: in-order windows of window_rows, each permuted
    for start in range(0, n, window_rows):
        idx = start + np.random.default_rng([0, start]).permutation(min(window_rows, n - start))
        old_window.append(labels[idx])
    old = np.concatenate(old_window)
    old_batches = [old[lo:hi] for lo, hi in _ranges(n, batch)]
    lay = StreamLayout(unit_rows=tuple(len(u) for u in units), window_rows=window_rows, partitions=partitions)
    new = batches_of(labels, order.epoch_step_ids(lay, 0, 0, batch))
    return {
        "full": order.label_mix_distance(full, classes),
        "window": order.label_mix_distance(old_batches, classes),
        "lanes": order.label_mix_distance(new, classes),
    }


def _ranges(n, batch):
    return [(lo, min(n, lo + batch)) for lo in range(0, n, batch)]


def test_shuffle_quality_on_label_sorted_data_stays_near_a_full_shuffle():
    q = quality(window_rows=2000)
    # Batches of 64 from 10 classes: a full shuffle's sampling noise alone is ~0.15; an
    # in-order window of 2,000 sorted rows holds one or two labels (~0.85).
    assert q["full"] < 0.2
    assert q["window"] > 0.7
    assert q["lanes"] < q["full"] + 0.1, q


def test_a_bigger_window_mixes_at_least_as_well():
    assert quality(window_rows=6000)["lanes"] <= quality(window_rows=600)["lanes"] + 0.02


def test_split_range_is_what_the_in_memory_path_uses():
    assert split_range(5, 2) == [(0, 3), (3, 5)]
