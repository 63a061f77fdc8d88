"""A per-step run's quorum writes checkpoints while the loop steps on, and while a replacement
restores: what a checkpoint holds is decided at its step, and one pruned under a reader is not
taken for an unusable one. Pure: a real directory, a plain model, a fake runtime; no Ray."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from raytrain.rules.position import Position
from raytrain.rundir import checkpoints as ckpt
from raytrain.worker.state import TrainingState


class RenumberedRuntime:
    """Quorum rank 0 at the step it saves at; renumbered (a group rejoined ahead of it) once
    `renumber()` is called. A writer thread that asks after that waits for it: it asks late."""

    def __init__(self) -> None:
        self.world_rank, self.world_size = 0, 1
        self.renumbered = threading.Event()
        self.saving_thread = threading.get_ident()

    @property
    def is_rank0(self) -> bool:
        if threading.get_ident() != self.saving_thread:
            self.renumbered.wait(10)
        return self.world_rank == 0

    def renumber(self) -> None:
        self.world_rank = 2
        self.renumbered.set()

    def all_gather_object(self, value):
        return [value]


def save_checkpoint(directory: Path, runtime, step: int, renumber: bool = False) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), Position(step=step))
    save = state.save(directory, runtime, {}, distributed=False)
    if renumber:
        runtime.renumber()  # the loop steps on under a new quorum while the files are written
    save.wait(30)


def test_the_rank_that_writes_a_checkpoints_train_state_is_the_one_at_its_step(tmp_path):
    """The quorum's rank 0 at the save publishes the directory; it must hold the train state
    even when the quorum renumbered the ranks before the writer thread got to it."""
    runtime = RenumberedRuntime()
    directory = tmp_path / ckpt.checkpoint_name(21)
    save_checkpoint(directory, runtime, step=21, renumber=True)
    assert runtime.world_rank == 2  # renumbered while the files were being written
    assert (directory / ckpt.TRAIN_STATE_FILE).is_file() and (directory / ckpt.POSITION_FILE).is_file()
    assert ckpt.is_complete(directory)
    assert ckpt.load_train_state(directory)["position"]["step"] == 21


def test_a_checkpoint_pruned_between_the_listing_and_its_reading_is_not_passed_over_as_unusable(tmp_path):
    runtime = RenumberedRuntime()
    runtime.renumbered.set()
    for step in (14, 21, 28):
        save_checkpoint(tmp_path / ckpt.checkpoint_name(step), runtime, step=step)
    listed = ckpt.checkpoint_dirs(tmp_path)
    assert [ckpt.stored_step(d) for d in listed] == [14, 21, 28]
    # The writer publishes 35 and prunes down to two: 14 and 21 go after the reader listed them.
    save_checkpoint(tmp_path / ckpt.checkpoint_name(35), runtime, step=35)
    for old in ckpt.checkpoint_dirs(tmp_path)[:-2]:
        ckpt.remove(old)
    choice = ckpt.choose(listed)
    assert [ckpt.stored_step(d) for d, _ in choice.usable] == [28]
    assert choice.passed_over == [] and choice.skipped_line() is None
    assert ckpt.gone(listed[0]) and not ckpt.gone(listed[-1])


def test_a_checkpoint_that_stays_unusable_is_still_passed_over(tmp_path):
    runtime = RenumberedRuntime()
    runtime.renumbered.set()
    for step in (14, 21):
        save_checkpoint(tmp_path / ckpt.checkpoint_name(step), runtime, step=step)
    listed = ckpt.checkpoint_dirs(tmp_path)
    (listed[-1] / ckpt.TRAIN_STATE_FILE).write_bytes(b"truncated")
    choice = ckpt.choose(listed)
    assert [ckpt.stored_step(d) for d, _ in choice.usable] == [14]
    assert len(choice.passed_over) == 1 and listed[-1].name in choice.passed_over[0]
