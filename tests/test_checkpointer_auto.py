"""--checkpoint-every auto inside the worker's checkpoint owner (`raytrain.worker.checkpointer`):
every rank saves at the same steps, whatever its own timings, because it holds rank 0's figures
after each save; an attempt that continues this invocation's own checkpoint counts a failure, a
resume or a grown group does not; the interval's state travels in the checkpoint. Pure: a fake
runtime stands in for Ray and torch.distributed."""

from __future__ import annotations

import pytest

from raytrain.config import TrainConfig
from raytrain.faults.restart import Recovery
from raytrain.rules.batch import batch_plan_for
from raytrain.worker.checkpointer import Checkpointer


class FakeRuntime:
    """Rank `rank` of `world_size`; its gather returns what `rank0` holds (what rank 0 sent)."""

    def __init__(self, rank: int, world_size: int = 2, rank0: "FakeRuntime | None" = None):
        self.world_rank, self.world_size, self.nodes, self.rank0 = rank, world_size, world_size, rank0
        self.sent = None

    @property
    def is_rank0(self) -> bool:
        return self.world_rank == 0

    def all_gather_object(self, value):
        if self.is_rank0:
            self.sent = value
            return [value]
        return [self.rank0.sent]


def checkpointer(runtime, lines=None, invocation="run-1", **options):
    cfg = TrainConfig(checkpoint_every="auto", checkpoint_min_steps=2, checkpoint_max_steps=40, **options)
    run_dir = "/tmp/unused-run-dir"
    owner = Checkpointer(cfg, Recovery(cfg, run_dir, runtime), run_dir, None, invocation=invocation)
    owner.say = (lambda change: lines.append(change.line)) if lines is not None else None
    return owner


def test_every_rank_checkpoints_at_rank_0s_interval():
    rank0 = FakeRuntime(0)
    rank1 = FakeRuntime(1, rank0=rank0)
    lines: list[str] = []
    first, second = checkpointer(rank0, lines), checkpointer(rank1)
    for owner in (first, second):
        owner.auto_restored(None)
    assert "Checkpoint interval 2 steps" in lines[0]  # said at the start: the first save measures the stall
    # Different step times on the two ranks; rank 0's figures decide
    for owner, step_s in ((first, 0.01), (second, 0.5)):
        owner.auto.on_steps(10, 10 * step_s)
    first.after_save(2, stall_s=0.5)  # rank 0 gathers first, as the collective orders it
    second.after_save(2, stall_s=0.001)
    assert first.auto.held == second.auto.held > 2
    assert second.auto.stall_s == pytest.approx(0.5)
    assert "Checkpoint interval 2 →" in lines[-1]
    held = first.auto.held
    assert not first.due(2 + held - 1, last=False) and first.due(2 + held, last=False)
    assert not first.due(2 + held, last=True)  # the loop checkpoints an epoch's last step itself


def test_the_interval_state_travels_in_the_checkpoint_and_a_restart_counts_a_failure():
    owner = checkpointer(FakeRuntime(0, world_size=1))
    owner.auto_restored(None)
    owner.auto.on_steps(5, 0.5)
    owner.after_save(6, stall_s=0.2)

    class Rate:
        peak_lr, multipliers = 0.1, [1.0]

        def at(self, samples_seen):
            return 0.1

    class Runner:  # what `contents` reads of the step machinery
        rate = Rate()
        batch_plan = batch_plan_for(TrainConfig(), 1)

    owner.position.step = 6
    saved = {**owner.contents(Runner()), "position": {"step": 6, "world_sizes": [1]}}
    assert saved["auto_interval"] == {"invocation": "run-1", "interval": owner.auto.state()}
    restarted = checkpointer(FakeRuntime(0, world_size=1))
    restarted.auto_restored(saved)
    assert restarted.auto.failures == 1 and restarted.saved_step == 6
    assert restarted.auto.stall_s == pytest.approx(0.2)
    resumed = checkpointer(FakeRuntime(0, world_size=1), invocation="run-2")  # raytrain train --resume
    resumed.auto_restored(saved)
    assert resumed.auto.failures == 0
    grown = checkpointer(FakeRuntime(0, world_size=2))  # an elastic group grew: no failure
    grown.auto_restored(saved)
    assert grown.auto.failures == 0
