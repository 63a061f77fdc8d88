"""One optimizer step: the model, the optimizer and the rules of an attempt, and the mechanics
of forward, backward and update over a rank's rows (`StepRunner`).

The per-worker story (`raytrain.worker.loop`) builds one `StepRunner` per attempt and asks
it for steps; how the rows, the micro-batches, the loss weight, autocast, the scaler,
clipping and the pipeline's hooks fit together is said here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.stream import StreamEpoch
from raytrain.data.table import TableEpoch
from raytrain.instruments.phases import Measures, StepPhases
from raytrain.instruments.window import LossWindow
from raytrain.parallel import device, strategy
from raytrain.parallel.strategy import Prepared
from raytrain.pipeline import _CONTEXT, Pipeline, overrides, set_plan
from raytrain.rules import steps
from raytrain.rules.attempt import describe_plan
from raytrain.rules.batch import BatchPlan, batch_plan_for
from raytrain.rules.budget import Budget, evaluation_rows
from raytrain.rules.position import Position
from raytrain.rules.schedule import run_schedule
from raytrain.rundir.heartbeats import Heartbeat
from raytrain.worker import optim
from raytrain.worker.state import TrainingState, restore_rank_rng, seed_everything, unwrap

if TYPE_CHECKING:  # pragma: no cover  (Ray's module: a step builds and runs without Ray)
    from raytrain.worker.runtime import Runtime


# A heartbeat phase as a device failure's message says where it happened.
PHASE_WORDS = {"data": "the batch's copy to the device", "optimizer": "the optimizer step"}


@dataclass
class StepRunner:
    """The model, optimizer and rules of one attempt; takes optimizer steps."""

    pipeline: Pipeline
    cfg: TrainConfig
    runtime: Runtime
    batch_plan: BatchPlan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    rate: optim.Rate  # the learning rate at this plan
    window: LossWindow  # the steps since the last sync
    measures: Measures  # the heartbeat, and what the attempt measures (restored with it)
    prepared: Prepared  # how the strategy holds the model (`Prepared.plain`: one process's, unwrapped)
    total_steps: int = 0  # the steps the whole run takes at this plan (raytrain.context())
    exact: ClassVar[bool] = False  # full fp32 whatever --tf32 says (raytrain check compares runs exactly)

    @classmethod
    def build(
        cls,
        pipeline: Pipeline,
        cfg: TrainConfig,
        runtime: Runtime,
        heartbeat: Heartbeat,
        batch_plan: BatchPlan,
        num_train_rows: int,
    ) -> "StepRunner":
        """Everything an attempt steps with, freshly initialized (`restore` continues from a
        checkpoint): the pipeline's model, held as --strategy says, its optimizer and scaler."""
        total_steps = Budget.of(cfg).total_steps(num_train_rows, batch_plan.global_batch_size)
        show_plan(cfg, runtime, batch_plan, total_steps)  # what build_model and build_optimizer see
        # One seed for model init on every rank: identical replicas (and identical shards'
        # sources under fsdp) before DDP's broadcast.
        seed_everything(cfg.seed)
        device.check_bf16(cfg.precision, runtime.device)
        if runtime.device.type == "cuda":  # torch's own flags, left as they are on a CPU
            device.apply_tf32(device.use_tf32(runtime.device.type, cfg.tf32, exact=cls.exact))
        prepared = strategy.build_and_prepare(pipeline, cfg, runtime)
        model = prepared.model
        optimizer = hooks.call(pipeline, "build_optimizer", unwrap(model), cfg)
        multipliers = optim.rate_multipliers(optimizer, cfg.lr)  # before a checkpoint's state overwrites the rates
        restore_rank_rng(cfg.seed, runtime.world_rank, runtime.world_size, None)
        return cls(
            pipeline=pipeline,
            cfg=cfg,
            runtime=runtime,
            batch_plan=batch_plan,
            model=model,
            optimizer=optimizer,
            scaler=prepared.strategy.grad_scaler(runtime.device),
            rate=optim.Rate.of(pipeline, run_schedule(cfg, batch_plan, num_train_rows), multipliers),
            window=LossWindow.on(runtime.device),
            measures=Measures(
                heartbeat,
                runtime.device,
                cfg.time_phases,
                count_flops=runtime.is_rank0 and runtime.counts_flops,
                compiled_from=strategy.graphs_built() if cfg.compile else None,
            ),
            prepared=prepared,
            total_steps=total_steps,
        )

    # -- the rules of this attempt ----------------------------------------------------------

    def for_quorum(self, replicas: int, num_train_rows: int) -> "StepRunner":
        """This runner with the batch plan and rate of a quorum of `replicas` (per-step mode)."""
        plan = batch_plan_for(self.cfg, replicas)
        total = Budget.of(self.cfg).total_steps(num_train_rows, plan.global_batch_size)
        rate = dataclasses.replace(self.rate, schedule=run_schedule(self.cfg, plan, num_train_rows))
        return dataclasses.replace(self, batch_plan=plan, rate=rate, total_steps=total)

    def training_state(self, position: Position) -> TrainingState:
        """What a checkpoint, a healed replica and the final model hold (`raytrain.worker.state`)."""
        return TrainingState(
            self.model, self.optimizer, self.scaler, position, self.prepared.strategy, self.measures.telemetry
        )

    # -- a step ------------------------------------------------------------------------------

    def update_context(self, position: Position) -> None:
        """What `raytrain.context()` tells the pipeline's hooks during the step at `position`."""
        show_plan(self.cfg, self.runtime, self.batch_plan, self.total_steps)
        _CONTEXT.epoch = position.epoch
        _CONTEXT.step = position.step
        _CONTEXT.samples_seen = position.samples_seen
        _CONTEXT.lr = self.rate.at(position.samples_seen)

    def gradients(self, data: TableEpoch | StreamEpoch, step: steps.Step, phase: StepPhases) -> None:
        """Forward and backward over this rank's rows of `step` (gradients averaged over ranks)."""
        step_index, measures, parts = phase.step_index, self.measures, self.batch_plan.accumulation_steps
        cfg, rank, transforms = self.cfg, self.runtime.world_rank, overrides(self.pipeline, "transform_batch")
        try:
            for index, piece in enumerate(steps.micro_batches(data.rows(step), parts)):
                # A rank with no rows in a (micro-)step still runs forward and backward (the data
                # gives one row for an empty piece; weight 0 below) so that it joins the
                # gradient all-reduce.
                with phase.data:
                    batch, count = data.batch(piece, self.runtime.device)
                    if transforms:  # seeded from (seed, epoch, step, rank, micro-batch): the same after a resume
                        batch = self.transform(batch, [cfg.seed, _CONTEXT.epoch, step_index, rank, index])
                # DDP averages gradients over ranks; this weight turns that into the mean
                # over the samples actually present in the step (tail steps are smaller).
                weight = steps.gradient_weight(count, self.runtime.world_size, step.size)
                if index == parts - 1 and not measures.count_flops:  # the common case: no block to enter
                    loss = self.forward_backward(batch, weight, phase)
                else:  # no gradient reduction over ranks but in a step's last; rank 0's FLOPs counted once
                    with contextlib.nullcontext() if index == parts - 1 else strategy.no_gradient_sync(self.model):
                        with measures.counting_flops(count, lambda: strategy.eager(self.model)):
                            loss = self.forward_backward(batch, weight, phase)
                self.window.add(loss, count, step_index)
        except Exception as exc:
            self.raise_device_failure(exc, phase)
            raise

    def forward_backward(self, batch: dict[str, torch.Tensor], weight: float, phase: StepPhases) -> torch.Tensor:
        """A micro-batch's loss, and its gradients times `weight` (the backward includes DDP's
        all-reduce, overlapped with it)."""
        with phase.forward:
            loss, _ = self.compute_loss(batch)
        with phase.backward:  # a full step's weight is 1: no extra multiply in the graph
            self.scaler.scale(loss if weight == 1.0 else loss * weight).backward()
        return loss

    def apply_gradients(self, position: Position, phase: StepPhases) -> float:
        """The optimizer's step at the rate of `position`; returns that rate."""
        lr = self.rate.set_on(self.optimizer, position.samples_seen)
        try:
            with phase.optimizer:
                if self.cfg.grad_clip_norm is not None:
                    self.clip_gradients(position.step)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                if self.measures.memory is None:  # once: the gradients and the optimizer's state all exist now
                    self.measures.note_state(lambda: strategy.state_bytes(self.model, self.optimizer))
                self.optimizer.zero_grad(set_to_none=True)
        except Exception as exc:
            self.raise_device_failure(exc, phase)
            raise
        return lr

    def discard_step(self, window_before: Any) -> None:
        """The step's gradients dropped and its losses forgotten (`LossWindow.snapshot` before it):
        a step its quorum did not commit counts for nothing."""
        self.optimizer.zero_grad(set_to_none=True)
        self.window.restore(window_before)

    def raise_device_failure(self, exc: Exception, phase: StepPhases | str) -> None:
        """`exc`, if the device's out-of-memory or device-side assert error, raised as the user's
        (`raytrain.parallel.device`: never retried), named with this rank and the phase."""
        where = phase if isinstance(phase, str) else PHASE_WORDS.get(phase.current, phase.current)
        failure = device.device_failure(exc, self.runtime.world_rank, where, self.runtime.device)
        if failure is not None:
            raise failure from exc

    def clip_gradients(self, step_index: int) -> None:
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16's scaled ones
        norm = strategy.full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm))
        if not self.scaler.is_enabled():  # under fp16 an inf norm is an overflow the scaler skips, not divergence
            self.window.note_if_bad(norm, step_index)

    @functools.cached_property
    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision: the strategy's policy (`holding.Holding.autocast`), one context
        entered at every forward (autocast's and nullcontext's may be entered again once left)."""
        return self.prepared.strategy.autocast(self.runtime.device.type)

    def evaluate(self, source: Any) -> dict[str, float]:
        """Validation loss and metrics, averaged over all validation samples of all ranks (over the
        same --eval-batches global batches every pass, when given)."""
        runtime, cfg, model = self.runtime, self.cfg, self.model
        try:
            with torch.no_grad():
                model.eval()
                batch_size = max(1, cfg.micro_batch_size or self.batch_plan.per_worker_max)
                sums: dict[str, float] = {}
                count = 0
                # A rank without validation rows evaluates one row with weight 0 (n == 0), so every
                # rank learns the metric names and joins the reduction below.
                rank, world = runtime.evaluation_share()
                limit = evaluation_rows(cfg)
                batches = source.eval_batches(rank, world, batch_size, runtime.device, limit=limit, seed=cfg.seed)
                if self.prepared.strategy.forward_is_collective and world > 1:
                    batches = _in_step(batches, runtime)
                for n, batch in batches:
                    loss, metrics = self.compute_loss(batch)
                    for name, value in {"loss": loss, **metrics}.items():
                        sums[name] = sums.get(name, 0.0) + float(value) * n
                    count += n
                names = sorted(sums)
                values = [sums[name] for name in names] + [float(count)]
                totals = runtime.all_reduce_sum(values) if world > 1 else values
                model.train()
        except Exception as exc:
            self.raise_device_failure(exc, "evaluation")
            raise
        return {f"val_{name}": total / totals[-1] for name, total in zip(names, totals[:-1])}

    # -- the pipeline's hooks ------------------------------------------------------------------

    def transform(self, batch: dict[str, torch.Tensor], key: list[int]) -> dict[str, torch.Tensor]:
        """transform_batch under torch's and numpy's generators seeded from `key`."""
        seed = int(np.random.SeedSequence(key).generate_state(1)[0])
        devices = [self.runtime.device] if self.runtime.device.type == "cuda" else []
        numpy_state = np.random.get_state()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            np.random.seed(seed)
            try:
                return hooks.call(self.pipeline, "transform_batch", Batch(batch), _CONTEXT)
            finally:
                np.random.set_state(numpy_state)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The pipeline's compute_loss under autocast, its result checked (`raytrain.hooks`); an
        exception from it is the pipeline's (not retried), unless a collective failed in it (a
        peer died or stalled inside DDP's forward: a worker fault, retried)."""
        with self.autocast:
            output = hooks.call(
                self.pipeline, "compute_loss", self.model, Batch(batch), passthrough=strategy.is_collective_failure
            )
        if isinstance(output, tuple):  # (loss, metrics), else the loss alone
            return output[0], dict(output[1] or {})
        return output, {}


