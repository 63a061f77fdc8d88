"""One rank on the CPU, for the pure tests of the worker's step: a runtime of rank 0 of 1, a
StepRunner built as a worker builds one, and one step taken through it."""

from __future__ import annotations

import torch

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.table import Table
from raytrain.instruments.phases import Measures
from raytrain.instruments.window import LossWindow
from raytrain.parallel.strategy import Prepared
from raytrain.pipeline import Pipeline
from raytrain.rules import steps
from raytrain.rules.batch import resolve_batch_plan
from raytrain.rules.position import Position
from raytrain.rules.schedule import run_schedule
from raytrain.worker.optim import Rate
from raytrain.worker.step import StepRunner

CPU = torch.device("cpu")


class OneRank:
    """What a StepRunner and a TrainingState ask of a runtime: rank 0 of 1, on the CPU."""

    world_rank, world_size, is_rank0, backend = 0, 1, True, "none"
    device = CPU

    def all_gather_object(self, value):
        return [value]

    def evaluation_share(self):
        return 0, 1


class Quiet:
    """A heartbeat that records nothing."""

    def mark(self, *args):
        pass


def step_runner(
    pipeline: Pipeline, model: torch.nn.Module | None = None, rows: int = 8, count_flops: bool = False, **options
) -> StepRunner:
    """The StepRunner of `pipeline` on one rank: `rows` rows a step, the lr at its peak from the
    first step (no warm-up, one epoch), the model `pipeline` builds unless one is given; `options`
    set the rest of the TrainConfig."""
    torch.manual_seed(0)
    cfg = TrainConfig(warmup_epochs=0, batch_size_per_worker=rows, reference_batch_size=rows, epochs=1, **options)
    plan = resolve_batch_plan(1, batch_size_per_worker=rows)
    model = model if model is not None else pipeline.build_model(cfg)
    optimizer = hooks.call(pipeline, "build_optimizer", model, cfg)
    return StepRunner(
        pipeline=pipeline,
        cfg=cfg,
        runtime=OneRank(),
        batch_plan=plan,
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler("cpu", enabled=cfg.precision == "fp16"),
        rate=Rate.of(pipeline, run_schedule(cfg, plan, rows), [1.0] * len(optimizer.param_groups)),
        window=LossWindow.on(CPU),
        measures=Measures(Quiet(), CPU, count_flops=count_flops),
        prepared=Prepared.plain(model, cfg.precision),
    )


def take_a_step(runner: StepRunner, table: Table) -> None:
    """One step over the whole of `table`: its gradients, then their update."""
    step = steps.epoch_steps(len(table), len(table))[0]
    phase = runner.measures.phases(0, timed=False)
    runner.gradients(table.epoch(0, 0, 0, 0, 1), step, phase)
    runner.apply_gradients(Position(), phase)
