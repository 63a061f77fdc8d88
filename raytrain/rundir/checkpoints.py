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
elsewhere cannot run anything. `state.pt` (everything in one file) is the format of earlier
versions, still read.

Complete or invisible, on every storage. On a file system a directory is written under
`.staging/` and renamed into place once every file is complete, so a listed checkpoint is
whole. An object store has no rename: the files are staged on the writing node, uploaded
(`raytrain.rundir.publish`), and a marker, `.complete.json`, is written last, once every
rank's files are there; listing and resuming look for the marker only, so a checkpoint whose
upload failed half-way is never seen, and the previous one is untouched.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Union

import torch

from raytrain.errors import CheckpointError
from raytrain.rundir.formats import (
    DCP_METADATA,
    dcp_metadata,
    load_torch,
    read_dcp,
    save_torch,
    unreadable,
)
from raytrain.rundir.records import MODEL
from raytrain.rundir.storage import Store, is_uri

Where = Union[str, os.PathLike, Store]  # a checkpoint or run directory: a local path, a URI or a Store

TRAIN_STATE_FILE = "train_state.pt"
LEGACY_STATE_FILE = "state.pt"
MODEL_FILE = MODEL  # also the final model in the run directory
POSITION_FILE = "position.json"
STAGING = ".staging"
COMPLETE = ".complete.json"  # an object store's checkpoint is complete once this is there (written last)
# The files a checkpoint directory becomes complete with: written after every rank's shards.
FINAL_FILES = (DCP_METADATA, MODEL_FILE, TRAIN_STATE_FILE, POSITION_FILE)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of the checkpoints reported to it
_STEP_IN_NAME = re.compile(r"^checkpoint_s(\d+)_")


def remote(where: Where) -> Store | None:
    """The Store of a checkpoint or run directory on an object store; None for a local one."""
    if isinstance(where, Store):
        return None if where.local_path() is not None else where
    return Store.of(where) if is_uri(where) else None


def write_train_state(directory: str | os.PathLike, train_state: dict[str, Any]) -> None:
    """The small part of a checkpoint, and its position as JSON (written by one rank)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_torch(train_state, directory / TRAIN_STATE_FILE)
    (directory / POSITION_FILE).write_text(json.dumps(train_state.get("position", {})))


def is_complete(directory: Where) -> bool:
    """Whether `directory` holds a whole checkpoint: its position, and its train state with
    DCP's metadata (or an earlier version's single state file); on an object store, its marker."""
    store = remote(directory)
    if store is not None:
        return store.exists(COMPLETE)
    directory = Path(directory)
    files = (POSITION_FILE, TRAIN_STATE_FILE, DCP_METADATA)
    return all((directory / name).is_file() for name in files) or (directory / LEGACY_STATE_FILE).is_file()


def is_legacy(directory: Where) -> bool:
    """A checkpoint of an earlier version: everything in one `state.pt`."""
    if remote(directory) is not None:
        return False  # object stores came after the single file
    return not (Path(directory) / DCP_METADATA).is_file() and (Path(directory) / LEGACY_STATE_FILE).is_file()


def stored_step(directory: Where) -> int:
    """The optimizer step a checkpoint directory was taken at (-1 if unknown): from its name,
    else its position.json."""
    named = _STEP_IN_NAME.match(Store.of(directory).name)
    if named:
        return int(named[1])
    try:
        return int(json.loads(_read(directory, POSITION_FILE)).get("step", -1))
    except (OSError, ValueError, AttributeError):
        return -1


def stored_position(directory: Where) -> dict[str, Any]:
    """A checkpoint's position.json ({} when it cannot be read)."""
    try:
        value = json.loads(_read(directory, POSITION_FILE))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_train_state(directory: Where) -> dict[str, Any]:
    """A checkpoint's train state (an earlier version's whole state); CheckpointError naming the
    file when it is missing, truncated or not a raytrain checkpoint."""
    store = remote(directory)
    if store is not None:
        if not is_complete(store):
            raise CheckpointError(f"checkpoint {store} is incomplete or not a raytrain checkpoint (no {COMPLETE})")
        try:
            data = store.read_bytes(TRAIN_STATE_FILE)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {store} has no {TRAIN_STATE_FILE}; it is partial") from None
        return load_torch(io.BytesIO(data), "checkpoint file", f"{store}/{TRAIN_STATE_FILE}")
    directory = Path(directory)
    path = directory / (LEGACY_STATE_FILE if is_legacy(directory) else TRAIN_STATE_FILE)
    if not path.is_file() or not is_complete(directory):
        raise CheckpointError(f"checkpoint {directory} is incomplete or not a raytrain checkpoint (no {path.name})")
    return load_torch(path, "checkpoint file")


def load_state(directory: Where) -> dict[str, Any]:
    """Everything a checkpoint holds as plain containers, in one process (no process group):
    `model` and `optimizer` (keyed by parameter name) with the train state. For reading and
    tests; training loads its own shards (`raytrain.worker.state`)."""
    if remote(directory) is not None:
        with local_copy(directory) as copy:
            return load_state(copy)
    directory = Path(directory)
    state = load_train_state(directory)
    if is_legacy(directory):
        return state
    loaded = read_dcp(directory)
    return {**state, "model": loaded.get("model", {}), "optimizer": loaded.get("optim", {})}


