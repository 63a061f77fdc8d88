"""How the model is held on the workers: `--strategy ddp` or `fsdp`, with `--activation-checkpointing`
and `--compile` on the pipeline's blocks.

The order is TorchTitan's: activation checkpointing on each block, then `torch.compile` (each
block under fsdp, the whole model under ddp: `compile_in_place`), then FSDP2's `fully_shard` on each block and on
the root, or DistributedDataParallel around the whole. Compiling and checkpointing never rename
a parameter (`compile_in_place` compiles in place; the checkpoint wraps the block's forward),
so the state a checkpoint or an export holds is keyed the same under every combination.

`Prepared` says what was done: the strategy as an object (`raytrain.parallel.holding`: its
precision policy and what its state holds), and for the plan line which modules were sharded
and how many parameters this rank holds. `is_collective_failure` tells a lost or stalled peer
(retried) from the user's error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from raytrain import hooks
from raytrain.errors import ConfigError, PipelineCodeError
from raytrain.meta import build_on_meta, is_meta
from raytrain.parallel.holding import Ddp, Fsdp, Holding, local_part
from raytrain.pipeline import overrides

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.config import TrainConfig
    from raytrain.pipeline import Pipeline


class Placement(Protocol):
    """Where the model goes (the worker's runtime, `raytrain.worker.runtime.Runtime`): its device,
    whether a process group exists and of how many, and DDP's wrapping."""

    device: torch.device
    distributed: bool
    world_size: int

    def prepare_model(self, model: nn.Module, ddp_kwargs: dict[str, Any]) -> nn.Module: ...


@dataclass(frozen=True)
class Prepared:
    """The model as the strategy prepared it, the strategy, and what the plan line says of it."""

    model: nn.Module
    strategy: Holding  # Fsdp, or Ddp ("ddp", or "local": one process, nothing to wrap)
    blocks: tuple[str, ...]  # the blocks' names in the model ("blocks.0", ...)
    local_parameters: int  # parameters this rank holds (its shards under fsdp)
    total_parameters: int
    checkpointed: bool = False  # --activation-checkpointing on the blocks
    compiled: bool = False  # --compile
    materialized: bool = False  # built on the meta device, each rank filled only its shards

    @classmethod
    def plain(cls, model: nn.Module, precision: str = "fp32") -> "Prepared":
        """`model` held whole by one process, wrapped by nothing (local mode's holding; what a
        step runner built by hand, without a pipeline's build, steps with)."""
        count = sum(p.numel() for p in model.parameters())
        return cls(model, Ddp(precision, name="local"), (), count, count)

    def describe(self) -> str:
        """What the plan line says of the model, when there is more to say than DDP's default:
        `fsdp over 2 blocks (blocks.0–blocks.1) and the root, 1.1M of 2.2M parameters on this
        rank; activation checkpointing on 2 blocks; to compile per block`; "" otherwise."""
        parts = []
        sharded = not self.strategy.holds_whole_model
        if sharded:
            held = f"{_count(self.local_parameters)} of {_count(self.total_parameters)} parameters on this rank"
            parts.append(
                f"fsdp over {self._blocks()} and the root, {held}" if self.blocks else f"fsdp over the root, {held}"
            )
        if self.materialized:
            parts.append("built on the meta device, each rank reading only its shards")
        if self.checkpointed:
            where = self._blocks() if self.blocks else "the whole model (no blocks)"
            parts.append(f"activation checkpointing on {where}")
        if self.compiled:  # whether Dynamo built a graph is known after the first steps (their event)
            parts.append("to compile per block" if sharded and self.blocks else "to compile")
        return "; ".join(parts)

    def _blocks(self) -> str:
        span = f"{self.blocks[0]}–{self.blocks[-1]}" if len(self.blocks) > 1 else self.blocks[0]
        return f"{len(self.blocks)} block{'s' if len(self.blocks) != 1 else ''} ({span})"


def blocks_of(pipeline: "Pipeline", model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pipeline's blocks (`shard_modules`, checked by `raytrain.hooks`: distinct submodules
    of the model, none the model itself or inside another), as (name, module) pairs in model
    order."""
    chosen = hooks.call(pipeline, "shard_modules", model)
    names = {id(module): name for name, module in model.named_modules() if name}
    return sorted(((names[id(m)], m) for m in chosen), key=lambda item: list(names.values()).index(item[0]))


def check_model(pipeline: "Pipeline", model: Any) -> None:
    """What every strategy needs of build_model's result (`raytrain.hooks`): a module with
    parameters."""
    problem = hooks.HOOKS["build_model"].check(model, None)
    if problem:
        raise PipelineCodeError(f"pipeline {pipeline.name}: build_model {problem}")


def check_compiler(device_type: str) -> None:
    """`--compile` needs a C++ compiler on CPU (TorchInductor's C++ backend) and Triton on a GPU:
    a ConfigError naming what is missing, before anything is compiled."""
    cuda, compiler = device_type == "cuda", os.environ.get("CXX") or "g++"
    if cuda and importlib.util.find_spec("triton") is None:
        problem = "needs Triton on a GPU (pip install triton), which is not installed; drop --compile"
    elif cuda and not any(shutil.which(cc) for cc in (os.environ.get("CC") or "cc", "gcc", "clang")):
        problem = (
            "needs a C compiler on GPU workers (Triton builds its launcher with one; none of cc, gcc, clang is on "
            "PATH): install one (apt-get install gcc), set CC, or drop --compile"
        )
    elif not cuda and shutil.which(compiler) is None and shutil.which("c++") is None:
        problem = (
            f"needs a C++ compiler on CPU workers ({compiler} is not on PATH): install one (apt-get install g++), "
            "set CXX, or drop --compile"
        )
    else:
        return
    raise ConfigError([("compile", problem)])


def build_and_prepare(pipeline: "Pipeline", cfg: "TrainConfig", runtime: Placement) -> Prepared:
    """The pipeline's model, held as `cfg` asks. Under fsdp, a pipeline that defines
    `materialize` has its model built on the meta device (no storage), sharded, given storage
    for this rank's shards only, and filled by `materialize` (`raytrain.meta`): no rank ever
    holds the whole model. Every other pipeline and strategy: built whole, then `prepare`."""
    if cfg.strategy == "fsdp" and runtime.device.type == "cpu":
        fix_mmap_threshold()
    if cfg.strategy == "fsdp" and runtime.distributed and overrides(pipeline, "materialize"):
        model = build_on_meta(lambda: hooks.call(pipeline, "build_model", cfg))
        prepared = prepare(pipeline, model, cfg, runtime)
        if is_meta(prepared.model):
            prepared.model.to_empty(device=runtime.device)
            hooks.call(pipeline, "materialize", prepared.model, cfg)
            return dataclasses.replace(prepared, materialized=True)
        return prepared
    return prepare(pipeline, hooks.call(pipeline, "build_model", cfg), cfg, runtime)


# glibc's mallopt parameter, and the threshold a CPU fsdp worker fixes it at (64 KiB).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have glibc map every allocation of `threshold_bytes` (64 KiB) or more on its own and give
    it back when freed.

    FSDP gathers a block's parameters for its forward and backward and frees them, step after
    step. glibc raises its mmap threshold after the first such free (up to 32 MiB), so later
    blocks come from its heap arenas, which fragment and keep what they took: a CPU worker's
    peak RSS then stays near the 1-worker figure at any worker count. With the threshold fixed
    it falls with N (benchmarks/RESULTS.md §19). A MALLOC_MMAP_THRESHOLD_ in the environment
    is the user's own choice, already applied by glibc, and is kept. False where it is kept or
    there is no glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc only (not macOS, not musl's)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1)


def prepare(pipeline: "Pipeline", model: nn.Module, cfg: "TrainConfig", runtime: Placement) -> Prepared:
    """The model as `cfg` asks: BatchNorm over the global batch (--sync-batchnorm), blocks
    checkpointed and compiled, then sharded (fsdp) or wrapped (ddp), on the worker's device (a
    model on the meta device is sharded there: `build_and_prepare` gives it storage)."""
    check_model(pipeline, model)
    if cfg.sync_batchnorm:  # before the blocks are picked and DDP or FSDP sees the modules
        from raytrain.parallel.batchnorm import sync_batchnorm_layers

        model = sync_batchnorm_layers(model, runtime.device)
    picked = blocks_of(pipeline, model)
    blocks = [module for _, module in picked]
    total = sum(p.numel() for p in model.parameters())
    if cfg.compile:
        check_compiler(runtime.device.type)
    if cfg.activation_checkpointing:
        for block in blocks or [model]:  # without blocks, the model is one
            checkpoint_activations(block)
    if cfg.strategy == "fsdp" and runtime.distributed:
        check_shard_units(pipeline, model, picked)
        if cfg.compile:
            for block in blocks:
                compile_in_place(block)
        model = shard(model if is_meta(model) else model.to(runtime.device), blocks, cfg)
        strategy: Holding = Fsdp(cfg.precision)
    else:
        if cfg.compile:
            compile_in_place(model)
        model = runtime.prepare_model(model, dataclasses.asdict(cfg.ddp))
        strategy = Ddp(cfg.precision, name="ddp" if runtime.distributed and runtime.world_size > 1 else "local")
    local = sum(local_part(p).numel() for p in model.parameters())
    names = tuple(name for name, _ in picked)
    return Prepared(
        model, strategy, names, local, total, checkpointed=cfg.activation_checkpointing, compiled=cfg.compile
    )


def shard(model: nn.Module, blocks: list[nn.Module], cfg: "TrainConfig") -> nn.Module:
    """FSDP2: each block its own unit (its parameters gathered for its forward and backward
    only), then the root holding the rest. bf16 and fp16 are FSDP2's mixed-precision policy
    (`Fsdp.mp_policy`: parameters in that dtype in compute, fp32 gradient reduction)."""
    from torch.distributed.fsdp import fully_shard

    options: dict[str, Any] = {"reshard_after_forward": cfg.fsdp_reshard_after_forward}
    policy = Fsdp(cfg.precision).mp_policy()
    if policy is not None:
        options["mp_policy"] = policy
    for block in blocks:
        fully_shard(block, **options)
    # The root without reshard_after_forward: FSDP2's default keeps its parameters for the
    # backward, which starts with them at once.
    fully_shard(model, **{k: v for k, v in options.items() if k != "reshard_after_forward"})
    return model


def check_shard_units(pipeline: "Pipeline", model: nn.Module, picked: list[tuple[str, nn.Module]]) -> None:
    """FSDP2 holds a parameter in one unit only, and says so at the first forward, inside
    compute_loss: tied parameters (an embedding's weight that is also the output layer's) that
    shard_modules split over two units are the hook's error, named here before anything is
    sharded, with the fix."""
    split = split_parameters(model, picked)
    if not split:
        return
    names = [" and ".join(f"{name} ({unit})" for unit, name in units) for units in split[:3]]
    more = f" (and {len(split) - 3} more)" if len(split) > 3 else ""
    raise PipelineCodeError(
        f"pipeline {pipeline.name}: shard_modules puts one parameter in two FSDP units under --strategy fsdp: "
        f"{'; '.join(names)}{more} are one tied parameter, and FSDP2 holds a parameter in one unit only: leave the "
        "modules that share it out of shard_modules (the root then holds them), or return one module holding them "
        "all, or untie them" + hooks.where(pipeline, "shard_modules")
    )


def split_parameters(model: nn.Module, picked: list[tuple[str, nn.Module]]) -> list[list[tuple[str, str]]]:
    """The parameters that would be in two FSDP units: for each, its (unit, name) pairs, one per
    unit. A unit is a block (`picked`: its name) or the root ("the root": every module not
    inside a block), as FSDP2 assigns them: by module, so a module reached by two paths is
    the same unit's."""
    blocks = {id(module): f"block {name}" for name, module in picked}
    found: dict[int, dict[str, str]] = {}  # parameter -> unit -> its first name there

    def visit(module: nn.Module, prefix: str, unit: str, path: tuple[int, ...]) -> None:
        unit = blocks.get(id(module), unit)
        for name, parameter in module.named_parameters(recurse=False):
            found.setdefault(id(parameter), {}).setdefault(unit, prefix + name)
        for name, child in module.named_children():
            if id(child) not in path:
                visit(child, f"{prefix}{name}.", unit, (*path, id(child)))

    visit(model, "", "the root", (id(model),))
    return [list(units.items()) for units in found.values() if len(units) > 1]


# gloo's errors are bare RuntimeErrors whose message opens with gloo's source location. On
# torch 2.13, a peer that exits or is killed in a collective gives "[.../third_party/gloo/gloo/
# transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:port. This is typically caused
# by a remote worker crashing…", and one that stalls past the timeout "[.../gloo/transport/tcp/
# unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete" (all_reduce,
# its async wait and DDP's backward alike; tests/gloo_peers.py). NCCL's (DistBackendError) and the store's
# (DistStoreError, DistNetworkError) are typed.
_GLOO_ERROR = re.compile(r"^\[[^\]\n]*\bgloo/[^\]\n]*:\d+\] ")


def is_collective_failure(exc: BaseException) -> bool:
    """A failure of the collectives (a peer that died or stalled: a worker fault, retried), not
    of the user's code: torch's DistError and its subclasses, Ray's for a lost actor, worker or
    node, or gloo's RuntimeError; in `exc` or the exceptions it was raised from."""
    lost: tuple[type[BaseException], ...] = (torch.distributed.DistError,)
    ray_errors = sys.modules.get("ray.exceptions")  # not imported: no Ray error can be in the chain
    if ray_errors is not None:
        lost += (
            ray_errors.RayActorError,
            ray_errors.WorkerCrashedError,
            ray_errors.NodeDiedError,
            ray_errors.LocalRayletDiedError,
            ray_errors.OwnerDiedError,
        )
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, lost) or (isinstance(exc, RuntimeError) and _GLOO_ERROR.match(str(exc))):
            return True
        exc = exc.__cause__
    return False


