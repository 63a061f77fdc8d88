"""Staging the next batch ahead (--prefetch) changes nothing a run computes: the same rows,
in the same order, the same losses and weights. On a CPU the staging path runs with
--prefetch on (the batch cut a step early); on a GPU it adds pinned memory and a side stream
(tests/test_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.table import Table
from raytrain.faults.restart import Recovery
from raytrain.instruments.phases import Measures
from raytrain.instruments.window import LossWindow
from raytrain.parallel.strategy import Prepared
from raytrain.pipeline import Pipeline
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.schedule import run_schedule
from raytrain.rundir.heartbeats import Heartbeat
from raytrain.worker import prefetch
from raytrain.worker.checkpointer import Checkpointer
from raytrain.worker.epoch import Training
from raytrain.worker.optim import Rate
from raytrain.worker.step import StepRunner

ROWS = 203  # a partial last step
CPU = torch.device("cpu")


class OneProcess:
    world_rank, world_size, is_rank0, backend, distributed = 0, 1, True, "none", False

    def __init__(self, device: torch.device):
        self.device = device

    def all_reduce_sum(self, values):
        return list(values)

    def all_gather_object(self, value):
        return [value]


class Files:
    """What train_epoch writes, kept in memory."""

    def __init__(self):
        self.rows = []
        self.enabled = True

    def live_due(self):
        return False

    def stop_requested(self, anyone=False):
        return False

    def driver_gone(self):
        return None

    def metrics(self, row):
        self.rows.append(row)

    def evaluation(self, row, final=False):
        pass

    def event(self, *args, **kwargs):
        pass


class Recording(Pipeline):
    """Notes the ids of every training batch and its loss."""

    def __init__(self):
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def compute_loss(self, model, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        self.seen.append(batch["id"].tolist())
        self.losses.append(float(loss.detach()))
        return loss


def train(
    setting: str, micro_batch_size: int | None, device: torch.device = CPU
) -> tuple[Recording, list[torch.Tensor], Files]:
    """Two epochs of a small MLP on `device` through the worker's own epoch and step code."""
    pipeline = Recording()
    cfg = TrainConfig(
        warmup_epochs=0,
        batch_size_per_worker=16,
        micro_batch_size=micro_batch_size,
        reference_batch_size=16,
        epochs=2,
        prefetch=setting,
        log_every_steps=4,
    )
    rng = np.random.default_rng(0)
    table = Table(
        {
            "id": np.arange(ROWS),
            "x": rng.standard_normal((ROWS, 8), dtype=np.float32),
            "y": rng.integers(0, 3, ROWS),
        }
    )
    torch.manual_seed(0)
    plan = batch_plan_for(cfg, 1)
    model = pipeline.build_model(cfg).to(device)
    optimizer = hooks.call(pipeline, "build_optimizer", model, cfg)
    runner = StepRunner(
        pipeline=pipeline,
        cfg=cfg,
        runtime=OneProcess(device),
        batch_plan=plan,
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler(device.type, enabled=False),
        rate=Rate.of(pipeline, run_schedule(cfg, plan, ROWS), [1.0] * len(optimizer.param_groups)),
        window=LossWindow.on(device),
        measures=Measures(Heartbeat(Path("."), 0, enabled=False), device),
        prepared=Prepared.plain(model, cfg.precision),
    )
    files = Files()
    recovery = Recovery(cfg, Path("."), runner.runtime)
    checkpointer = Checkpointer(cfg, recovery, Path("."), files)
    position = checkpointer.position
    training = Training(cfg, recovery, files, runner, checkpointer, table, None, position, announced=True)
    for epoch in range(cfg.epochs):
        position.epoch, position.epoch_offset = epoch, 0
        training.train_epoch()
    return pipeline, [p.detach().cpu() for p in model.parameters()], files


@pytest.mark.parametrize("micro_batch_size", [None, 8])
def test_prefetching_changes_no_row_order_loss_or_weight(monkeypatch, micro_batch_size):
    staged = []
    stage = prefetch.Prefetched.stage
    monkeypatch.setattr(prefetch.Prefetched, "stage", lambda self, *a: (staged.append(self), stage(self, *a)))
    plain, plain_weights, plain_files = train("off", micro_batch_size)
    assert staged == []
    ahead, ahead_weights, ahead_files = train("on", micro_batch_size)
    steps_per_epoch = -(-ROWS // 16)
    assert len(staged) == 2 * (steps_per_epoch - 1)  # every step but an epoch's first was staged ahead
    assert sum(data.staged_batches for data in set(staged)) == len(staged)  # and served from the stage
    assert ahead.seen == plain.seen and ahead.losses == plain.losses
    assert all(torch.equal(a, b) for a, b in zip(ahead_weights, plain_weights))
    assert [r.loss for r in ahead_files.rows] == [r.loss for r in plain_files.rows]
    for epoch in range(2):  # each epoch: every row once, in a new order
        rows = [
            i for batch in ahead.seen[epoch * len(ahead.seen) // 2 : (epoch + 1) * len(ahead.seen) // 2] for i in batch
        ]
        assert sorted(rows) == list(range(ROWS))


def test_prefetching_is_on_by_default_only_on_a_gpu():
    assert prefetch.wanted("auto", torch.device("cuda", 0)) and not prefetch.wanted("auto", torch.device("cpu"))
    assert prefetch.wanted("on", torch.device("cpu")) and not prefetch.wanted("off", torch.device("cuda", 0))


def test_a_step_of_other_rows_than_the_staged_ones_is_served_its_own():
    table = Table({"id": np.arange(10)})
    data = prefetch.Prefetched(table.epoch(0, 0, 0, 0, 1), torch.device("cpu"))
    from raytrain.rules import steps

    first, second = steps.epoch_steps(10, 5)
    data.stage(second, 1)
    batch, count = data.batch(data.rows(first), torch.device("cpu"))
    assert count == 5 and data.staged_batches == 0  # not the staged rows: cut anew
    assert (
        batch["id"].tolist()
        == table.epoch(0, 0, 0, 0, 1).batch(data.rows(first), torch.device("cpu"))[0]["id"].tolist()
    )
