"""Where a run's files live: a local directory or a prefix of an object store, behind one interface.

`Store` is a location — `/data/runs/digits-1`, `s3://bucket/runs/digits-1`,
`gs://bucket/runs/digits-1`, or any URI `pyarrow.fs.FileSystem.from_uri` resolves (the
endpoint and region from the standard AWS variables or the URI's query,
`?endpoint_override=HOST:PORT&scheme=http`) — with the operations every run file needs, done
as each kind allows. Each kind is a class, `LocalStore` and `ObjectStore`; `Store.of` is the one
place that picks one, and `Store` declares what each does its own way: callers never ask which.

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
from typing import Any, ClassVar, ContextManager, Iterator

from raytrain.rundir.faults import (
    RETRY_ENV,
    StorageUnavailable,
    check_local,
    check_store,
    local_errors,
    retried,
    storage_error,
    storage_errors,
    without_credentials,
)
from raytrain.rundir.s3 import open_store, put_if_absent

# On an object store a file is looked at (a request each time) at most this often.
POLL_S = 1.0
# Where an object store's run keeps this node's own files (`Store.local_dir`); default: the temp directory.
NODE_DIR_ENV = "RAYTRAIN_NODE_DIR"
COMPLETE = ".complete.json"  # an object store's checkpoint is complete once this is there (written last)
Sets = tuple[tuple[str, ...], ...]  # sets of file names, any one of which makes a directory complete


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
            return ObjectStore(urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")), retry_s)
        return LocalStore(os.path.abspath(os.path.expanduser(text.removeprefix("file://"))), retry_s)

    def __reduce__(self):  # the URI travels, not a file system object
        return (type(self), (self.uri, self.retry_s))

    def __fspath__(self) -> str:  # a local store stands for its directory wherever a path is taken
        return str(self.path)

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

    def read_text(self, name: str = "") -> str:
        return self.read_bytes(name).decode(errors="replace")

    def info(self, name: str = ""):
        """pyarrow's FileInfo (type NotFound when there is nothing)."""
        return self._retry("look at", name, self.fs.get_file_info, self.fs_path(name))

    def exists(self, name: str = "") -> bool:
        return self.info(name).type.name != "NotFound"

    def is_file(self, name: str) -> bool:
        return self.info(name).type.name == "File"

    def delete(self, name: str) -> None:
        """Remove a file; nothing when it is already gone."""
        with contextlib.suppress(FileNotFoundError):
            self._retry("delete", name, self.fs.delete_file, self.fs_path(name))

    def size(self, name: str) -> int | None:
        info = self.info(name)
        return info.size if info.type.name == "File" else None

    def list(self, name: str = "", recursive: bool = False) -> list[str]:
        """Names under `name` (relative to it; directories too; [] when there is nothing)."""
        import pyarrow.fs as pafs

        base = self.fs_path(name)
        selector = pafs.FileSelector(base, recursive=recursive, allow_not_found=True)
        return sorted(
            info.path[len(base) :].lstrip("/") for info in self._retry("list", name, self.fs.get_file_info, selector)
        )

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def download(self, name: str, local_dir: str | os.PathLike) -> Path:
        """Copy the directory `name` into `local_dir` (created); returns `local_dir`."""
        import pyarrow.fs as pafs

        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        self._retry(
            "download", name, pafs.copy_files, self.fs_path(name), str(local_dir), self.fs, pafs.LocalFileSystem()
        )
        return local_dir

    def upload_from(self, local_dir: str | os.PathLike, patterns: tuple[str, ...] = ("**/*",)) -> None:
        """Copy the files of `local_dir` matching `patterns` here by their relative names (none if it is this one)."""
        local_dir = Path(local_dir).absolute()
        if local_dir == self.path_or_store():
            return
        for path in sorted({path for pattern in patterns for path in local_dir.glob(pattern) if path.is_file()}):
            self.upload(path, path.relative_to(local_dir).as_posix())

    _local_errors = local_errors  # an OSError of a local file as one StorageError naming it

    # What each kind does its own way. Where: `path` (a local store's directory), `name`, `parent`,
    # `scheme`, `public_uri` (the location as raytrain takes it back), `/`, and `str()` (for messages).
    poll_s: ClassVar[float]  # the least time between two looks at a file: none locally, POLL_S on an object store
    appends_in_place: ClassVar[bool]  # `append_text` adds to the file; or rewrites an object whole: batch appends
    local_dir: ClassVar[Path]  # this directory on this node: itself, or an object store's node-local stand-in

    def read_bytes(self, name: str = "") -> bytes: ...  # the whole file (FileNotFoundError if there is none)
    def read_range(self, name: str, start: int, length: int) -> bytes: ...  # `length` bytes from `start`
    def write_bytes(self, name: str, data: bytes) -> None: ...  # replaced in one step: old content or new
    def append_text(self, name: str, text: str) -> None: ...  # an object: one writer at a time
    def make_dir(self) -> None:  # create this directory (an object store needs none)
        pass

    def delete_tree(self, name: str = "") -> None: ...  # a directory and all under it; nothing when gone
    def create_exclusive(self, name: str, data: bytes) -> bool: ...  # only if there is none (False: there is)
    def upload(self, local_file: str | os.PathLike, name: str) -> None: ...  # copy a local file to `name`
    def release_local_dir(self) -> None:  # remove an object store's `local_dir` (a local one is the run)
        pass

    def ray_storage(self) -> dict[str, Any]: ...  # Ray's RunConfig storage options that put its files here
    def staged_file(self, name: str) -> ContextManager[Path]: ...  # a path to write `name` at, whole once done
    # A local directory: whose files (`patterns`) become this one's once the block ends without error; holding
    # this one's files `names` (None: all). Itself, or a temporary one (uploaded after; or a copy).
    def write_locally(self, patterns: tuple[str, ...] = ("**/*",)) -> ContextManager[Path]: ...
    def local_copy(self, names: tuple[str, ...] | None = None) -> ContextManager[Path]: ...
    def check(self) -> bool: ...  # that run files can be written here (StorageError if not); True: dir created
    def path_or_store(self) -> "Path | Store": ...  # as callers that work on files take it: a directory's Path
    # A checkpoint directory: the sets of files any one of which make it complete (`renamed` where it is renamed
    # into place whole; on an object store, its marker, uploaded last); made visible (`Publish` staged it); how
    # long to wait for that; Ray's latest (at `ray_path`) as a directory to resume from besides the listing.
    def complete_with(self, renamed: Sets) -> Sets: ...
    def publish(self, publish: Any) -> None: ...
    def publish_wait_s(self, timeout_s: float | None, rename_s: float) -> float | None: ...
    def resume_also(self, ray_path: str) -> Path | None: ...


