"""The training state: the one owner of what a checkpoint, a healed replica and an export hold.

`TrainingState` is a worker's model, optimizer, gradient scaler and position. It alone says
what each of these holds, under --strategy ddp and fsdp alike:

- a checkpoint (`save` / `load`): the model and optimizer by parameter name, as DCP files every
  rank writes its own part of (DCP reshards on load: any worker count, either strategy); and,
  written by rank 0, the train state (the scaler, every rank's RNG state, the position, and
  the rules the run had then), plus the plain model when a rank holds all of it
  (`raytrain.rundir.checkpoints` names the files);
- a replica that heals from a live peer in per-step mode (`live` / `load_live`): model,
  optimizer, scaler and position, not the RNG states, which stay each replica's own;
- an export and the final `model.pt` (`weights`): the plain model, without `module.` or
  `_orig_mod.` prefixes, on the CPU (gathered from the shards under fsdp).

What differs between the strategies it asks the strategy (`raytrain.parallel.holding`).

A save is asynchronous where a process group allows it: the loop blocks while the state is
staged in host memory, and the files are written in the background (`Save.wait`).
Where a run continues from is `raytrain.rundir.checkpoints.resume_choice`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from raytrain.errors import CheckpointError
from raytrain.parallel.holding import Ddp, Holding, unwrap
from raytrain.rules.position import Position, Telemetry
from raytrain.rundir import checkpoints, formats
from raytrain.rundir.formats import single_process

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.worker.runtime import Runtime


@dataclass
class TrainingState:
    """A worker's model (as trained: wrapped by DDP or torchft, or sharded by FSDP2), optimizer,
    scaler and position. `holding`: the strategy that holds the model (`holding.Ddp`,
    `holding.Fsdp`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    position: Position
    holding: Holding = field(default_factory=Ddp)
    telemetry: Telemetry = field(default_factory=Telemetry)  # kept beside the position, never needed to resume

    # -- the plain model ----------------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """The model as a plain state_dict on the CPU: what model.pt and an export hold. Under
        fsdp a collective (every rank calls it); rank 0 gets the weights, the others {}."""
        return self.holding.weights(self.model)

    # -- checkpoints --------------------------------------------------------------------------

    def save(self, directory: Path, runtime: "Runtime", rules: dict[str, Any], *, distributed: bool) -> Save:
        """Write a checkpoint of this state into `directory` (every rank calls it: the RNG states
        are gathered). `distributed`: all ranks write their parts of the DCP files together
        (asynchronously when a process group allows it); else this rank writes all of it, in
        a background thread (per-step replicas, local mode). `rules`: the schedule, batch plan
        and rate the run had here, for the resume line."""
        import torch.distributed.checkpoint as dcp

        rng = runtime.all_gather_object(rng_state())
        # Whether this rank writes the small files, as of this step: the writer threads below
        # run on while the loop steps on, and a per-step quorum that changes meanwhile (a group
        # rejoining ahead of this one) renumbers the ranks. Read there, the coordinator that
        # publishes the directory would publish it without its train state.
        rank0 = runtime.is_rank0
        directory.mkdir(parents=True, exist_ok=True)
        train_state = {
            "scaler": self.scaler.state_dict(),
            "rng": rng,
            "position": dataclasses.asdict(self.position),
            "telemetry": dataclasses.asdict(self.telemetry),
            "sharded": not self.holding.holds_whole_model,  # the key as every version has written it
            **rules,
        }
        part = self._dcp_part(runtime.world_rank, runtime.world_size) if distributed else None
        future = dcp.async_save(part, checkpoint_id=str(directory), **runtime.dcp_options()) if distributed else None
        save = Save(directory, future=future)
        writes = _snapshot(self._dcp_state()) if not distributed else None

        def write() -> None:
            try:
                if writes is not None:
                    with single_process():
                        dcp.save(writes, checkpoint_id=str(directory), no_dist=True)
                if rank0:
                    if self.holding.holds_whole_model:  # the plain model too, read back from the files just written
                        plain = writes["model"] if writes is not None else checkpoints.read_model(directory)
                        formats.save_torch(plain, directory / checkpoints.MODEL_FILE)
                    # Last: a train state beside DCP's metadata is what makes the directory a checkpoint.
                    checkpoints.write_train_state(directory, train_state)
            except BaseException as exc:  # surfaced by Save.wait
                save.errors.append(exc)

        # rank 0's small files wait for the shards, so the directory is whole when listed
        def write_after_shards() -> None:
            try:
                future.result()
            except BaseException as exc:
                save.errors.append(exc)
                return
            write()

        if rank0 or not distributed:
            save.thread = threading.Thread(
                target=write_after_shards if distributed else write, name="raytrain-checkpoint", daemon=True
            )
            save.thread.start()
        return save

    def load(
        self, directory: Path, runtime: "Runtime", seed: int, *, distributed: bool, load_optimizer: Callable
    ) -> None:
        """Continue from the checkpoint in `directory`: the model and optimizer (resharded for
        this worker count and strategy), the scaler, and this rank's RNG (restored when the
        world size is unchanged, else derived from (seed, rank, step)). `load_optimizer(fn)`
        runs the optimizer's part, which the pipeline's build_optimizer decides. A file that
        cannot be read is a CheckpointError. A checkpoint on an object store is read from a copy
        on this node (removed after)."""
        with checkpoints.local_copy(directory) as copy:
            try:
                self._load(copy, runtime, seed, distributed=distributed, load_optimizer=load_optimizer)
            except CheckpointError as error:  # named as stored, not as copied
                raise CheckpointError(str(error).replace(copy.name, directory.name)) from None

    def _load(
        self, directory: Path, runtime: "Runtime", seed: int, *, distributed: bool, load_optimizer: Callable
    ) -> None:
        train_state = checkpoints.load_train_state(directory)
        if checkpoints.is_legacy(directory):
            self._load_legacy(directory, train_state, load_optimizer)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

            state = self._dcp_state()
            options = runtime.dcp_options(load=True) if distributed else {"no_dist": True}
            try:
                with contextlib.nullcontext() if distributed else single_process():
                    dcp.load(state, checkpoint_id=str(directory), **options)
            except formats.dcp_errors() as exc:
                reason = formats.dcp_failure(exc)
                raise CheckpointError(f"checkpoint {directory.name} cannot be read ({reason})") from None
            target = self.holding.dcp_target(self.model)
            set_model_state_dict(target, state["model"])
            load_optimizer(lambda: set_optimizer_state_dict(target, self.optimizer, state["optim"]))
        load_scaler(self.scaler, train_state["scaler"])
        restore_rank_rng(seed, runtime.world_rank, runtime.world_size, train_state)

    def _dcp_state(self) -> dict[str, Any]:
        """The model and optimizer by parameter name (DTensor shards under fsdp)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.holding.dcp_target(self.model), self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def _dcp_part(self, rank: int, world_size: int) -> dict[str, Any]:
        """What this rank writes of a checkpoint. Under fsdp its shards. Unsharded, every rank
        holds all of the state: each writes (and first copies to host memory) only its part,
        balanced by bytes over the ranks; together they are the whole. Rank 0's part holds
        the whole model, so rank 0 reads the plain model.pt back from its own file: on an
        object store the other ranks' files stay on their nodes."""
        state = self._dcp_state()
        if not self.holding.holds_whole_model or world_size == 1:
            return state
        model, optim = state["model"], state["optim"]
        mine = set(_balanced_owners(model, optim.get("state", {}), world_size)[rank])
        part_optim = {"state": {k: v for k, v in optim.get("state", {}).items() if k in mine}}
        if rank == 0:  # the groups' settings (rates, decay), small: once
            part_optim["param_groups"] = optim.get("param_groups", [])
        return {"model": model if rank == 0 else {}, "optim": part_optim}

    def _load_legacy(self, directory: Path, saved: dict[str, Any], load_optimizer: Callable) -> None:
        """An earlier version's single state file: a plain model and an optimizer state keyed
        by parameter index, which only an unsharded model takes."""
        self.holding.check_legacy(directory.name)
        unwrap(self.model).load_state_dict(saved["model"], strict=True)
        load_optimizer(lambda: self.optimizer.load_state_dict(saved["optimizer"]))

    # -- a live peer (per-step) ---------------------------------------------------------------

    def live(self) -> dict[str, Any]:
        """What a joining replica copies from this one (per-step mode; sharded within a replica
        group, this rank's shards, as plain tensors: `raytrain.parallel.holding.local_state`)."""
        held = self.holding.live_state(self.model, self.optimizer)
        return {
            "model": held["model"],
            "optimizer": held["optim"],
            "scaler": self.scaler.state_dict(),
            "position": dataclasses.asdict(self.position),
            "telemetry": dataclasses.asdict(self.telemetry),
        }

    def load_live(self, live: dict[str, Any]) -> None:
        """Take a live peer's state (per-step mode), the position included."""
        self.holding.load_live_state(self.model, self.optimizer, {"model": live["model"], "optim": live["optimizer"]})
        load_scaler(self.scaler, live["scaler"])
        take(self.position, Position.restored(live))
        take(self.telemetry, Telemetry.restored(live))


