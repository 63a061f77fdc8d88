"""How checkpoint files are written and read, whatever directory holds them: torch files
written whole or not at all and loaded safely (tensors and plain values only, and a file
that does not load is said for what it is), and DCP's files read in one process."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from raytrain.errors import CheckpointError
from raytrain.text import first_line

DCP_METADATA = ".metadata"  # written last by DCP: its shards are complete

ZIP_MAGIC = b"PK\x03\x04"  # how every file torch.save writes begins (its zip archive)


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


def unreadable(
    exc: BaseException, path: str | os.PathLike, *, checkpoint: bool = False, head: bytes | None = None
) -> str:
    """What a file that the safe loader (`torch.load(weights_only=True)`) refused is, from its
    error and its first bytes, in place of torch's own advice (which suggests
    weights_only=False: running whatever code the file names). `checkpoint`: a raytrain
    checkpoint file, which never holds objects. `head`: the file's first bytes, when it was
    read into memory."""
    text = str(exc)
    if head is None:
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


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP in one process (no process group): its warning that it assumes so is expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def load_torch(path: Path | io.BytesIO, what: str, name: str | None = None) -> Any:
    """A torch file read safely (weights_only); CheckpointError saying what the file is when it
    cannot be (`unreadable`), never torch's own advice to load it unsafely. `name`: what to call
    the file in messages (as stored, where `path` is a copy or in memory)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        head = path.getvalue()[:4] if isinstance(path, io.BytesIO) else None
        shown = name or path
        if what == "checkpoint file":
            why = unreadable(exc, path, checkpoint=True, head=head)
            raise CheckpointError(f"checkpoint file {shown} cannot be read: {why}") from None
        why = unreadable(exc, path, head=head)
        if "convert it once" not in why:  # the pickled-object answer carries its own fix
            why += (
                "; give a state_dict saved with torch.save(model.state_dict(), PATH), or a run or checkpoint directory"
            )
        raise CheckpointError(f"{shown} cannot be read as a torch file: {why}") from None


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


def dcp_metadata(directory: Path, shown: Any = None):
    """DCP's metadata in `directory`; CheckpointError naming the checkpoint (`shown`: as stored,
    where `directory` is a copy) when it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:
        where = shown or directory
        raise CheckpointError(f"checkpoint {where}: its {DCP_METADATA} cannot be read ({dcp_failure(exc)})") from None


def read_dcp(directory: Path, only: str | None = None) -> dict[str, Any]:
    """The DCP files' tensors (all, or those under `only`) as nested plain dicts, read in this
    process without a process group; DTensor shards come back whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp_metadata(directory)
    flat: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and (only is None or key.startswith(only + ".")):
            flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with single_process():
            dcp.load(flat, checkpoint_id=str(directory), no_dist=True)
    except dcp_errors() as exc:
        raise CheckpointError(f"checkpoint {directory}: its shards cannot be read ({dcp_failure(exc)})") from None
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