class LocalStore(Store):
    """A directory on this file system (shared by the nodes of a run that has several)."""

    local, scheme, poll_s, appends_in_place = True, "", 0.0, True  # a look costs nothing: no least time

    @property
    def path(self) -> Path:
        return Path(self.uri)

    def __truediv__(self, name: str) -> "LocalStore":
        return LocalStore(str(Path(self.uri) / name), self.retry_s)

    def __str__(self) -> str:
        return self.uri

    name = property(lambda self: Path(self.uri).name)
    parent = property(lambda self: LocalStore(str(Path(self.uri).parent), self.retry_s))
    public_uri = property(__str__)
    local_dir = path  # this directory on this node: itself
    path_or_store = lambda self: self.path  # noqa: E731

    @functools.cached_property
    def _resolved(self) -> tuple[Any, str]:  # (file system, root), built in this process on first use
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem(), self.uri

    def _retry(self, doing: str, name: str, call, *args, **kwargs):  # a local file's errors are not transient
        return call(*args, **kwargs)

    def read_bytes(self, name: str = "") -> bytes:
        return (self.path / name).read_bytes()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        with open(self.path / name, "rb") as handle:  # a directory: IsADirectoryError (pyarrow's is a bare OSError)
            handle.seek(start)
            return handle.read(length)

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.staged_file(name) as tmp, self._local_errors(name, "write"), open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def append_text(self, name: str, text: str) -> None:
        with self._local_errors(name, "append to"), open(self.path / name, "a") as handle:
            handle.write(text)

    def make_dir(self) -> None:
        with self._local_errors("", "create the directory"):
            self.path.mkdir(parents=True, exist_ok=True)

    def delete_tree(self, name: str = "") -> None:
        shutil.rmtree(self.path / name, ignore_errors=True)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        try:
            fd = os.open(self.path / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise storage_error(exc, getattr(exc, "filename", None) or self.path / name, "create") from None
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return True

    def upload(self, local_file: str | os.PathLike, name: str) -> None:
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local_file, target)

    def ray_storage(self) -> dict[str, Any]:
        return {"storage_path": self.uri}

    @contextlib.contextmanager
    def staged_file(self, name: str) -> Iterator[Path]:
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
    def local_copy(self, names: tuple[str, ...] | None = None) -> Iterator[Path]:
        yield self.path

    write_locally = local_copy  # the directory whose files become this one's: itself

    check = check_local

    def complete_with(self, renamed: Sets) -> Sets:
        return renamed

    def publish(self, publish: Any) -> None:
        if publish.coordinator:  # the other ranks wrote theirs into its staging directory
            publish.fence()
            with storage_errors(self.path, "publish the checkpoint"):
                os.rename(publish.staging, self.path)

    def publish_wait_s(self, timeout_s: float | None, rename_s: float) -> float | None:
        return min(rename_s, timeout_s or rename_s)

    def resume_also(self, ray_path: str) -> Path:
        return Path(ray_path)