def take(part: Any, restored: Any) -> None:
    """`restored`'s fields into `part` (a position, a telemetry), the object the attempt holds."""
    for name in (f.name for f in dataclasses.fields(part)):
        setattr(part, name, getattr(restored, name))


@dataclass
class Save:
    """A checkpoint being written: DCP's future (distributed saves) or a writer thread, and
    what failed. `wait` returns once every file of this rank is written, or raises."""

    directory: Path
    future: Any = None
    thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)

    def done(self) -> bool:
        if self.future is not None and not self.future.done():
            return False
        return self.thread is None or not self.thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        """Every file of this rank written; a write that failed raises its own error (an
        OSError with its errno for the file system's), not DCP's wrapper around every rank's.
        With `timeout_s`, TimeoutError past it."""
        try:
            if self.future is not None:
                self.future.result(timeout=timeout_s)
            if self.thread is not None:
                self.thread.join(timeout_s)
                if self.thread.is_alive():
                    raise TimeoutError(f"checkpoint {self.directory.name} still being written after {timeout_s} s")
            if self.errors:
                raise self.errors[0]
        except formats.dcp_errors() as exc:
            inner = _inner(exc)
            if isinstance(inner, Exception):
                raise inner from None
            raise RuntimeError(formats.dcp_failure(exc)) from None


