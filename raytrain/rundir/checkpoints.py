"""Checkpoint directories of a run: their names, their files, and how they are read back safely.

A checkpoint directory (`checkpoint_s<step>_<time>/`, one logical format under every strategy):

- the model and optimizer as `torch.distributed.checkpoint` (DCP) files, `.metadata` and one
  `__<rank>_0.distcp` per writing rank: every rank writes its own shard in parallel, and DCP
  reshards them on load, so a checkpoint resumes at any worker count and under --strategy
  ddp or fsdp. Keys are the plain model's (`blocks.0.qkv.weight`), optimizer state keyed by
  the same names;
- `train_state.pt`: the rest (the gradient scaler, every rank's RNG state, the schedule, the
  batch plan and the position);
- `model.pt`: the unwrapped model as a plain state_dict, when a rank holds all of it (not
  under --strategy fsdp: `raytrain export` reads the DCP files instead);
- `position.json`: the position, readable without loading tensors.

Torch files load with `torch.load(..., weights_only=True)`, and DCP files are read into
tensors alone: only tensors and plain containers, never pickled code, so a checkpoint from
elsewhere cannot run anything. A directory is written under `.staging/` and renamed into place
once every file is complete, so a listed checkpoint is whole. `state.pt` (everything in one
file) is the format of earlier versions, still read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from raytrain.errors import CheckpointError
from raytrain.observe.render import first_line
from raytrain.rundir.records import MODEL

TRAIN_STATE_FILE = "train_state.pt"
DCP_METADATA = ".metadata"  # written last by DCP: its shards are complete
LEGACY_STATE_FILE = "state.pt"
MODEL_FILE = MODEL  # also the final model in the run directory
POSITION_FILE = "position.json"
STAGING = ".staging"


def save_torch(payload: Any, path: str | os.PathLike) -> None:
    """torch.save to a temporary name, flushed, then renamed: a crash mid-write leaves no file
    that looks complete. A write the file system refuses is an OSError with its errno (torch
    itself reports a full disk as a RuntimeError about stream positions)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
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
    os.replace(tmp, path)


def write_train_state(directory: str | os.PathLike, train_state: dict[str, Any]) -> None:
    """The small part of a checkpoint, and its position as JSON (written by one rank)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_torch(train_state, directory / TRAIN_STATE_FILE)
    (directory / POSITION_FILE).write_text(json.dumps(train_state.get("position", {})))


def is_complete(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a whole checkpoint: its position, and its train state with
    DCP's metadata (or an earlier version's single state file)."""
    directory = Path(directory)
    files = (POSITION_FILE, TRAIN_STATE_FILE, DCP_METADATA)
    return all((directory / name).is_file() for name in files) or (directory / LEGACY_STATE_FILE).is_file()


def is_legacy(directory: str | os.PathLike) -> bool:
    """A checkpoint of an earlier version: everything in one `state.pt`."""
    return not (Path(directory) / DCP_METADATA).is_file() and (Path(directory) / LEGACY_STATE_FILE).is_file()


def stored_step(directory: str | os.PathLike) -> int:
    """The optimizer step a checkpoint directory was taken at (-1 if unknown)."""
    try:
        return int(json.loads((Path(directory) / POSITION_FILE).read_text()).get("step", -1))
    except (OSError, ValueError, AttributeError):
        return -1


def load_train_state(directory: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's train state (an earlier version's whole state); CheckpointError naming the
    file when it is missing, truncated or not a raytrain checkpoint."""
    directory = Path(directory)
    path = directory / (LEGACY_STATE_FILE if is_legacy(directory) else TRAIN_STATE_FILE)
    if not path.is_file() or not is_complete(directory):
        raise CheckpointError(f"checkpoint {directory} is incomplete or not a raytrain checkpoint (no {path.name})")
    return _load_torch(path, "checkpoint file")


def load_state(directory: str | os.PathLike) -> dict[str, Any]:
    """Everything a checkpoint holds as plain containers, in one process (no process group):
    `model` and `optimizer` (keyed by parameter name) with the train state. For reading and
    tests; training loads its own shards (`raytrain.worker.state`)."""
    directory = Path(directory)
    state = load_train_state(directory)
    if is_legacy(directory):
        return state
    loaded = _read_dcp(directory)
    return {**state, "model": loaded.get("model", {}), "optimizer": loaded.get("optim", {})}


def checkpoint_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first (by their step, then name).

    raytrain writes a checkpoint under RUN_DIR/.staging/ and renames it into place when it is
    complete, so a directory here is whole; older runs (Ray's own copy) may hold partial
    ones, which loading rejects."""
    found = [p for p in Path(run_dir).glob("checkpoint_*") if is_complete(p)]
    return sorted(found, key=lambda p: (stored_step(p), p.name))


