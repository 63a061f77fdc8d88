"""Checkpoint directories of a run: their names, how they are written and read back safely.

A checkpoint directory holds `state.pt` (what the training state saves: model, optimizer,
scheduler, scaler, RNG states, position; `raytrain.worker.state`), `model.pt` (the unwrapped
model alone) and `position.json` (the position, readable without loading tensors). Both
torch files load with `torch.load(..., weights_only=True)`: only tensors and plain
containers, never pickled code, so a checkpoint from elsewhere cannot run anything.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from raytrain.errors import CheckpointError
from raytrain.observe.render import first_line
from raytrain.rundir.records import MODEL

STATE_FILE = "state.pt"
MODEL_FILE = MODEL  # also the final model in the run directory
POSITION_FILE = "position.json"
STAGING = ".staging"
ZIP_MAGIC = b"PK\x03\x04"  # how every file torch.save writes begins (its zip archive)


def save_state(state: dict[str, Any], directory: str | os.PathLike) -> None:
    """Write a checkpoint directory (OSError, with its errno, if the file system refuses)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Written to temporary names and renamed last, so a crash mid-write leaves no file
    # that looks complete (raytrain also writes the directory under a staging name).
    for name, payload in ((MODEL_FILE, state["model"]), (STATE_FILE, state)):
        tmp = directory / (name + ".tmp")
        save_torch(payload, tmp)
        os.replace(tmp, directory / name)
    # Small and readable: lets resume rank checkpoints without loading their tensors.
    (directory / POSITION_FILE).write_text(json.dumps(state.get("position", {})))


def save_torch(payload: Any, path: str | os.PathLike) -> None:
    """torch.save, flushed to disk; a write the file system refuses is an OSError with its
    errno (torch itself reports a full disk as a RuntimeError about stream positions)."""
    path = Path(path)
    try:
        with open(path, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        raise
    except RuntimeError as exc:
        stats = os.statvfs(path.parent)
        if stats.f_bavail * stats.f_frsize < (1 << 20):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
        raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} ({str(exc).splitlines()[0][:120]})", str(path)) from exc


def stored_step(directory: str | os.PathLike) -> int:
    """The optimizer step a checkpoint directory was taken at (-1 if unknown)."""
    try:
        return int(json.loads((Path(directory) / POSITION_FILE).read_text()).get("step", -1))
    except (OSError, ValueError, AttributeError):
        return -1


def load_state(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory} has no {STATE_FILE}; it is incomplete or not a raytrain checkpoint"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint file {path} cannot be read: {unreadable(exc, path, checkpoint=True)}"
        ) from None


def readable(directory: str | os.PathLike) -> str | None:
    """Why the checkpoint in `directory` cannot be restored (its state or model file is missing
    or cannot be opened), or None. Cheap: the files are opened memory-mapped, their tensors
    not read."""
    for name in (STATE_FILE, MODEL_FILE):
        path = Path(directory) / name
        if not path.is_file():
            return f"checkpoint {directory} has no {name}; it is incomplete or not a raytrain checkpoint"
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            return f"checkpoint file {path} cannot be read: {unreadable(exc, path, checkpoint=True)}"
    return None


def unreadable(exc: BaseException, path: str | os.PathLike, *, checkpoint: bool = False) -> str:
    """What a file that the safe loader (`torch.load(weights_only=True)`) refused is, from its
    error and its first bytes, in place of torch's own advice (which suggests
    weights_only=False: running whatever code the file names). `checkpoint`: a raytrain
    checkpoint file, which never holds objects."""
    text = str(exc)
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:
        head = b""
    if not head:
        return "it is empty"
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found and checkpoint:
        return (
            f"it holds a pickled Python object ({found[1]}), not only tensors, so it is not loaded (raytrain loads "
            "with weights_only=True and never runs code from a file); raytrain writes tensors and plain values "
            "only, so this file was written by something else or changed since"
        )
    if found:
        return (
            f"it holds a pickled Python object ({found[1]}), not only tensors (e.g. a whole model saved with "
            "torch.save(model) instead of torch.save(model.state_dict())), so it is not loaded: raytrain loads with "
            "weights_only=True and never runs code from a file. If you trust where the file came from, convert it "
            "once in Python: obj = torch.load(PATH, weights_only=False); torch.save(obj.state_dict() if "
            "isinstance(obj, torch.nn.Module) else obj, 'plain.pt'), then give plain.pt"
        )
    if "central directory" in text or "PytorchStreamReader" in text:
        return "it is truncated or damaged (its archive is incomplete): it was not written completely, or changed since"
    if head != ZIP_MAGIC:
        return "it is not a file torch.save wrote (torch.save writes a zip archive; this file does not start as one)"
    return f"it is not a file torch.save wrote ({type(exc).__name__}: {first_line(str(exc)) or 'no message'})"


def checkpoint_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint directories of a run that hold a state file, oldest first.

    raytrain writes a checkpoint under RUN_DIR/.staging/ and renames it into place when it is
    complete, so a directory here is whole; older runs (Ray's own copy) may hold partial
    ones, which `load_state` rejects."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.glob("checkpoint_*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: (stored_step(p), p.name))


def latest_complete(run_dir: str | os.PathLike) -> Path | None:
    """The furthest checkpoint of a run (by its stored step), or None."""
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def latest_readable(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The furthest checkpoint of a run whose files open (`readable`), and why each further
    one was passed over: what a resume continues from, as the workers choose it."""
    passed = []
    for directory in reversed(checkpoint_dirs(run_dir)):
        problem = readable(directory)
        if problem is None:
            return directory, passed
        passed.append(problem)
    return None, passed


def checkpoint_name(step: int) -> str:
    """`checkpoint_s000000412_20261201-101530-123456`: step-major, unique per write."""
    now = time.time()
    return (
        f"checkpoint_s{step:09d}_{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{int(now * 1e6) % 1_000_000:06d}"
    )


def staging_dir(run_dir: str | os.PathLike) -> Path:
    """Where checkpoints are written before they are renamed into place."""
    return Path(run_dir) / STAGING


def load_model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Model weights from a run directory (model.pt, else the latest checkpoint), a checkpoint or a .pt file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; give a run directory, a checkpoint directory or a model .pt file"
        )
    if path.is_dir():
        candidates = [path / MODEL_FILE]
        candidates += [p / MODEL_FILE for p in reversed(checkpoint_dirs(path))]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise CheckpointError(f"{path} holds no model.pt and no complete checkpoint; has the run saved one yet?")
        path = found
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read as a torch file: {unreadable(exc, path)}") from None
    if isinstance(weights, dict) and "model" in weights and isinstance(weights["model"], dict):
        weights = weights["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{path} does not hold a model state_dict")
    return weights