def checkpoint_dirs(run_dir: Where) -> list:
    """Complete checkpoint directories of a run, oldest first (by their step, then name): Paths
    on a file system, Stores on an object store.

    raytrain writes a checkpoint under RUN_DIR/.staging/ and renames it into place when it is
    complete, so a directory here is whole; older runs (Ray's own copy) may hold partial
    ones, which loading rejects. On an object store, those with their marker (one listing)."""
    store = remote(run_dir)
    if store is not None:
        names = store.list(recursive=True)
        found = [store / name.split("/")[0] for name in names if _is_marker(name)]
        return sorted(found, key=lambda p: (stored_step(p), p.name))
    found = [p for p in Path(run_dir).glob("checkpoint_*") if is_complete(p)]
    return sorted(found, key=lambda p: (stored_step(p), p.name))


def _is_marker(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and parts[0].startswith("checkpoint_") and parts[1] == COMPLETE


def remove(directory: Where) -> None:
    """Delete a checkpoint directory; on an object store its marker goes first, so a reader
    never takes a checkpoint that is being deleted for a complete one."""
    store = remote(directory)
    if store is None:
        shutil.rmtree(directory, ignore_errors=True)
        return
    store.delete(COMPLETE)
    store.delete_tree()


@contextlib.contextmanager
def local_copy(directory: Where) -> Iterator[Path]:
    """A checkpoint directory as a local path: itself, or a temporary copy of an object
    store's (deleted after)."""
    store = remote(directory)
    if store is None:
        yield Path(directory)
        return
    copy = Path(tempfile.mkdtemp(prefix="raytrain-restore-"))
    try:
        store.download("", copy)
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def latest_complete(run_dir: Where):
    """The furthest checkpoint of a run (by its stored step), or None."""
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


class ResumeChoice:
    """Where a run continues from (`resume_choice`): its usable checkpoints, furthest first, each
    with its train state, and why each further one was passed over. The driver says the first;
    the workers load them in order, and pass over one that fails to load on a rank (`pass_over`)."""

    def __init__(self) -> None:
        self.usable: list[tuple[Any, dict[str, Any]]] = []
        self.passed_over: list[str] = []  # why, one line per checkpoint
        self.names: list[str] = []  # the checkpoints passed over

    @property
    def latest(self):
        return self.usable[0][0] if self.usable else None

    def pass_over(self, directory: Where, problem: str) -> None:
        self.passed_over.append(problem)
        self.names.append(Store.of(directory).name)

    def skipped_line(self) -> str | None:
        """The event line that says what was passed over (None: nothing was)."""
        return f"skipped unusable checkpoint(s): {'; '.join(self.passed_over)}" if self.passed_over else None


def resume_choice(run_dir: Where, also: Where | None = None, first_only: bool = False) -> ResumeChoice:
    """THE rule of where a run continues from, for the driver (`first_only`: it names one) and
    the workers alike: the run's complete checkpoints (and `also`, Ray's latest, when complete
    and not among them), furthest first, that open: their train state loads, and DCP's
    metadata (or an earlier version's model file) opens. None usable: a fresh start when there
    were none; when every one was passed over, the caller refuses (`rules.resume`)."""
    found = checkpoint_dirs(run_dir)
    if also is not None and Path(also) not in found and is_complete(also):
        found.append(Path(also))
    return choose(found, first_only)


def choose(found: list, first_only: bool = False) -> ResumeChoice:
    """`resume_choice` over the checkpoints `found` complete by a listing. One gone since the
    listing was pruned by a live writer (a per-step run's quorum saves and prunes while a
    replacement restores): a newer one exists, so it is left out, not passed over as unusable."""
    choice = ResumeChoice()
    for directory in sorted(found, key=stored_step, reverse=True):
        try:
            choice.usable.append((directory, _openable(directory)))
        except CheckpointError as error:
            if not gone(directory):
                choice.pass_over(directory, str(error))
            continue
        if first_only:
            break
    return choice


def gone(directory: Where) -> bool:
    """Whether a checkpoint listed complete has since been removed (pruned): on a file system
    its directory, on an object store its marker (removed first)."""
    store = remote(directory)
    if store is not None:
        return not store.exists(COMPLETE)
    return not Path(directory).exists()


def _openable(directory: Where) -> dict[str, Any]:
    """The train state of the checkpoint in `directory` once its other files open (no tensor of
    the model is read); CheckpointError naming the file that does not."""
    state = load_train_state(directory)
    store = remote(directory)
    if store is not None:
        if not store.exists(DCP_METADATA):
            raise CheckpointError(f"checkpoint {store}: its {DCP_METADATA} is missing")
        return state
    directory = Path(directory)
    if not is_legacy(directory):
        dcp_metadata(directory)
    elif (directory / MODEL_FILE).is_file():
        path = directory / MODEL_FILE
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            why = unreadable(exc, path, checkpoint=True)
            raise CheckpointError(f"checkpoint file {path} cannot be read: {why}") from None
    return state


def latest_readable(run_dir: Where) -> tuple[Any, list[str]]:
    """The checkpoint a resume continues from (`resume_choice`), and why each further one was
    passed over."""
    choice = resume_choice(run_dir, first_only=True)
    return choice.latest, choice.passed_over


def forget_missing(run_dir: Where) -> list[str]:
    """Ray Train's own record of a run's checkpoints (RAY_SNAPSHOT), when it names one the run
    no longer holds whole, is removed: Ray refuses to start on such a record
    (CheckpointManagerInitializationError), and where a run continues from is the run
    directory's to say (`resume_choice`). Returns the names it listed that are gone."""
    store = Store.of(run_dir)
    try:
        record = json.loads(store.read_text(RAY_SNAPSHOT))
    except FileNotFoundError:
        return []
    except ValueError:  # unreadable: Ray would refuse it too
        store.delete(RAY_SNAPSHOT)
        return [RAY_SNAPSHOT]
    held = {Store.of(directory).name for directory in checkpoint_dirs(store)}
    gone = sorted(set(_named_checkpoints(record)) - held)
    if gone:
        store.delete(RAY_SNAPSHOT)
    return gone


def _named_checkpoints(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "checkpoint_dir_name" and isinstance(item, str):
                yield item
            elif key.endswith("checkpoint_dir_names") and isinstance(item, list):
                yield from (name for name in item if isinstance(name, str))
            else:
                yield from _named_checkpoints(item)
    elif isinstance(value, list):
        for item in value:
            yield from _named_checkpoints(item)


def checkpoint_name(step: int) -> str:
    """`checkpoint_s000000412_20261201-101530-123456`: step-major, unique per write."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"checkpoint_s{step:09d}_{stamp}-{int(now * 1e6) % 1_000_000:06d}"


def staging_dir(run_dir: Where) -> Path:
    """Where checkpoints are written before they are renamed into place, or uploaded (on an
    object store: this node's own directory)."""
    return Store.of(run_dir).local_dir / STAGING


def model_shapes(directory: Where) -> dict[str, tuple[int, ...]]:
    """The model's parameter and buffer names and shapes in a checkpoint, read from DCP's
    metadata (no tensor is loaded) or from its model file."""
    store = remote(directory)
    if store is not None:  # the metadata alone
        with tempfile.TemporaryDirectory(prefix="raytrain-metadata-") as copy:
            try:
                Path(copy, DCP_METADATA).write_bytes(store.read_bytes(DCP_METADATA))
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {store} has no {DCP_METADATA}; it is partial") from None
            return model_shapes(copy)
    directory = Path(directory)
    if not is_legacy(directory) and (directory / DCP_METADATA).is_file():
        metadata = dcp_metadata(directory)
        prefix = "model."
        return {
            key[len(prefix) :]: tuple(meta.size)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(meta, "size")
        }
    return {key: tuple(value.shape) for key, value in load_model_weights(directory).items()}


def load_model_weights(path: Where) -> dict[str, torch.Tensor]:
    """Model weights as a plain state_dict, from a run directory (model.pt, else its latest
    checkpoint), a checkpoint directory (its model.pt, else its DCP shards, gathered in this
    process without a process group) or a .pt file; each a local path or a URI."""
    store = remote(path)
    if store is not None:
        return _remote_model_weights(store)
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
            return read_model(checkpoint)
    return _checked_weights(load_torch(path, "model file"), str(path))


def _remote_model_weights(store: Store) -> dict[str, torch.Tensor]:
    checkpoint = store if is_complete(store) else None
    if checkpoint is None and not store.is_file(MODEL_FILE):
        if store.is_file(""):  # a .pt object
            return _checked_weights(load_torch(io.BytesIO(store.read_bytes()), "model file", str(store)), str(store))
        checkpoint = latest_complete(store)
        if checkpoint is None:
            raise CheckpointError(
                f"{store} holds no model.pt and no complete checkpoint; give a run directory, a checkpoint directory "
                "or a model .pt file (has the run saved one yet?)"
            )
    source = checkpoint or store
    if source.is_file(MODEL_FILE):
        data = source.read_bytes(MODEL_FILE)
        return _checked_weights(load_torch(io.BytesIO(data), "model file", f"{source}/{MODEL_FILE}"), str(source))
    with local_copy(source) as copy:  # sharded: its shards, gathered here
        return read_model(copy)


def _checked_weights(weights: Any, where: str) -> dict[str, torch.Tensor]:
    if isinstance(weights, dict) and "model" in weights and isinstance(weights["model"], dict):
        weights = weights["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(
            f"{where} does not hold a model state_dict (a dict of parameter names to tensors); save one with "
            "torch.save(model.state_dict(), PATH), or give a run or checkpoint directory"
        )
    return weights


def _read(directory: Where, name: str) -> str:
    store = remote(directory)
    return store.read_text(name) if store is not None else (Path(directory) / name).read_text()


def read_model(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model of a checkpoint's DCP files as a plain state_dict, every rank's part gathered
    in this process (no process group)."""
    return read_dcp(Path(directory), only="model")["model"]
