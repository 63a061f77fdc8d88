"""The optimization section of `TrainConfig`: how long a run trains, the batch, the learning
rate with its warmup and schedule, and the optimizer (`OptimizationSection`). Its own checks
sit in `OptimizationSection.own_problems`; what also depends on another section (the global
batch against the worker count) in `raytrain.config.checks.across_sections`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Literal, get_args

from raytrain.config.checks import positive_int

LRRule = Literal["linear", "sqrt", "none"]
ScheduleName = Literal["cosine", "constant", "linear", "step", "onecycle"]
OptimizerName = Literal["adamw", "sgd", "lamb"]
LR_RULES = get_args(LRRule)


def comma_numbers(text: str) -> list[float | int]:
    """`30,60,80` -> [30, 60, 80] (epochs may be fractional: 0.5,1.5)."""
    try:
        values = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"got {text!r}; expected comma-separated numbers, e.g. 30,60") from None
    return [int(v) if v.is_integer() else v for v in values]


@dataclass(kw_only=True)
class OptimizationSection:
    """How long the run trains, on what batch, at what rate, with which optimizer."""

    epochs: int | None = field(default=None, metadata={"default_text": "5; none with --max-steps alone"})
    """Passes over the training set (each one every row once). With --max-steps too: whichever comes first."""
    max_steps: int | None = field(default=None, metadata={"instead_of": "epochs"})
    """Stop after this many optimizer steps, mid-epoch if need be (a checkpoint and the final model there); the
    schedule spans them. With --epochs too: whichever comes first."""
    global_batch_size: int | None = field(default=None, metadata={"instead_of": "batch_size_per_worker"})
    """Samples per optimizer step across all workers, whatever the worker count."""
    batch_size_per_worker: int | None = field(default=None, metadata={"default_text": "32 without --global-batch-size"})
    """Samples per optimizer step on each worker (global = this × workers)."""
    micro_batch_size: int | None = None
    """Most samples one worker puts through one forward pass; larger shares use gradient accumulation."""
    lr: float = 1e-3
    """Learning rate tuned for `reference_batch_size` (the single-GPU recipe)."""
    lr_scaling: LRRule = "linear"
    """How the peak rate follows the global batch: linear, sqrt or none."""
    reference_batch_size: int | None = field(default=None, metadata={"default_text": "the per-worker batch"})
    """The batch `lr` was tuned for."""
    warmup_epochs: float | None = field(default=None, metadata={"default_text": "1; 0 with --warmup-steps"})
    """Gradual warmup from `lr` (or from warmup_start_factor × the peak) to the scaled peak, in epochs (counted in
    samples)."""
    warmup_steps: int | None = field(default=None, metadata={"instead_of": "warmup_epochs"})
    """The warmup in optimizer steps instead of epochs (counted in samples: steps × the planned global batch, so a
    resize never changes it)."""
    schedule: ScheduleName = "cosine"
    """After warmup: cosine (to 0), constant, linear (to 0), step (×lr_gamma at each of lr_milestones) or onecycle; a
    pipeline's lr_factor(progress) replaces it."""
    lr_milestones: list | None = field(default=None, metadata={"parse": comma_numbers, "metavar": "EPOCH,..."})
    """With --schedule step: the epochs at which the rate is multiplied by lr_gamma, e.g. 30,60,80."""
    lr_gamma: float = 0.1
    """With --schedule step: the factor applied at each milestone."""
    warmup_start_factor: float | None = None
    """Warmup starts at this fraction of the peak rate (e.g. 0.01); default: at lr, the unscaled rate (Goyal et al.)."""
    optimizer: OptimizerName = field(default="adamw", metadata={"on_resume": "state"})
    """adamw, sgd (momentum, optionally Nesterov) or lamb (large-batch Adam, from pytorch-optimizer); a pipeline's
    build_optimizer replaces it."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    """SGD with Nesterov momentum."""
    weight_decay: float = 0.01
    """Weight decay (decoupled for adamw and lamb, L2 for sgd)."""
    decay_norm_and_bias: bool = field(default=True, metadata={"on_resume": "state"})
    """Apply weight decay to biases and normalization weights too (--no-decay-norm-and-bias: only to weight matrices
    and kernels)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this (after unscaling, under fp16); none by default."""

    def fill_defaults(self) -> None:
        """The defaults that depend on what else was given: a per-worker batch of 32 without a
        global batch, 5 epochs without --max-steps, one warmup epoch without --warmup-steps."""
        if self.global_batch_size is None and self.batch_size_per_worker is None:
            self.batch_size_per_worker = 32
        if self.epochs is None and self.max_steps is None:
            self.epochs = 5
        if self.warmup_epochs is None:
            self.warmup_epochs = 0.0 if self.warmup_steps is not None else 1.0

    def own_problems(self) -> Iterable[tuple[str, str]]:
        """The length, the batch and the rates, each against what it means."""
        yield from positive_int("epochs", self.epochs, 5)
        yield from positive_int("max_steps", self.max_steps, 1000)
        yield from positive_int("global_batch_size", self.global_batch_size, 256)
        yield from positive_int("batch_size_per_worker", self.batch_size_per_worker, 32)
        yield from positive_int("micro_batch_size", self.micro_batch_size, 16)
        yield from positive_int("reference_batch_size", self.reference_batch_size, 32)
        if self.global_batch_size is not None and self.batch_size_per_worker is not None:
            yield (
                "global_batch_size",
                f"got {self.global_batch_size} together with --batch-size-per-worker {self.batch_size_per_worker}; "
                "set exactly one: --global-batch-size keeps the optimizer's batch fixed whatever the worker "
                "count, --batch-size-per-worker lets it grow with the workers",
            )
        yield from self._rate_problems()

    def _rate_problems(self) -> Iterable[tuple[str, str]]:
        """The learning rate, its warmup and schedule, and the optimizer's knobs."""
        if not (self.lr > 0 and self.lr < float("inf")):
            yield "lr", f"got {self.lr}; must be a positive number, e.g. --lr 1e-3"
        yield from self._milestone_problems()
        if not 0 < self.lr_gamma <= 1:
            yield "lr_gamma", f"got {self.lr_gamma}; must be in (0, 1], e.g. --lr-gamma 0.1"
        start = self.warmup_start_factor
        if start is not None and not 0 <= start <= 1:
            yield "warmup_start_factor", f"got {start}; must be in [0, 1], e.g. --warmup-start-factor 0.01"
        if not 0 <= self.momentum < 1:
            yield "momentum", f"got {self.momentum}; must be in [0, 1), e.g. --momentum 0.9"
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            yield "nesterov", "applies to --optimizer sgd with a --momentum above 0"
        if self.grad_clip_norm is not None and not 0 < self.grad_clip_norm < math.inf:
            yield "grad_clip_norm", f"got {self.grad_clip_norm}; must be a positive norm, e.g. --grad-clip-norm 1.0"
        yield from self._warmup_problems()
        if not 0 <= self.weight_decay < math.inf:
            yield "weight_decay", f"got {self.weight_decay}; must be 0 or more"

    def _warmup_problems(self) -> Iterable[tuple[str, str]]:
        if not 0 <= self.warmup_epochs < math.inf:
            yield "warmup_epochs", f"got {self.warmup_epochs}; must be 0 or more, e.g. --warmup-epochs 1"
        elif self.warmup_steps is not None and self.warmup_epochs > 0:
            yield (
                "warmup_steps",
                f"got {self.warmup_steps} together with --warmup-epochs {self.warmup_epochs:g}; give the warmup one "
                "way: in steps (--warmup-steps) or in epochs (--warmup-epochs)",
            )
        elif self.epochs is not None and self.epochs >= 1 and self.warmup_epochs > self.epochs:
            yield (
                "warmup_epochs",
                f"got {self.warmup_epochs}, longer than the {self.epochs} epochs of the run; lower it or raise "
                "--epochs",
            )
        if self.warmup_steps is not None and self.warmup_steps < 0:
            yield "warmup_steps", f"got {self.warmup_steps}; must be 0 or more, e.g. --warmup-steps 100"
        elif self.warmup_steps is not None and self.max_steps is not None and self.warmup_steps > self.max_steps:
            yield (
                "warmup_steps",
                f"got {self.warmup_steps}, longer than the {self.max_steps} steps of the run (--max-steps); lower it "
                "or raise --max-steps",
            )

    def _milestone_problems(self) -> Iterable[tuple[str, str]]:
        milestones = self.lr_milestones
        if self.schedule == "step" and not milestones:
            yield "lr_milestones", "--schedule step needs the epochs at which to decay, e.g. --lr-milestones 30,60"
        if milestones is None:
            return
        if self.schedule != "step":
            why = f"milestones apply to --schedule step only (the schedule is {self.schedule})"
            yield "lr_milestones", f"got {milestones}; {why}"
            return
        if not all(isinstance(m, (int, float)) and not isinstance(m, bool) for m in milestones):
            yield "lr_milestones", f"got {milestones}; give epochs as numbers, e.g. --lr-milestones 30,60"
        elif any(b <= a for a, b in zip(milestones, milestones[1:])) or milestones[0] <= 0:
            why = f"got {milestones}; epochs must be positive and increasing, e.g. --lr-milestones 30,60"
            yield "lr_milestones", why
