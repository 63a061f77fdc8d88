"""The training state: the one owner of what a checkpoint, a healed replica and an export hold.

`TrainingState` is a worker's model, optimizer, gradient scaler and position. It alone says
what each of these holds:

- a checkpoint (`checkpoint` / `restore`): the unwrapped model's weights, the optimizer,
  the scaler, every rank's RNG state, the position, and what the run's rules were then
  (schedule, batch plan, rate);
- a replica that heals from a live peer in per-step mode (`live` / `load_live`): the same
  but the RNG states, which stay each replica's own;
- an export and the final `model.pt` (`weights`): the plain model, without `module.` or
  `_orig_mod.` prefixes, on the CPU.

`restore_latest` finds the state to continue from: the furthest checkpoint of the run that
loads (Ray's record of it can be behind the run directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from raytrain.errors import CheckpointError
from raytrain.rules.position import Position
from raytrain.rundir import checkpoints
from raytrain.rundir.records import Kind

if TYPE_CHECKING:  # pragma: no cover
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker.runtime import Runtime


@dataclass
class TrainingState:
    """A worker's model (as trained: wrapped by DDP or torchft), optimizer, scaler and position."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    position: Position

    def weights(self) -> dict[str, torch.Tensor]:
        """The model as a plain state_dict on the CPU: what model.pt and an export hold."""
        return {key: value.detach().cpu().clone() for key, value in unwrap(self.model).state_dict().items()}

    def checkpoint(self, runtime: "Runtime", rules: dict[str, Any]) -> dict[str, Any]:
        """Everything needed to continue (a collective: every rank's RNG state is gathered).
        `rules`: the schedule, batch plan and rate the run had here, for the resume line."""
        return {
            "model": self.weights(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": runtime.all_gather_object(rng_state()),
            "position": dataclasses.asdict(self.position),
            **rules,
        }

    def restore(
        self, saved: dict[str, Any], runtime: "Runtime", seed: int, load: Callable[[Callable[[], None]], None]
    ) -> None:
        """Continue from a checkpoint's `saved` state: weights, optimizer, scaler, and this rank's
        RNG (restored when the world size is unchanged, else derived from (seed, rank, step)).
        `load(fn)` runs the optimizer's part, which the pipeline's build_optimizer decides."""
        unwrap(self.model).load_state_dict(saved["model"], strict=True)
        load(lambda: self.optimizer.load_state_dict(saved["optimizer"]))
        self.scaler.load_state_dict(saved["scaler"])
        restore_rank_rng(seed, runtime.world_rank, runtime.world_size, saved)

    def live(self) -> dict[str, Any]:
        """What a joining replica copies from this one (per-step mode)."""
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "position": dataclasses.asdict(self.position),
        }

    def load_live(self, live: dict[str, Any]) -> None:
        """Take a live peer's state (per-step mode), the position included."""
        unwrap(self.model).load_state_dict(live["model"])
        self.optimizer.load_state_dict(live["optimizer"])
        self.scaler.load_state_dict(live["scaler"])
        for name, value in live["position"].items():
            setattr(self.position, name, value)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP (and torch.compile), so saved keys have no `module.` prefix."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def restore_latest(runtime: "Runtime", files: "RunWriter") -> dict[str, Any] | None:
    """The state to continue from: the furthest checkpoint of this run that loads.

    Ray registers a checkpoint only once its controller has processed the report, so the
    last one or two written before a crash can be missing from `get_checkpoint()` while
    complete on storage; and after a driver loss Ray's own record may be older than the
    run directory. Candidates are Ray's latest and every checkpoint directory of the run;
    the one furthest in training that loads wins, so a failure loses at most
    --checkpoint-every-steps steps. A corrupt or partial directory is skipped, and said.
    (A fresh run has neither: reusing a run name needs --resume.)
    """
    latest = runtime.latest_checkpoint()
    with latest.as_directory() if latest is not None else contextlib.nullcontext(None) as directory:
        found = ([Path(directory)] if directory else []) + checkpoints.checkpoint_dirs(files.run_dir)
        candidates = list(dict.fromkeys(found))  # Ray's latest is one of the run's own, as a rule
        if not candidates:
            return None
        skipped, names = [], []
        for candidate in sorted(candidates, key=checkpoints.stored_step, reverse=True):
            try:
                state = checkpoints.load_state(candidate)
            except CheckpointError as error:
                skipped.append(str(error))
                names.append(candidate.name)
                continue
            if skipped:
                files.event(Kind.SKIPPED, f"skipped unusable checkpoint(s): {'; '.join(skipped)}", checkpoints=names)
            return state
    raise CheckpointError(f"no usable checkpoint in {files.run_dir}: {'; '.join(skipped)}")


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


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value