def plan_line(runner: StepRunner) -> str:
    """The attempt's (or quorum's) plan in words: batch, rate, schedule, optimizer, backend, model."""
    optimizer = optim.describe_optimizer(runner.optimizer) if overrides(runner.pipeline, "build_optimizer") else None
    model = runner.prepared.describe()
    return describe_plan(
        runner.cfg, runner.pipeline, runner.batch_plan, runner.rate.schedule, runner.runtime.backend, optimizer, model
    )


def show_plan(cfg: TrainConfig, runtime: Runtime, plan: BatchPlan, total_steps: int) -> None:
    """The plan of this attempt (or quorum) in `raytrain.context()`."""
    _CONTEXT.world_rank = runtime.world_rank
    set_plan(plan, cfg, total_steps)


class Batch(dict):
    """A batch whose missing key names the keys it has (what compute_loss sees)."""

    def __missing__(self, key):
        raise KeyError(
            f"{key!r}: the batch has no such column; it has {', '.join(map(repr, self))} (columns of the dataset)"
        )


def _in_step(batches, runtime):
    """The batches of a rank, and weight-0 repeats of its last one until every rank is done:
    under fsdp a forward pass is a collective (each block's parameters are gathered from all
    ranks), so every rank runs as many as the rank with the most validation rows."""
    last = None
    iterator = iter(batches)
    while True:
        item = next(iterator, None)
        if runtime.all_reduce_sum([0.0 if item is None else 1.0])[0] == 0:
            return
        if item is not None:
            last = item
            yield item
        else:
            yield 0, last[1]
