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

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Union

import torch

from raytrain.errors import CheckpointError
from raytrain.rundir.faults import without_credentials
from raytrain.rundir.formats import (
    DCP_METADATA,
    dcp_metadata,
    load_torch,
    read_dcp,
    save_torch,
    unreadable,
)
from raytrain.rundir.records import MODEL
from raytrain.rundir.storage import COMPLETE, Store

Where = Union[str, os.PathLike, Store]  # a checkpoint or run directory: a local path, a URI or a Store

TRAIN_STATE_FILE = "train_state.pt"
LEGACY_STATE_FILE = "state.pt"
MODEL_FILE = MODEL  # also the final model in the run directory
POSITION_FILE = "position.json"
STAGING = ".staging"
# The files a checkpoint directory becomes complete with: written after every rank's shards.
FINAL_FILES = (DCP_METADATA, MODEL_FILE, TRAIN_STATE_FILE, POSITION_FILE)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of the checkpoints reported to it
_STEP_IN_NAME = re.compile(r"^checkpoint_s(\d+)_")


def write_train_state(directory: str | os.PathLike, train_state: dict[str, Any]) -> None:
    """The small part of a checkpoint, and its position as JSON (written by one rank)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_torch(train_state, directory / TRAIN_STATE_FILE)
    (directory / POSITION_FILE).write_text(json.dumps(train_state.get("position", {})))


def _completed_by(store: Store) -> tuple[tuple[str, ...], ...]:
    """The sets of files, any one of which makes a checkpoint directory of `store` complete (the
    first file is the one named when none is there): where a directory is renamed into place
    whole, its train state with its position and DCP's metadata, or an earlier version's single
    state file (`Store.complete_with`: on an object store, its marker, written last)."""
    return store.complete_with(((TRAIN_STATE_FILE, POSITION_FILE, DCP_METADATA), (LEGACY_STATE_FILE,)))


def _whole(store: Store, present: Callable[[str], bool]) -> bool:
    return any(all(present(name) for name in files) for files in _completed_by(store))


def is_complete(directory: Where) -> bool:
    """Whether `directory` holds a whole checkpoint: its position, and its train state with
    DCP's metadata (or an earlier version's single state file); on an object store, its marker."""
    store = Store.of(directory)
    return _whole(store, store.is_file)


def is_legacy(directory: Where) -> bool:
    """A checkpoint of an earlier version: everything in one `state.pt` (none on an object
    store: they came after the single file)."""
    store = Store.of(directory)
    return not store.is_file(DCP_METADATA) and store.is_file(LEGACY_STATE_FILE)


def stored_step(directory: Where) -> int:
    """The optimizer step a checkpoint directory was taken at (-1 if unknown): from its name,
    else its position.json."""
    store = Store.of(directory)
    named = _STEP_IN_NAME.match(store.name)
    if named:
        return int(named[1])
    try:
        return int(json.loads(store.read_text(POSITION_FILE)).get("step", -1))
    except (OSError, ValueError, AttributeError):
        return -1


def stored_position(directory: Where) -> dict[str, Any]:
    """A checkpoint's position.json ({} when it cannot be read)."""
    try:
        value = json.loads(Store.of(directory).read_text(POSITION_FILE))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_train_state(directory: Where) -> dict[str, Any]:
    """A checkpoint's train state (an earlier version's whole state); CheckpointError naming the
    file when it is missing, truncated or not a raytrain checkpoint."""
    store = Store.of(directory)
    if not is_complete(store):
        missing = _completed_by(store)[0][0]
        raise CheckpointError(f"checkpoint {store} is incomplete or not a raytrain checkpoint (no {missing})")
    name = LEGACY_STATE_FILE if is_legacy(store) else TRAIN_STATE_FILE
    try:
        return _load(store, name, "checkpoint file", f"{store}/{name}")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {store} has no {name}; it is partial") from None


def load_state(directory: Where) -> dict[str, Any]:
    """Everything a checkpoint holds as plain containers, in one process (no process group):
    `model` and `optimizer` (keyed by parameter name) with the train state. For reading and
    tests; training loads its own shards (`raytrain.worker.state`)."""
    with local_copy(directory) as copy:
        state = load_train_state(copy)
        if is_legacy(copy):
            return state
        loaded = read_dcp(copy)
    return {**state, "model": loaded.get("model", {}), "optimizer": loaded.get("optim", {})}


def checkpoint_dirs(run_dir: Where) -> list:
    """Complete checkpoint directories of a run, oldest first (by their step, then name), by one
    listing: Paths on a file system, Stores on an object store.

    raytrain writes a checkpoint under RUN_DIR/.staging/ and renames it into place when it is
    complete, so a directory here is whole; older runs (Ray's own copy) may hold partial
    ones, which loading rejects. On an object store, those with their marker."""
    store = Store.of(run_dir)
    held: dict[str, set[str]] = {}  # a checkpoint directory's name: the names of its files
    for name in store.list(recursive=True):
        directory, _, file = name.partition("/")
        if directory.startswith("checkpoint_") and file:
            held.setdefault(directory, set()).add(file)
    found = [(store / name).path_or_store() for name, files in held.items() if _whole(store, files.__contains__)]
    return sorted(found, key=lambda p: (stored_step(p), p.name))


