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

Paths inside a store are relative names with `/` (`checkpoint_x/.metadata`). A Store pickles
as its URI: each process builds its own file system object (credentials come from that
process's environment or the machine's role, never from a pickle).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno as errno_codes
import functools
import hashlib
import os
import re
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from raytrain.errors import StorageError
from raytrain.rundir.faults import StorageUnavailable, cause_of, classify, storage_error, unavailable
from raytrain.rundir.s3 import bounded, put_if_absent

T = TypeVar("T")

# How long a run rides out an object-store outage before it stops (seconds of retries per call);
# RAYTRAIN_STORAGE_RETRY_S, in the environment of the driver (which passes it to the workers), wins.
DEFAULT_RETRY_S = 120.0
RETRY_ENV = "RAYTRAIN_STORAGE_RETRY_S"


def default_retry_s() -> float:
    try:
        return float(os.environ.get(RETRY_ENV, DEFAULT_RETRY_S))
    except ValueError:
        return DEFAULT_RETRY_S


# Backoff between retries of one call: doubling from the first, capped.
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 15.0
# gs:// without credentials retries inside google-cloud-cpp for about 15 minutes: bound it.
GCS_RETRY_LIMIT_S = 15


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
        uri = self.uri
        if self.scheme in ("gs", "gcs") and "retry_limit_seconds" not in uri:
            uri += ("&" if "?" in uri else "?") + f"retry_limit_seconds={GCS_RETRY_LIMIT_S}"
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except Exception as exc:  # ArrowInvalid for an unknown scheme or option
            raise StorageError(
                errno_codes.EINVAL,
                f"--storage {self}: pyarrow cannot open it ({cause_of(exc)}); give a local path, s3://BUCKET/PREFIX, "
                "gs://BUCKET/PREFIX or another URI pyarrow.fs resolves",
            ) from None
        if isinstance(fs, pafs.S3FileSystem):
            fs = bounded(fs)
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
            replace_file(self.path / name, data)
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
            import shutil

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
                raise _local_error(exc, self.path / name, "create") from None
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
            import shutil

            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local_file, target)
            return
        import pyarrow.fs as pafs

        self._retry(
            "upload",
            name,
            pafs.copy_files,
            str(local_file),
            self.fs_path(name),
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=self.fs,
            use_threads=False,
        )

    def download(self, name: str, local_dir: str | os.PathLike) -> Path:
        """Copy the directory `name` into `local_dir` (created); returns `local_dir`."""
        import pyarrow.fs as pafs

        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        self._retry(
            "download",
            name,
            pafs.copy_files,
            self.fs_path(name),
            str(local_dir),
            source_filesystem=self.fs,
            destination_filesystem=pafs.LocalFileSystem(),
        )
        return local_dir

    # -- before a run -----------------------------------------------------------------------------

    def check(self) -> None:
        """Before anything starts: credentials, the bucket, and a write, read and delete round
        trip (`raytrain.rundir.faults.check_store`)."""
        from raytrain.rundir.faults import check_store

        check_store(self)

    # -- what a run's checkpoints and heartbeats need of each kind of storage ----------------------

    @property
    def renames(self) -> bool:  # a whole directory appears renamed into place, not by a marker written last
        return self.local

    def local_path(self) -> Path | None:
        return self.path if self.local else None

    def work_dir(self) -> Path:
        """Where this node stages checkpoints and keeps heartbeats: the run directory on a file system."""
        return self.path if self.local else self.node_dir()

    def node_dir(self) -> Path:  # this node's own directory for the run (node-local)
        digest = hashlib.blake2b(str(self).encode(), digest_size=6).hexdigest()
        return Path(os.environ.get("RAYTRAIN_NODE_DIR") or tempfile.gettempdir(), f"raytrain-node-{self.name}-{digest}")

    # -- errors ---------------------------------------------------------------------------------

    def _retry(self, doing: str, name: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call`, retried with backoff while the store's errors are transient (see the module)."""
        started, delay = time.monotonic(), FIRST_BACKOFF_S
        while True:
            try:
                return call(*args, **kwargs)
            except (FileNotFoundError, StorageError):
                raise
            except OSError as exc:
                permanent = classify(exc)
                where = f"{self}/{name}" if name else str(self)
                if permanent is not None:
                    reason, fix = permanent
                    raise StorageError(
                        errno_codes.EIO, f"cannot {doing} {where}: {reason} ({cause_of(exc)}); {fix}"
                    ) from None
                waited = time.monotonic() - started
                if waited + delay > (default_retry_s() if self.retry_s is None else self.retry_s):
                    error = StorageUnavailable(errno_codes.EIO, unavailable(str(self), doing, where, waited, exc))
                    error.cause = f"cannot {doing} {where}: {cause_of(exc)}"
                    raise error from None
                time.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF_S)

    @contextlib.contextmanager
    def _local_errors(self, name: str, doing: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise _local_error(exc, self.path / name, doing) from None


_CREDENTIALS = re.compile(r"(://)[^/?#@\s]*:[^@\s]*@")


def without_credentials(text: str) -> str:
    """`text` with every `scheme://KEY:SECRET@` made `scheme://`."""
    return _CREDENTIALS.sub(r"\1", text)


def _read_all(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as handle:
        return handle.readall()


def replace_file(path: Path, data: bytes) -> None:
    """A temporary file in the same directory, flushed and renamed over `path`: readers see the
    old file or the new one. An OSError is a StorageError naming the path."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    except OSError as exc:
        raise _local_error(exc, path, "write") from None


def _local_error(exc: OSError, path: Path, doing: str) -> StorageError:
    return storage_error(exc, getattr(exc, "filename", None) or path, doing)


__all__ = [
    "DEFAULT_RETRY_S",
    "RETRY_ENV",
    "Store",
    "StorageUnavailable",
    "classify",
    "default_retry_s",
    "is_uri",
    "replace_file",
]
