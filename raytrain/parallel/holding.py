"""The strategy as an object: how the model is held on the workers, and what follows from it.

`Ddp` (every rank holds the whole model; one process without a group is held the same way)
and `Fsdp` (FSDP2: each rank holds its shards) answer the same questions (`Holding`: the
precision policy, and what `raytrain.worker.state` holds of the model), so that the step and
the training state ask them instead of branching on the strategy's name. `compute_dtype` is
--precision's one map to torch; `unwrap` the user's module inside DDP and torch.compile;
`local_part` a sharded tensor's local shard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from raytrain.errors import CheckpointError

# --precision as the dtype the forward computes in (autocast's, or FSDP2's parameters'); fp32: none.
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype --precision computes in: None for fp32 (no autocast, no mixed-precision policy).
    The one map from the option to torch, for the step's autocast, FSDP2's policy and the
    torchrun baseline."""
    return COMPUTE_DTYPES[precision]


@dataclass(frozen=True)
class Holding:
    """A strategy: how the model is held, its precision policy, and what its state holds
    (`Ddp`, `Fsdp`). `precision`: --precision."""

    precision: str = "fp32"

    name: ClassVar[str]
    holds_whole_model: ClassVar[bool]  # every rank holds all of the model: a checkpoint carries model.pt
    forward_is_collective: ClassVar[bool]  # a forward pass needs every rank (each its own rows)
    memory_note: ClassVar[str]  # what the memory line says of the bytes it counts

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The context a step's forward runs in."""
        raise NotImplementedError

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """fp16's gradient scaler (disabled under bf16 and fp32)."""
        raise NotImplementedError

    def weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model as a plain state_dict on the CPU: what model.pt and an export hold."""
        raise NotImplementedError

    def dcp_target(self, model: nn.Module) -> nn.Module:
        """The module whose state DCP writes and reads by parameter name (with its optimizer)."""
        raise NotImplementedError

    def live_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What a replica healing from this one copies of the model ("model") and the
        optimizer ("optim"), as plain tensors."""
        raise NotImplementedError

    def load_live_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Take a live peer's `live_state`."""
        raise NotImplementedError

    def check_legacy(self, checkpoint: str) -> None:
        """An earlier version's single-file checkpoint (a plain model, an optimizer state keyed
        by parameter index): a CheckpointError where this strategy cannot take it."""


@dataclass(frozen=True)
class Ddp(Holding):
    """--strategy ddp: every rank holds the whole model, wrapped by DistributedDataParallel
    (or torchft's), or plain in one process ("local")."""

    name: str = "ddp"  # "local": one process, nothing wrapped

    holds_whole_model: ClassVar[bool] = True
    forward_is_collective: ClassVar[bool] = False
    memory_note: ClassVar[str] = ""

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """torch.autocast in --precision's dtype; nothing under fp32."""
        dtype = compute_dtype(self.precision)
        return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device_type, dtype=dtype)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device.type, enabled=self.precision == "fp16")

    def weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {key: value.detach().cpu().clone() for key, value in unwrap(model).state_dict().items()}

    def dcp_target(self, model: nn.Module) -> nn.Module:
        """The user's module: its keys without DDP's `module.` or compile's `_orig_mod.`."""
        return unwrap(model)

    def live_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": unwrap(model).state_dict(), "optim": optimizer.state_dict()}

    def load_live_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])


@dataclass(frozen=True)
class Fsdp(Holding):
    """--strategy fsdp: FSDP2 shards each block and the root over the ranks (of a replica group,
    in per-step mode); no rank holds all of the model."""

    name: ClassVar[str] = "fsdp"
    holds_whole_model: ClassVar[bool] = False
    forward_is_collective: ClassVar[bool] = True  # each block's parameters are gathered from all ranks
    memory_note: ClassVar[str] = " (its shards)"

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Nothing: bf16 and fp16 are FSDP2's mixed-precision policy (`mp_policy`)."""
        return contextlib.nullcontext()

    def mp_policy(self) -> Any:
        """FSDP2's mixed-precision policy: parameters in --precision's dtype in compute,
        gradients reduced in fp32; None for fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = compute_dtype(self.precision)
        return None if dtype is None else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """Each rank sees only its shards' gradients, so an overflow found on one rank must skip
        the step on all (ShardedGradScaler all-reduces it)."""
        if self.precision != "fp16":
            return torch.amp.GradScaler(device.type, enabled=False)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=True)

    def weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Gathered from the shards: a collective (every rank calls it); rank 0 gets the
        weights, the others {}."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def dcp_target(self, model: nn.Module) -> nn.Module:
        """The sharded module itself: DCP writes each rank's DTensor shards."""
        return model

    def live_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards (a peer replica group's rank of the same index loads them)."""
        return local_state(model, optimizer)

    def load_live_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        load_local_state(model, optimizer, state)

    def check_legacy(self, checkpoint: str) -> None:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by an earlier raytrain as one file, which --strategy fsdp "
            "cannot reshard; resume it with --strategy ddp, and its next checkpoint resumes under fsdp"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (and torch.compile), so saved keys have no `module.` prefix."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# -- a sharded model's live state (replica groups healing, `raytrain.parallel.hsdp`) ------------


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and of the optimizer's state, as plain tensors (a peer
    group's rank of the same index loads them: `load_local_state`)."""
    optim = optimizer.state_dict()
    shards = {
        index: {key: local_part(value) for key, value in entry.items()} for index, entry in optim["state"].items()
    }
    weights = {name: local_part(value) for name, value in model.state_dict().items()}
    return {"model": weights, "optim": {"state": shards, "param_groups": optim["param_groups"]}}


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Copy a peer's shards (`local_state`) into this rank's: the parameters in place, the
    optimizer's state as tensors of this rank's layout (a fresh optimizer has none yet)."""
    with torch.no_grad():
        for name, value in model.state_dict().items():
            local_part(value).copy_(state["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    entries = {}
    for index, entry in state["optim"]["state"].items():
        param = params[int(index)]
        entries[index] = {key: _like(param, value) for key, value in entry.items()}
    optimizer.load_state_dict({"state": entries, "param_groups": state["optim"]["param_groups"]})


def _like(param: torch.Tensor, value: Any) -> Any:
    """A copy of `value` (a plain tensor) in `param`'s layout: a shard of a sharded parameter
    becomes a DTensor on its mesh; a step count or a scalar stays plain. A copy: what a
    transport hands over may still be the sender's own storage."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().clone()
    if isinstance(param, DTensor) and value.shape == param.to_local().shape:
        # The parameter's global shape and stride: FSDP2 shards unevenly (the last ranks may
        # hold fewer rows), which a shape inferred from this rank's rows would get wrong.
        return DTensor.from_local(
            value.to(param.device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.size(),
            stride=param.stride(),
        )
    return value