def latest_complete(run_dir: str | os.PathLike) -> Path | None:
    """The furthest checkpoint of a run (by its stored step), or None."""
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def checkpoint_name(step: int) -> str:
    """`checkpoint_s000000412_20261201-101530-123456`: step-major, unique per write."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"checkpoint_s{step:09d}_{stamp}-{int(now * 1e6) % 1_000_000:06d}"


def staging_dir(run_dir: str | os.PathLike) -> Path:
    """Where checkpoints are written before they are renamed into place."""
    return Path(run_dir) / STAGING


def model_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The model's parameter and buffer names and shapes in a checkpoint, read from DCP's
    metadata (no tensor is loaded) or from its model file."""
    directory = Path(directory)
    if not is_legacy(directory) and (directory / DCP_METADATA).is_file():
        metadata = _dcp_metadata(directory)
        prefix = "model."
        return {
            key[len(prefix) :]: tuple(meta.size)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(meta, "size")
        }
    return {key: tuple(value.shape) for key, value in load_model_weights(directory).items()}


def load_model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Model weights as a plain state_dict, from a run directory (model.pt, else its latest
    checkpoint), a checkpoint directory (its model.pt, else its DCP shards, gathered in this
    process without a process group) or a .pt file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; give a run directory, a checkpoint directory or a model .pt file"
        )
    if path.is_dir():
        checkpoint = path if is_complete(path) else None
        if checkpoint is None and not (path / MODEL_FILE).is_file():  # a run without its final model yet
            checkpoint = latest_complete(path)
            if checkpoint is None:
                raise CheckpointError(
                    f"{path} holds no model.pt and no complete checkpoint; has the run saved one yet?"
                )
        if checkpoint is None:
            path = path / MODEL_FILE
        elif (checkpoint / MODEL_FILE).is_file():
            path = checkpoint / MODEL_FILE
        elif is_legacy(checkpoint):
            path = checkpoint / LEGACY_STATE_FILE
        else:  # sharded: its shards, gathered here
            return _read_dcp(checkpoint, only="model")["model"]
    weights = _load_torch(path, "model file")
    if isinstance(weights, dict) and "model" in weights and isinstance(weights["model"], dict):
        weights = weights["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{path} does not hold a model state_dict")
    return weights


# -- reading -----------------------------------------------------------------------------------


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP in one process (no process group): its warning that it assumes so is expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _load_torch(path: Path, what: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        if what == "checkpoint file":
            raise CheckpointError(
                f"checkpoint file {path} cannot be read ({first_line(exc)}); it is corrupt or partial"
            ) from None
        raise CheckpointError(f"{path} cannot be read as a torch file ({first_line(exc)})") from None


def dcp_failure(exc: BaseException) -> str:
    """What went wrong in a DCP save or load: the first rank's own error (DCP wraps them all in
    one CheckpointException, a BaseException, whose text is every rank's traceback)."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner, _ = failures[min(failures)]
        return f"rank {min(failures)}: {type(inner).__name__}: {first_line(inner)}"[:300]
    return first_line(exc)[:300]


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What DCP raises on a failed save or load."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _reason(exc: BaseException) -> str:
    return dcp_failure(exc)


def _dcp_metadata(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"checkpoint {directory}: its {DCP_METADATA} cannot be read ({_reason(exc)})") from None


def _read_dcp(directory: Path, only: str | None = None) -> dict[str, Any]:
    """The DCP files' tensors (all, or those under `only`) as nested plain dicts, read in this
    process without a process group; DTensor shards come back whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _dcp_metadata(directory)
    flat: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and (only is None or key.startswith(only + ".")):
            flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with single_process():
            dcp.load(flat, checkpoint_id=str(directory), no_dist=True)
    except dcp_errors() as exc:
        raise CheckpointError(f"checkpoint {directory}: its shards cannot be read ({_reason(exc)})") from None
    return _unflatten(flat, metadata.planner_data)


def _unflatten(flat: dict[str, torch.Tensor], mapping: Any) -> dict[str, Any]:
    """DCP's flat keys back into nested dicts, by the key paths DCP recorded (`planner_data`)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = mapping.get(key) if isinstance(mapping, dict) else None
        parts = [str(p) for p in path] if path else key.split(".", 1)
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested
