"""Where a run's files live: a local directory or a prefix of an object store, behind one interface.

`Store` is a location — `/data/runs/digits-1`, `s3://bucket/runs/digits-1`,
`gs://bucket/runs/digits-1`, or any URI `pyarrow.fs.FileSystem.from_uri` resolves (the
endpoint and region from the standard AWS variables or the URI's query,
`?endpoint_override=HOST:PORT&scheme=http`) — with the operations every run file needs,
done as each kind of storage allows:

- a whole-file write is atomic: a local file is written under a temporary name and renamed;
  an object is uploaded from memory and becomes visible, complete, when its upload closes;
- an append: a local file is appended to; an object (stores have no append) is read,
  extended and written back whole;
- an exclusive create (the run lock): O_EXCL locally; on S3 a conditional write
  (`If-None-Match: *`); on a store without one, a check then a write (a documented race);
- transient errors (timeouts, refused connections, 5xx, throttling) are retried with backoff
  for up to `retry_s` seconds, and then raise `StorageUnavailable`; permanent ones (no
  credentials, a missing bucket, access denied) raise a `StorageError` at once, naming the
  location and the fix.

What differs between the kinds is answered here, so that callers never ask which kind a Store
is: how a file becomes visible (`staged_file`, `write_locally`), a local path for tools that
need one (`local_dir`, `local_copy`), how often to look (`poll_s`) and whether to batch appends
(`appends_in_place`), and where Ray keeps its own files (`ray_storage`).

Paths inside a store are relative names with `/` (`checkpoint_x/.metadata`). A Store pickles
as its URI: each process builds its own file system object (credentials come from that
process's environment or the machine's role, never from a pickle).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import shutil
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

from raytrain.rundir.faults import (
    DEFAULT_RETRY_S,
    RETRY_ENV,
    StorageUnavailable,
    classify,
    default_retry_s,
    local_errors,
    retried,
    storage_error,
    without_credentials,
)
from raytrain.rundir.s3 import open_store, put_if_absent

# On an object store a file is looked at (a request each time) at most this often.
POLL_S = 1.0
# Where an object store's run keeps this node's own files (`Store.local_dir`); default: the temp directory.
NODE_DIR_ENV = "RAYTRAIN_NODE_DIR"


def is_uri(location: str | os.PathLike) -> bool:
    """An object-store URI (`s3://…`, `gs://…`), not a local path (`file://` is a path)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


