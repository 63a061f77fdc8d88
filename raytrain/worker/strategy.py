"""How the model is held on the workers: `--strategy ddp` or `fsdp`, with `--activation-checkpointing`
and `--compile` on the pipeline's blocks.

The order is TorchTitan's: activation checkpointing on each block, then `torch.compile` (each
block under fsdp, the whole model under ddp), then FSDP2's `fully_shard` on each block and on
the root, or DistributedDataParallel around the whole. Compiling and checkpointing never rename
a parameter (`nn.Module.compile` compiles in place; the checkpoint wraps the block's forward),
so the state a checkpoint or an export holds is keyed the same under every combination.

`Prepared` says what was done, for the plan line: which modules were sharded and how many
parameters this rank holds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raytrain.errors import ConfigError, PipelineCodeError, pipeline_code

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.pipeline import Pipeline
    from raytrain.worker.runtime import Runtime


@dataclass(frozen=True)
class Prepared:
    """The model as the strategy prepared it, and what the plan line says of it."""

    model: nn.Module
    strategy: str  # "ddp", "fsdp", or "local" (one process, nothing to wrap)
    blocks: tuple[str, ...]  # the blocks' names in the model ("blocks.0", ...)
    local_parameters: int  # parameters this rank holds (its shards under fsdp)
    total_parameters: int
    checkpointed: bool = False  # --activation-checkpointing on the blocks
    compiled: bool = False  # --compile

    def describe(self) -> str:
        """What the plan line says of the model, when there is more to say than DDP's default:
        `fsdp over 2 blocks (blocks.0–blocks.1) and the root, 1.1M of 2.2M parameters on this
        rank; activation checkpointing on 2 blocks; compiled per block`; "" otherwise."""
        parts = []
        if self.sharded:
            held = f"{_count(self.local_parameters)} of {_count(self.total_parameters)} parameters on this rank"
            parts.append(
                f"fsdp over {self._blocks()} and the root, {held}" if self.blocks else f"fsdp over the root, {held}"
            )
        if self.checkpointed:
            where = self._blocks() if self.blocks else "the whole model (no blocks)"
            parts.append(f"activation checkpointing on {where}")
        if self.compiled:
            parts.append("compiled per block" if self.sharded and self.blocks else "compiled")
        return "; ".join(parts)

    def _blocks(self) -> str:
        span = f"{self.blocks[0]}–{self.blocks[-1]}" if len(self.blocks) > 1 else self.blocks[0]
        return f"{len(self.blocks)} block{'s' if len(self.blocks) != 1 else ''} ({span})"

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every outermost `nn.ModuleList`/`nn.Sequential` inside the model (the
    transformer convention: `model.layers`, `model.blocks`); none if it has no such container.
    The model itself, when it is a Sequential, is not its own container of blocks."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                found.extend(block for block in child.children() if any(True for _ in block.parameters()))
            else:
                visit(child)

    visit(model)
    return found


def blocks_of(pipeline: "Pipeline", model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pipeline's blocks (`shard_modules`), checked: a list of distinct submodules of the
    model, none the model itself or inside another. (name, module) pairs, in model order."""
    with pipeline_code(pipeline, "shard_modules"):
        chosen = pipeline.shard_modules(model)
    what = f"pipeline {pipeline.name}: shard_modules must return a list of the model's own submodules"
    if not isinstance(chosen, (list, tuple)) or not all(isinstance(m, nn.Module) for m in chosen):
        got = type(chosen).__name__ if not isinstance(chosen, (list, tuple)) else "a list holding non-modules"
        raise PipelineCodeError(f"{what}; it returned {got}")
    names = {id(module): name for name, module in model.named_modules() if name}
    strangers = [type(m).__name__ for m in chosen if id(m) not in names]
    if strangers:
        raise PipelineCodeError(
            f"{what}; {len(strangers)} of them ({', '.join(sorted(set(strangers)))}) are not inside the model built by "
            "build_model (or are the model itself): return modules of `model`, e.g. list(model.layers)"
        )
    if len({id(m) for m in chosen}) != len(chosen):
        raise PipelineCodeError(f"{what}; it names a module twice")
    picked = sorted(((names[id(m)], m) for m in chosen), key=lambda item: list(names.values()).index(item[0]))
    nested = [a for a, _ in picked for b, _ in picked if a != b and a.startswith(b + ".")]
    if nested:
        raise PipelineCodeError(f"{what}, none inside another; {nested[0]} is inside another one returned")
    return picked


