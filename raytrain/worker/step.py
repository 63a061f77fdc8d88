"""One optimizer step: the model, the optimizer and the rules of an attempt, and the mechanics
of forward, backward and update over a rank's rows (`StepRunner`).

The per-worker story (`raytrain.worker.loop`) builds one `StepRunner` per attempt and asks
it for steps; how the rows, the micro-batches, the loss weight, autocast, the scaler,
clipping and the pipeline's hooks fit together is said here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np
import torch

from raytrain import hooks
from raytrain.config import TrainConfig
from raytrain.data.stream import StreamEpoch
from raytrain.data.table import TableEpoch
from raytrain.parallel import device, strategy
from raytrain.parallel.holding import Ddp, Holding
from raytrain.parallel.strategy import Prepared
from raytrain.pipeline import _CONTEXT, Pipeline, overrides, set_plan
from raytrain.rules import steps
from raytrain.rules.attempt import describe_plan
from raytrain.rules.batch import BatchPlan, batch_plan_for
from raytrain.rules.budget import Budget, evaluation_rows
from raytrain.rules.position import Position, Telemetry
from raytrain.rules.schedule import LRSchedule, run_schedule
from raytrain.rundir.heartbeats import Heartbeat
from raytrain.rundir.records import MetricsRow
from raytrain.worker import optim
from raytrain.worker.phases import PhaseTimer, StepPhases
from raytrain.worker.state import TrainingState, restore_rank_rng, seed_everything, unwrap
from raytrain.worker.window import LossWindow, Throughput

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
    heartbeat: Heartbeat
    batch_plan: BatchPlan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: LRSchedule
    rate_multipliers: list[float]  # per parameter group: its rate at build / --lr
    window: LossWindow  # the steps since the last sync
    throughput: Throughput = field(default_factory=lambda: Throughput(time.perf_counter(), 0))
    count_flops: bool = False  # rank 0 counts the FLOPs of its next micro-batch with rows (once per attempt)
    total_steps: int = 0  # the steps the whole run takes at this plan (raytrain.context())

    prepared: Prepared | None = None  # how the strategy holds the model (None in unit tests: a plain model)
    memory: dict[str, int] | None = None  # bytes of this rank's state, after the attempt's first step
    memory_said: bool = False
    telemetry: Telemetry = field(default_factory=Telemetry)  # what the attempt measures (restored with it)
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
            heartbeat=heartbeat,
            batch_plan=batch_plan,
            model=model,
            optimizer=optimizer,
            scaler=prepared.strategy.grad_scaler(runtime.device),
            schedule=run_schedule(cfg, batch_plan, num_train_rows),
            rate_multipliers=multipliers,
            window=LossWindow.on(runtime.device),
            prepared=prepared,
            count_flops=runtime.is_rank0 and cfg.fault_tolerance == "restart",
            total_steps=total_steps,
        )

    # -- the rules of this attempt ----------------------------------------------------------

    @property
    def peak_lr(self) -> float:
        return self.schedule.peak_lr

    def lr_at(self, samples_seen: int) -> float:
        factor = hooks.bound(self.pipeline, "lr_factor") if overrides(self.pipeline, "lr_factor") else None
        return self.schedule.lr(samples_seen, factor)

    def describe_plan(self) -> str:
        optimizer = optim.describe_optimizer(self.optimizer) if overrides(self.pipeline, "build_optimizer") else None
        model = self.prepared.describe() if self.prepared is not None else ""
        return describe_plan(
            self.cfg, self.pipeline, self.batch_plan, self.schedule, self.runtime.backend, optimizer, model
        )

    def for_quorum(self, replicas: int, num_train_rows: int) -> "StepRunner":
        """This runner with the batch plan and rate of a quorum of `replicas` (per-step mode)."""
        plan = batch_plan_for(self.cfg, replicas)
        total = Budget.of(self.cfg).total_steps(num_train_rows, plan.global_batch_size)
        schedule = run_schedule(self.cfg, plan, num_train_rows)
        return dataclasses.replace(self, batch_plan=plan, schedule=schedule, total_steps=total)

    @property
    def holding(self) -> Holding:
        """The strategy that holds the model (`raytrain.parallel.holding`); a plain model's,
        ddp's, when nothing prepared it (unit tests)."""
        return self.prepared.strategy if self.prepared is not None else Ddp(self.cfg.precision, name="local")

    def training_state(self, position: Position) -> TrainingState:
        """What a checkpoint, a healed replica and the final model hold (`raytrain.worker.state`)."""
        return TrainingState(self.model, self.optimizer, self.scaler, position, self.holding, self.telemetry)

    def metrics_row(
        self, position: Position, *, loss: float, samples_per_s: float, extra: dict | None = None
    ) -> MetricsRow:
        return MetricsRow(
            epoch=position.epoch if position.epoch_offset == 0 else position.epoch + 1,
            step=position.step,
            samples_seen=position.samples_seen,
            world_size=self.runtime.world_size,
            global_batch_size=self.batch_plan.global_batch_size,
            lr=self.lr_at(position.samples_seen),
            loss=loss,
            samples_per_s=samples_per_s,
            time_s=time.time(),
            extra=dict(extra or {}),
        )

    # -- a step ------------------------------------------------------------------------------

    def update_context(self, position: Position) -> None:
        """What `raytrain.context()` tells the pipeline's hooks during the step at `position`."""
        show_plan(self.cfg, self.runtime, self.batch_plan, self.total_steps)
        _CONTEXT.epoch = position.epoch
        _CONTEXT.step = position.step
        _CONTEXT.samples_seen = position.samples_seen
        _CONTEXT.lr = self.lr_at(position.samples_seen)

    def phases(self, position: Position, timed: bool) -> StepPhases:
        """The instrumentation of the step at `position`; `timed`: a steady step, whose phase
        times add to the position's."""
        return StepPhases(
            self.heartbeat, position.step, PhaseTimer(self.telemetry.phase_time_s if timed else None, self.phase_sync())
        )

    def gradients(self, data: TableEpoch | StreamEpoch, step: steps.Step, phase: StepPhases) -> None:
        """Forward and backward over this rank's rows of `step` (gradients averaged over ranks)."""
        with self.device_failures(phase):
            self._gradients(data, step, phase)

    def _gradients(self, data: TableEpoch | StreamEpoch, step: steps.Step, phase: StepPhases) -> None:
        step_index = phase.step_index
        for index, piece in enumerate(steps.micro_batches(data.rows(step), self.batch_plan.accumulation_steps)):
            # A rank with no rows in a (micro-)step still runs forward and backward (the data
            # gives one row for an empty piece; weight 0 below) so that it joins the
            # gradient all-reduce.
            with phase("data", timed="data_wait"):
                batch, count = data.batch(piece, self.runtime.device)
                batch = self.augment(batch, index, step_index)
            with phase(timed="forward_backward"):  # includes DDP's all-reduce, overlapped with backward
                # DDP averages gradients over ranks; this weight turns that into the mean
                # over the samples actually present in the step (tail steps are smaller).
                weight = steps.gradient_weight(count, self.runtime.world_size, step.size)
                with self.accumulating(last=index == self.batch_plan.accumulation_steps - 1):
                    with self.counting_flops(count):
                        with phase("forward"):
                            loss, _ = self.compute_loss(batch)
                        with phase("backward"):
                            # A full step's weight is 1: no extra multiply in the graph.
                            self.scaler.scale(loss if weight == 1.0 else loss * weight).backward()
                self.window.add(loss, count, step_index)

    def apply_gradients(self, position: Position, phase: StepPhases) -> float:
        """The optimizer's step at the rate of `position`; returns that rate."""
        lr = self.lr_at(position.samples_seen)
        optim.set_rates(self.optimizer, lr, self.rate_multipliers)
        with self.device_failures(phase), phase("optimizer", timed="optimizer"):
            self.clip_gradients(position.step)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.memory is None:  # once: the gradients and the optimizer's state all exist now
                self.memory = strategy.state_bytes(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        return lr

    @contextlib.contextmanager
    def device_failures(self, phase: StepPhases | str):
        """The device's out-of-memory and device-side assert errors in this block as the user's
        (`raytrain.parallel.device`: never retried), named with this rank and the phase."""
        try:
            yield
        except Exception as exc:
            where = phase if isinstance(phase, str) else PHASE_WORDS.get(phase.current, phase.current)
            failure = device.device_failure(exc, self.runtime.world_rank, where, self.runtime.device)
            if failure is None:
                raise
            raise failure from exc

    @contextlib.contextmanager
    def counting_flops(self, rows: int):
        """The FLOPs of this micro-batch's forward and backward, per row, into the position
        (`raytrain.rules.flops`): rank 0, the first micro-batch with rows of an attempt, run
        eagerly (a compiled model compiles at its next call)."""
        if not self.count_flops or rows == 0:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        # Eager, under --compile too: Dynamo skips a frame first seen under a dispatch mode
        # and never compiles its code afterwards.
        with strategy.eager(self.model), counter:
            yield
        self.count_flops = False
        self.telemetry.flops_per_sample = counter.get_total_flops() / rows
        device = self.runtime.device
        self.telemetry.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type

    def clip_gradients(self, step_index: int) -> None:
        if self.cfg.grad_clip_norm is None:
            return
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16's scaled ones
        norm = strategy.full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm))
        if not self.scaler.is_enabled():  # under fp16 an inf norm is an overflow the scaler skips, not divergence
            self.window.note_if_bad(norm, step_index)

    def sync_device(self) -> None:
        # GPU kernels run asynchronously: without a sync, phase times land on whatever
        # waits next. Only when asked (raytrain bench), as it costs overlap.
        if self.cfg.time_phases and self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)

    def phase_sync(self) -> Callable[[], None]:
        """What the phase timer calls at each lap: `sync_device`, or nothing where it would do nothing."""
        return self.sync_device if self.cfg.time_phases and self.runtime.device.type == "cuda" else _nothing

    def autocast(self):
        """The forward's precision: the strategy's policy (`holding.Holding.autocast`)."""
        return self.holding.autocast(self.runtime.device.type)

    def accumulating(self, last: bool):
        """The gradient reduction over ranks skipped on all micro-batches of a step but the last."""
        return contextlib.nullcontext() if last else strategy.no_gradient_sync(self.model)

    def evaluate(self, source: Any) -> dict[str, float]:
        """Validation loss and metrics, averaged over all validation samples of all ranks (over the
        same --eval-batches global batches every pass, when given)."""
        with self.device_failures("evaluation"):
            return self._evaluate(source)

    @torch.no_grad()
    def _evaluate(self, source: Any) -> dict[str, float]:
        runtime = self.runtime
        self.model.eval()
        batch_size = max(
            1, self.batch_plan.per_worker_max if not self.cfg.micro_batch_size else self.cfg.micro_batch_size
        )
        sums: dict[str, float] = {}
        count = 0
        # A rank without validation rows evaluates one row with weight 0 (n == 0), so every
        # rank learns the metric names and joins the reduction below.
        rank, world = runtime.evaluation_share()
        limit = evaluation_rows(self.cfg)
        batches = source.eval_batches(rank, world, batch_size, runtime.device, limit=limit, seed=self.cfg.seed)
        if self.holding.forward_is_collective and world > 1:
            batches = _in_step(batches, runtime)
        for n, batch in batches:
            loss, metrics = self.compute_loss(batch)
            for name, value in {"loss": loss, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + float(value) * n
            count += n
        names = sorted(sums)
        values = [sums[name] for name in names] + [float(count)]
        totals = runtime.all_reduce_sum(values) if world > 1 else values
        self.model.train()
        return {f"val_{name}": total / totals[-1] for name, total in zip(names, totals[:-1])}

    # -- the pipeline's hooks ------------------------------------------------------------------

    def augment(self, batch: dict[str, torch.Tensor], micro_index: int, step_index: int) -> dict[str, torch.Tensor]:
        """The pipeline's transform_batch under generators seeded from (seed, epoch, step, rank,
        micro-batch): new every epoch, the same after a resume; the run's own streams untouched."""
        if not overrides(self.pipeline, "transform_batch"):
            return batch
        return self.transform(batch, [self.cfg.seed, _CONTEXT.epoch, step_index, self.runtime.world_rank, micro_index])

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
        with self.autocast():
            output = hooks.call(
                self.pipeline, "compute_loss", self.model, Batch(batch), passthrough=strategy.is_collective_failure
            )
        return split_loss(output)


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


def split_loss(output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A pipeline's compute_loss returns loss or (loss, metrics)."""
    if isinstance(output, tuple):
        loss, metrics = output
        return loss, dict(metrics or {})
    return output, {}


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


def _nothing() -> None:
    pass