@dataclasses.dataclass(frozen=True)
class Store:
    """A location of run files (see the module's docstring). `uri`: an absolute local path, or
    `scheme://bucket/key[?query]`."""

    uri: str
    retry_s: float | None = None  # None: default_retry_s() where the operation runs

    @staticmethod
    def of(location: "str | os.PathLike | Store", retry_s: float | None = None) -> "Store":
        if isinstance(location, Store):
            return location if retry_s is None else dataclasses.replace(location, retry_s=retry_s)
        text = str(location)
        if is_uri(text):
            parts = urllib.parse.urlsplit(text)
            path = "/" + parts.path.strip("/") if parts.path.strip("/") else ""
            text = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
        else:
            text = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
        return Store(text, retry_s)

    def __reduce__(self):  # the URI travels, not a file system object
        return (Store, (self.uri, self.retry_s))

    # -- where ----------------------------------------------------------------------------------

    @property
    def local(self) -> bool:
        return not is_uri(self.uri)

    @property
    def path(self) -> Path:
        """The local directory (local stores only)."""
        if not self.local:
            raise ValueError(f"{self} is not a local path")
        return Path(self.uri)

    def __truediv__(self, name: str) -> "Store":
        if self.local:
            return Store(str(Path(self.uri) / name), self.retry_s)
        parts = urllib.parse.urlsplit(self.uri)
        path = parts.path.rstrip("/") + "/" + str(name).strip("/")
        return Store(urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")), self.retry_s)

    @property
    def name(self) -> str:
        return Path(self.uri).name if self.local else urllib.parse.urlsplit(self.uri).path.rstrip("/").split("/")[-1]

    @property
    def parent(self) -> "Store":
        if self.local:
            return Store(str(Path(self.uri).parent), self.retry_s)
        parts = urllib.parse.urlsplit(self.uri)
        path = parts.path.rstrip("/").rsplit("/", 1)[0]
        return Store(urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")), self.retry_s)

    @property
    def scheme(self) -> str:
        return "" if self.local else urllib.parse.urlsplit(self.uri).scheme

    def __str__(self) -> str:
        """For messages: the path, or the URI without credentials or query."""
        return self.uri if self.local else without_credentials(self.uri).split("?", 1)[0]

    @property
    def public_uri(self) -> str:
        """The location to give back to raytrain (`--storage`, `--resume`): the URI with its
        query, without credentials."""
        return self.uri if self.local else without_credentials(self.uri)

    def __fspath__(self) -> str:  # a local store stands for its directory wherever a path is taken
        return str(self.path)

    @functools.cached_property
    def _resolved(self) -> tuple[Any, str]:
        import pyarrow.fs as pafs

        if self.local:
            return pafs.LocalFileSystem(), self.uri
        fs, path = open_store(self.uri, str(self))
        return fs, path.rstrip("/")

    @property
    def fs(self):
        """The pyarrow file system (built in this process, on first use)."""
        return self._resolved[0]

    @property
    def root(self) -> str:
        """This location's path inside `fs` (`bucket/prefix` for an object store)."""
        return self._resolved[1]

    def fs_path(self, name: str = "") -> str:
        return f"{self.root}/{name.strip('/')}" if name else self.root

    # -- reading --------------------------------------------------------------------------------

    def read_bytes(self, name: str = "") -> bytes:
        """The whole file (FileNotFoundError if there is none)."""
        if self.local:
            return (self.path / name).read_bytes()
        return self._retry("read", name, lambda: _read_all(self.fs, self.fs_path(name)))

    def read_text(self, name: str = "") -> str:
        return self.read_bytes(name).decode(errors="replace")

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """`length` bytes from `start` (a ranged GET on an object store)."""

        def read() -> bytes:
            with self.fs.open_input_file(self.fs_path(name)) as handle:
                handle.seek(start)
                return handle.read(length)

        return read() if self.local else self._retry("read", name, read)

    def info(self, name: str = ""):
        """pyarrow's FileInfo (type NotFound when there is nothing)."""
        if self.local:
            return self.fs.get_file_info(self.fs_path(name))
        return self._retry("look at", name, lambda: self.fs.get_file_info(self.fs_path(name)))

    def size(self, name: str) -> int | None:
        info = self.info(name)
        return info.size if info.type.name == "File" else None

    def exists(self, name: str = "") -> bool:
        if self.local:
            return (self.path / name).exists()
        return self.info(name).type.name != "NotFound"

    def is_file(self, name: str) -> bool:
        return (self.path / name).is_file() if self.local else self.info(name).type.name == "File"

    def list(self, name: str = "", recursive: bool = False) -> list[str]:
        """Names under `name` (relative to it; directories too; [] when there is nothing)."""
        import pyarrow.fs as pafs

        base = self.fs_path(name)
        selector = pafs.FileSelector(base, recursive=recursive, allow_not_found=True)
        infos = (
            self.fs.get_file_info(selector)
            if self.local
            else self._retry("list", name, self.fs.get_file_info, selector)
        )
        return sorted(info.path[len(base) :].lstrip("/") for info in infos)

    # -- writing --------------------------------------------------------------------------------

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace the file with `data` in one step: readers see the old content or the new."""
        if self.local:
            with self.staged_file(name) as tmp, self._local_errors(name, "write"), open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            return

        def put() -> None:
            with self.fs.open_output_stream(self.fs_path(name)) as out:
                out.write(data)

        self._retry("write", name, put)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def append_text(self, name: str, text: str) -> None:
        """Add `text` at the end (an object is rewritten whole: one writer at a time)."""
        if self.local:
            with self._local_errors(name, "append to"), open(self.path / name, "a") as handle:
                handle.write(text)
            return
        try:
            before = self.read_bytes(name)
        except FileNotFoundError:
            before = b""
        self.write_bytes(name, before + text.encode())

    def make_dir(self) -> None:
        """Create this directory (an object store needs none)."""
        if self.local:
            with self._local_errors("", "create the directory"):
                self.path.mkdir(parents=True, exist_ok=True)

    def delete(self, name: str) -> None:
        """Remove a file; nothing when it is already gone."""
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
            return
        with contextlib.suppress(FileNotFoundError):
            self._retry("delete", name, self.fs.delete_file, self.fs_path(name))

    def delete_tree(self, name: str = "") -> None:
        """Remove a directory and everything under it; nothing when it is already gone."""
        if self.local:
            shutil.rmtree(self.path / name, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self._retry("delete", name, self.fs.delete_dir, self.fs_path(name))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create the file only if there is none (False: there is one). See the module's docstring
        for what each kind of storage guarantees."""
        if self.local:
            try:
                fd = os.open(self.path / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            except OSError as exc:
                raise storage_error(exc, getattr(exc, "filename", None) or self.path / name, "create") from None
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            return True
        if self.scheme == "s3":
            return self._retry("create", name, put_if_absent, self.fs, self.fs_path(name), data)
        if self.exists(name):  # no conditional write through pyarrow here: a check, then a write
            return False
        self.write_bytes(name, data)
        return True

    # -- whole directories ----------------------------------------------------------------------

    def upload(self, local_file: str | os.PathLike, name: str) -> None:
        """Copy a local file to `name` (an object appears whole when its upload completes)."""
        if self.local:
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local_file, target)
            return
        import pyarrow.fs as pafs

        here, there = pafs.LocalFileSystem(), self.fs_path(name)
        self._retry("upload", name, pafs.copy_files, str(local_file), there, here, self.fs, use_threads=False)

    def download(self, name: str, local_dir: str | os.PathLike) -> Path:
        """Copy the directory `name` into `local_dir` (created); returns `local_dir`."""
        import pyarrow.fs as pafs

        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        self._retry(
            "download", name, pafs.copy_files, self.fs_path(name), str(local_dir), self.fs, pafs.LocalFileSystem()
        )
        return local_dir

    # -- what each kind needs (so that callers never ask which kind it is) -----------------------

    @property
    def appends_in_place(self) -> bool:
        """Whether `append_text` adds to the file (local) or rewrites it whole (an object: batch appends)."""
        return self.local

    @property
    def poll_s(self) -> float:
        """The least time between two looks at a file here: none locally, POLL_S where each look is a request."""
        return 0.0 if self.local else POLL_S

    @property
    def local_dir(self) -> Path:
        """This directory on this node: itself, or an object store's node-local stand-in (staging, heartbeats,
        the files of tools that write to a path), removed by `release_local_dir`."""
        if self.local:
            return self.path
        digest = hashlib.blake2b(str(self).encode(), digest_size=6).hexdigest()
        return Path(os.environ.get(NODE_DIR_ENV) or tempfile.gettempdir()) / f"raytrain-node-{self.name}-{digest}"

    def release_local_dir(self) -> None:
        """Remove an object store's `local_dir` (a local directory is the run itself, and stays)."""
        if not self.local:
            shutil.rmtree(self.local_dir, ignore_errors=True)

    def ray_storage(self) -> dict[str, Any]:
        """Ray's RunConfig storage options that put its files here (on a store, the file system built here)."""
        return {"storage_path": self.uri} if self.local else {"storage_path": self.root, "storage_filesystem": self.fs}

    @contextlib.contextmanager
    def staged_file(self, name: str) -> Iterator[Path]:
        """A local path to write `name` at; when the block ends it is visible whole (renamed, or uploaded)."""
        if not self.local:
            with tempfile.TemporaryDirectory(prefix="raytrain-stage-") as scratch:
                yield Path(scratch, Path(name).name)
                self.upload(Path(scratch, Path(name).name), name)
            return
        target = self.path / name
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            yield tmp
            with self._local_errors(name, "write"):
                os.replace(tmp, target)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    @contextlib.contextmanager
    def write_locally(self, patterns: tuple[str, ...] = ("**/*",)) -> Iterator[Path]:
        """A local directory whose files (those matching `patterns`) are this one's once the block ends
        without error: itself, or a temporary one that is uploaded, then removed."""
        if self.local:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix=f"raytrain-{self.name}-") as scratch:
            yield Path(scratch)
            self.upload_from(scratch, patterns)

    def upload_from(self, local_dir: str | os.PathLike, patterns: tuple[str, ...] = ("**/*",)) -> None:
        """Copy the files of `local_dir` matching `patterns` here, by the same relative names (nothing
        when `local_dir` is this directory)."""
        local_dir = Path(local_dir).absolute()
        if self.local and local_dir == self.path:
            return
        for path in sorted({path for pattern in patterns for path in local_dir.glob(pattern) if path.is_file()}):
            self.upload(path, path.relative_to(local_dir).as_posix())

    @contextlib.contextmanager
    def local_copy(self, names: tuple[str, ...] | None = None) -> Iterator[Path]:
        """A local directory holding this one's files `names` (files or directories; None: all) that exist:
        itself, or a temporary copy, removed after."""
        if self.local:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="raytrain-copy-") as copy:
            for name in names if names is not None else ("",):
                if name and self.is_file(name):
                    Path(copy, name).write_bytes(self.read_bytes(name))
                elif not name or self.list(name):
                    self.download(name, Path(copy, name))
            yield Path(copy)

    # -- before a run -----------------------------------------------------------------------------

    def check(self) -> bool:
        """Before anything starts, that run files can be written here (StorageError naming the fix if not):
        True when it created the (local) directory (`faults.check_local`, `faults.check_store`)."""
        from raytrain.rundir.faults import check_local, check_store

        if self.local:
            return check_local(self)
        check_store(self)
        return False

    # -- what a run's checkpoints and heartbeats need of each kind of storage ----------------------

    @property
    def renames(self) -> bool:  # a whole directory appears renamed into place, not by a marker written last
        return self.local

    def local_path(self) -> Path | None:
        return self.path if self.local else None

    def path_or_store(self) -> "Path | Store":
        """This location as callers that work on files take it: a local directory's Path, else the Store."""
        return self.local_path() or self

    # -- errors ---------------------------------------------------------------------------------

    _retry = retried  # retried with backoff while the store's errors are transient (`faults.retried`)
    _local_errors = local_errors  # an OSError of a local file as one StorageError naming it


def _read_all(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as handle:
        return handle.readall()


__all__ = [
    "DEFAULT_RETRY_S",
    "RETRY_ENV",
    "NODE_DIR_ENV",
    "POLL_S",
    "Store",
    "StorageUnavailable",
    "classify",
    "default_retry_s",
    "is_uri",
    "without_credentials",
]