def compile_in_place(module: nn.Module, **options: Any) -> None:
    """torch.compile `module` in place (its parameters' names kept; its hooks run eagerly), with
    a frame of raytrain's around its forward for Dynamo to start from.

    `nn.Module.compile` compiles `Module._call_impl`, and Dynamo skips the frames of torch.nn's own
    code at the top: with a module whose forward is torch.nn's (an `nn.Sequential`, a bare
    `nn.Linear`) nothing is left for it to compile, and the model runs eager (torch 2.13; pytorch
    issue 150915). From this frame Dynamo inlines torch.nn's forwards, as `torch.compile(module)`
    does; blocks of one class still share their graphs."""
    forward = module.forward

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    module.forward = compiled_forward
    module.compile(**options)


def graphs_built() -> tuple[int, float] | None:
    """Graphs Dynamo has built in this process, and the seconds it spent compiling (frames, and
    the backward graphs compiled at their first call); None where this torch keeps no such
    count (Dynamo's counters are not public: a torch that moved them leaves a run not counted,
    never failed)."""
    try:
        from torch._dynamo.utils import calculate_time_spent, counters

        return int(counters["stats"]["unique_graphs"]), float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - the same torch on every rank: none of them counts
        return None


@contextlib.contextmanager
def eager(model: nn.Module):
    """`model` and its submodules called without their `nn.Module.compile` (which keeps the
    compiled call beside the module's own), given back after."""
    compiled = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    for module, _ in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, call in compiled:
            module._compiled_call_impl = call


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


def _nbytes(tensor: torch.Tensor) -> int:
    local = local_part(tensor)
    return local.numel() * local.element_size()


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