def remove(directory: Where) -> None:
    """Delete a checkpoint directory; on an object store its marker goes first, so a reader
    never takes a checkpoint that is being deleted for a complete one."""
    store = Store.of(directory)
    store.delete(COMPLETE)
    store.delete_tree()


def local_copy(directory: Where) -> ContextManager[Path]:
    """A checkpoint directory as a local path: itself, or a temporary copy of an object
    store's (deleted after)."""
    return Store.of(directory).local_copy()


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
    """Whether a checkpoint listed complete has since been removed (pruned): no longer complete
    (on a file system its files go with its directory, on an object store its marker goes first)."""
    return not is_complete(directory)


def _openable(directory: Where) -> dict[str, Any]:
    """The train state of the checkpoint in `directory` once its other files open (no tensor of
    the model is read); CheckpointError naming the file that does not."""
    store = Store.of(directory)
    state = load_train_state(store)
    legacy = is_legacy(store)
    name = MODEL_FILE if legacy else DCP_METADATA
    with store.local_copy((name,)) as copy:
        path = copy / name
        if not legacy:
            if not path.is_file():
                raise CheckpointError(f"checkpoint {store}: its {DCP_METADATA} is missing")
            dcp_metadata(copy, shown=store)
        elif path.is_file():
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:
                why = unreadable(exc, path, checkpoint=True)
                raise CheckpointError(f"checkpoint file {store}/{name} cannot be read: {why}") from None
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
    metadata (no tensor is loaded; on an object store, the metadata alone is copied) or from
    its model file."""
    store = Store.of(directory)
    if not is_legacy(store):
        with store.local_copy((DCP_METADATA,)) as copy:
            if (copy / DCP_METADATA).is_file():
                metadata = dcp_metadata(copy, shown=store)
                prefix = "model."
                return {
                    key[len(prefix) :]: tuple(meta.size)
                    for key, meta in metadata.state_dict_metadata.items()
                    if key.startswith(prefix) and hasattr(meta, "size")
                }
    return {key: tuple(value.shape) for key, value in load_model_weights(store).items()}


def load_model_weights(path: Where) -> dict[str, torch.Tensor]:
    """Model weights as a plain state_dict, from a run directory (model.pt, else its latest
    checkpoint), a checkpoint directory (its model.pt, else its DCP shards, gathered in this
    process without a process group) or a .pt file; each a local path or a URI."""
    store, shown = Store.of(path), _named(path)
    if store.is_file(""):  # a .pt file
        return _checked_weights(_load(store.parent, store.name, "model file", shown), shown)
    if not store.exists():
        raise CheckpointError(
            f"{shown} does not exist; give a run directory, a checkpoint directory or a model .pt file"
        )
    source = store
    if not is_complete(store) and not store.is_file(MODEL_FILE):  # a run without its final model yet
        latest = latest_complete(store)
        if latest is None:
            raise CheckpointError(f"{shown} holds no model.pt and no complete checkpoint; has the run saved one yet?")
        source = Store.of(latest)
        shown = f"{shown}/{source.name}"
    if source.is_file(MODEL_FILE):
        name = MODEL_FILE
    elif is_legacy(source):
        name = LEGACY_STATE_FILE
    else:  # sharded: its shards, gathered here
        with local_copy(source) as copy:
            return read_model(copy)
    return _checked_weights(_load(source, name, "model file", f"{shown}/{name}"), f"{shown}/{name}")


def _load(store: Store, name: str, what: str, shown: str) -> Any:
    """The torch file `name` of `store` (called `shown` in messages), loaded safely from a path
    on this node (an object is copied here first); FileNotFoundError when there is none."""
    with store.local_copy((name,)) as copy:
        if not (copy / name).is_file():
            raise FileNotFoundError(shown)
        return load_torch(copy / name, what, shown)


def _named(where: Where) -> str:
    """How `where` is named in messages: as the caller gave it (a path as typed, a URI without
    its credentials or query)."""
    return without_credentials(os.path.expanduser(str(where))).split("?", 1)[0]


def _checked_weights(weights: Any, where: str) -> dict[str, torch.Tensor]:
    if isinstance(weights, dict) and "model" in weights and isinstance(weights["model"], dict):
        weights = weights["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(
            f"{where} does not hold a model state_dict (a dict of parameter names to tensors); save one with "
            "torch.save(model.state_dict(), PATH), or give a run or checkpoint directory"
        )
    return weights


def read_model(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model of a checkpoint's DCP files as a plain state_dict, every rank's part gathered
    in this process (no process group)."""
    return read_dcp(Path(directory), only="model")["model"]
