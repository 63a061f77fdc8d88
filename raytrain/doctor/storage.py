"""The storage a run would use, as the driver finds it: exists, a directory, writable, its file
system type (shared by several machines or not), and a marker file the nodes read back. An
object store's URI is checked as a run checks it (credentials, the bucket, a write, read and
delete round trip: `raytrain.rundir.storage`), and the marker is an object there."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from raytrain.config import DEFAULT_STORAGE
from raytrain.errors import StorageError
from raytrain.rundir.storage import Store, is_uri

# File system types that can be shared by several machines (/proc/mounts' names).
NETWORK_FS = frozenset(
    "nfs nfs4 cifs smbfs smb3 fuse fuse.sshfs fuse.juicefs fuse.gcsfuse lustre gpfs beegfs ceph cephfs glusterfs "
    "fuse.glusterfs efs 9p wekafs fuse.s3fs".split()
)


@dataclass
class StorageState:
    """What the driver (this process) found at the storage path."""

    path: str
    explicit: bool  # given with --storage (else the default)
    exists: bool = False
    is_dir: bool = False
    writable: bool = False
    error: str = ""
    marker: str = ""  # name of the file written here for the nodes to read back
    token: str = ""  # its content
    fs_type: str = ""
    remote: bool = False  # an object store's URI (path is then the URI, without credentials)
    uri: str = ""  # what the nodes open (the URI as given)


def inspect_storage(storage: str | None) -> StorageState:
    """Check the path from this process; when it is a writable directory, leave a marker file
    in it for the nodes to read back (removed by `remove_marker`)."""
    if storage and is_uri(storage):
        return _inspect_store(Store.of(storage))
    path = Path(os.path.expanduser(storage or DEFAULT_STORAGE)).absolute()
    state = StorageState(path=str(path), explicit=bool(storage), uri=str(path))
    state.exists = path.exists()
    state.is_dir = path.is_dir()
    state.fs_type = _fs_type(path)
    if not state.is_dir:
        return state
    marker = path / f".raytrain-doctor-{uuid.uuid4().hex}"
    try:
        marker.write_text(f"{socket.gethostname()} {marker.name}")
        state.writable, state.marker, state.token = True, marker.name, marker.read_text()
    except OSError as exc:
        state.error = exc.strerror or type(exc).__name__
    return state


def _inspect_store(store: Store) -> StorageState:
    state = StorageState(path=store.public_uri, explicit=True, remote=True, uri=store.uri)
    try:
        store.check()
        marker = f".raytrain-doctor-{uuid.uuid4().hex}"
        token = f"{socket.gethostname()} {marker}"
        store.write_text(marker, token)
    except StorageError as exc:
        state.error = str(exc)
        return state
    state.exists = state.is_dir = state.writable = True
    state.marker, state.token, state.fs_type = marker, token, f"object store ({store.scheme})"
    return state


def remove_marker(state: StorageState) -> None:
    if state.marker:
        try:
            if state.remote:
                Store.of(state.uri).delete(state.marker)
            else:
                (Path(state.path) / state.marker).unlink()
        except OSError:
            pass
        state.marker = ""


def _fs_type(path: Path) -> str:
    """The file system type of the mount `path` (or its nearest existing parent) is on."""
    import psutil

    try:
        mounts = psutil.disk_partitions(all=True)
    except OSError:
        return ""
    target = str(path)
    best = max(
        (m for m in mounts if target == m.mountpoint or target.startswith(m.mountpoint.rstrip("/") + "/")),
        key=lambda m: len(m.mountpoint),
        default=None,
    )
    return best.fstype if best else ""


def describe_storage(state: StorageState, multi_node: bool) -> str:
    fs = f", {state.fs_type}" if state.fs_type else ""
    if state.remote:
        if not state.writable:
            return f"Storage: {state.path} (cannot be used: {state.error})"
        checked = "; written, read and deleted from every node" if state.marker else ""
        return f"Storage: {state.path} (credentials, bucket and a write, read and delete checked here{fs}{checked})"
    if not state.exists:
        return f"Storage: {state.path} (does not exist{fs})"
    if not state.is_dir:
        return f"Storage: {state.path} (not a directory)"
    if not state.writable:
        return f"Storage: {state.path} (not writable: {state.error}{fs})"
    checked = "; read back on every node" if multi_node and state.marker else ""
    return f"Storage: {state.path} (writable{fs}{checked})"