class ObjectStore(Store):
    """A prefix of an object store: each look at a file is a request, transient errors are retried."""

    local, poll_s, appends_in_place = False, POLL_S, False

    @property
    def path(self) -> Path:
        raise ValueError(f"{self} is not a local path")

    def _at(self, path: str) -> "ObjectStore":
        parts = urllib.parse.urlsplit(self.uri)
        return ObjectStore(urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")), self.retry_s)

    def __truediv__(self, name: str) -> "ObjectStore":
        return self._at(urllib.parse.urlsplit(self.uri).path.rstrip("/") + "/" + str(name).strip("/"))

    name = property(lambda self: urllib.parse.urlsplit(self.uri).path.rstrip("/").split("/")[-1])
    parent = property(lambda self: self._at(urllib.parse.urlsplit(self.uri).path.rstrip("/").rsplit("/", 1)[0]))
    scheme = property(lambda self: urllib.parse.urlsplit(self.uri).scheme)

    def __str__(self) -> str:  # for messages: the URI without credentials or query
        return without_credentials(self.uri).split("?", 1)[0]

    @property
    def public_uri(self) -> str:  # to give back to raytrain (--storage, --resume): with its query, no credentials
        return without_credentials(self.uri)

    def path_or_store(self) -> "ObjectStore":
        return self

    @functools.cached_property
    def _resolved(self) -> tuple[Any, str]:
        fs, path = open_store(self.uri, str(self))
        return fs, path.rstrip("/")

    _retry = retried  # retried with backoff while the store's errors are transient (`faults.retried`)

    def read_bytes(self, name: str = "") -> bytes:
        def read() -> bytes:
            with self.fs.open_input_stream(self.fs_path(name)) as handle:
                return handle.readall()

        return self._retry("read", name, read)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        def read() -> bytes:  # a ranged GET
            with self.fs.open_input_file(self.fs_path(name)) as handle:
                handle.seek(start)
                return handle.read(length)

        return self._retry("read", name, read)

    def write_bytes(self, name: str, data: bytes) -> None:
        def put() -> None:
            with self.fs.open_output_stream(self.fs_path(name)) as out:
                out.write(data)

        self._retry("write", name, put)

    def append_text(self, name: str, text: str) -> None:
        try:
            before = self.read_bytes(name)
        except FileNotFoundError:
            before = b""
        self.write_bytes(name, before + text.encode())

    def delete_tree(self, name: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry("delete", name, self.fs.delete_dir, self.fs_path(name))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        if self.scheme == "s3":
            return self._retry("create", name, put_if_absent, self.fs, self.fs_path(name), data)
        if self.exists(name):  # no conditional write through pyarrow here: a check, then a write
            return False
        self.write_bytes(name, data)
        return True

    def upload(self, local_file: str | os.PathLike, name: str) -> None:
        import pyarrow.fs as pafs

        here, there = pafs.LocalFileSystem(), self.fs_path(name)
        self._retry("upload", name, pafs.copy_files, str(local_file), there, here, self.fs, use_threads=False)

    @property
    def local_dir(self) -> Path:
        # staging, heartbeats, the files of tools that write to a path; removed by `release_local_dir`
        digest = hashlib.blake2b(str(self).encode(), digest_size=6).hexdigest()
        return Path(os.environ.get(NODE_DIR_ENV) or tempfile.gettempdir()) / f"raytrain-node-{self.name}-{digest}"

    def release_local_dir(self) -> None:
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def ray_storage(self) -> dict[str, Any]:
        return {"storage_path": self.root, "storage_filesystem": self.fs}  # the file system built here

    @contextlib.contextmanager
    def staged_file(self, name: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="raytrain-stage-") as scratch:
            yield Path(scratch, Path(name).name)
            self.upload(Path(scratch, Path(name).name), name)

    @contextlib.contextmanager
    def write_locally(self, patterns: tuple[str, ...] = ("**/*",)) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix=f"raytrain-{self.name}-") as scratch:
            yield Path(scratch)
            self.upload_from(scratch, patterns)

    @contextlib.contextmanager
    def local_copy(self, names: tuple[str, ...] | None = None) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="raytrain-copy-") as copy:
            for name in names if names is not None else ("",):
                if name and self.is_file(name):
                    Path(copy, name).write_bytes(self.read_bytes(name))
                elif not name or self.list(name):
                    self.download(name, Path(copy, name))
            yield Path(copy)

    check = check_store

    def complete_with(self, renamed: Sets) -> Sets:
        return ((COMPLETE,),)

    def publish(self, publish: Any) -> None:
        publish.upload()  # every rank its own files; the coordinator the final ones, and the marker last

    def publish_wait_s(self, timeout_s: float | None, rename_s: float) -> float | None:
        return timeout_s

    def resume_also(self, ray_path: str) -> None:
        return None  # Ray registers one here only once complete, and listing the run finds it


__all__ = ["COMPLETE", "LocalStore", "ObjectStore", "RETRY_ENV", "Store", "StorageUnavailable", "is_uri"]