def _inner(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException (else `exc`)."""
    failures = getattr(exc, "failures", None)
    return failures[min(failures)][0] if failures else exc


def load_scaler(scaler: torch.amp.GradScaler, saved: dict[str, Any]) -> None:
    """The saved scale, when there is one: a bf16 or fp32 run's scaler was disabled and saved
    nothing, so an fp16 resume of it starts from a fresh scale (`rules.resume` allows the
    switch); a disabled scaler ignores what it is given."""
    if saved or not scaler.is_enabled():
        scaler.load_state_dict(saved)


# -- random number generators -------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def restore_rank_rng(seed: int, rank: int, world_size: int, saved: dict[str, Any] | None) -> None:
    """Per-rank RNG for dropout and augmentation: restored when the world size is unchanged,
    else derived from (seed, rank, step) so ranks never share a stream."""
    stored = (saved or {}).get("rng") or []
    if len(stored) == world_size:
        set_rng_state(stored[rank])
        return
    step = (saved or {}).get("position", {}).get("step", 0)
    seed_everything(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types that weights_only loading accepts."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    keys = numpy_state["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy_state["pos"], numpy_state["has_gauss"], numpy_state["gauss"]))
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _snapshot(value: Any) -> Any:
    """A copy of a state dict on the CPU, for a writer thread while training goes on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


def _balanced_owners(model: dict[str, Any], optim: dict[str, Any], world_size: int) -> list[list[str]]:
    """Which parameters' optimizer state each of `world_size` ranks writes: largest first to
    the least loaded, rank 0 starting with the whole model's bytes (it writes the model). The
    same on every rank (it depends on names and sizes)."""

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    def size(key: str) -> int:
        return nbytes(optim.get(key, {}).values())

    owners: list[list[str]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    loads[0] = nbytes(model.values())
    for key in sorted(model, key=lambda k: (-size(k), k)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[rank].append(key)
        loads[rank] += size(key)
    return owners


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value