def check_model(pipeline: "Pipeline", model: Any) -> None:
    """What every strategy needs of build_model's result: a module with parameters."""
    if not isinstance(model, nn.Module):
        raise PipelineCodeError(
            f"pipeline {pipeline.name}: build_model returned a {type(model).__name__}, not a torch.nn.Module"
        )
    if not any(True for _ in model.parameters()):
        raise PipelineCodeError(
            f"pipeline {pipeline.name}: build_model returned a {type(model).__name__} without parameters: there is "
            "nothing "
            "to train; return the model with its layers (nn.Linear, nn.Conv2d, ...)"
        )


def check_compiler(device_type: str) -> None:
    """`--compile` needs a C++ compiler on CPU (TorchInductor's C++ backend) and Triton on a GPU:
    a ConfigError naming what is missing, before anything is compiled."""
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(
                [("compile", "needs Triton on a GPU (pip install triton), which is not installed; drop --compile")]
            )
        return
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None and shutil.which("c++") is None:
        raise ConfigError(
            [
                (
                    "compile",
                    f"needs a C++ compiler on CPU workers ({compiler} is not on PATH): install one (apt-get install "
                    "g++), "
                    "set CXX, or drop --compile",
                )
            ]
        )


def prepare(pipeline: "Pipeline", model: nn.Module, cfg: "TrainConfig", runtime: "Runtime") -> Prepared:
    """The model as `cfg` asks: blocks checkpointed and compiled, then sharded (fsdp) or wrapped
    (ddp), on the worker's device."""
    check_model(pipeline, model)
    picked = blocks_of(pipeline, model)
    blocks = [module for _, module in picked]
    total = sum(p.numel() for p in model.parameters())
    if cfg.compile:
        check_compiler(runtime.device.type)
    if cfg.activation_checkpointing:
        for block in blocks or [model]:  # without blocks, the model is one
            checkpoint_activations(block)
    if cfg.strategy == "fsdp" and runtime.distributed:
        if cfg.compile:
            for block in blocks:
                block.compile()
        model = shard(model.to(runtime.device), blocks, cfg)
        strategy = "fsdp"
    else:
        if cfg.compile:
            model.compile()
        model = runtime.prepare_model(model, _ddp_kwargs(cfg))
        strategy = "ddp" if runtime.distributed and runtime.world_size > 1 else "local"
    local = sum(_local(p).numel() for p in model.parameters())
    names = tuple(name for name, _ in picked)
    return Prepared(
        model, strategy, names, local, total, checkpointed=cfg.activation_checkpointing, compiled=cfg.compile
    )


def shard(model: nn.Module, blocks: list[nn.Module], cfg: "TrainConfig") -> nn.Module:
    """FSDP2: each block its own unit (its parameters gathered for its forward and backward
    only), then the root holding the rest. bf16 is FSDP2's mixed-precision policy: bf16
    parameters in compute, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {"reshard_after_forward": cfg.fsdp_reshard_after_forward}
    if cfg.precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    try:
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
    except ValueError as exc:
        if "shared with a parameter" not in str(exc):
            raise
        # Tied weights (an embedding and the output layer, say) in two FSDP units.
        raise PipelineCodeError(
            f"--strategy fsdp cannot shard these blocks: a parameter is shared between two of them, or between a "
            f"block and the rest of the model ({str(exc).splitlines()[0][:200]}); keep tied modules in one block "
            "(or both outside the blocks) in the pipeline's shard_modules"
        ) from None
    return model


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute `block`'s activations in the backward pass: its forward runs under
    torch.utils.checkpoint (non-reentrant), keeping only its inputs. The module and its
    parameters' names are unchanged."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def grad_scaler(device: torch.device, enabled: bool, *, sharded: bool) -> torch.amp.GradScaler:
    """fp16's gradient scaler. Under fsdp each rank sees only its shards' gradients, so an
    overflow found on one rank must skip the step on all (ShardedGradScaler all-reduces it)."""
    if sharded and enabled:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=True)
    return torch.amp.GradScaler(device.type, enabled=enabled)


def no_gradient_sync(model: nn.Module):
    """A context in which backward passes accumulate gradients without reducing them over the
    ranks (micro-batches but the last of a step): DDP's no_sync, FSDP2's
    set_requires_gradient_sync(False)."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters, their gradients and the optimizer's state (its
    local shards under fsdp): what --strategy decides."""
    params = list(model.parameters())
    return {
        "parameters": sum(_nbytes(p) for p in params),
        "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _ddp_kwargs(cfg: "TrainConfig") -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg.ddp)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
