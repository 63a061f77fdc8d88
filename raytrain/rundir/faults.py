"""What an object store's errors mean, and the check before a run.

Each error from pyarrow (or boto3) is either permanent — no credentials, a missing bucket,
access denied: `classify` gives the reason and the fix, and no retry is made — or transient —
a timeout, a refused connection, a 5xx, throttling: retried by `Store` with backoff, and after
`retry_s` a `StorageUnavailable` (`retried`). Before Ray starts, `check_store` tries the
credentials, the bucket, and a write, read and delete round trip, and `check_local` that a local
run directory can be created and written, with one message for what is wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno as errno_codes
import os
import re
import time
import urllib.parse
from typing import Any, Callable, Iterator, TypeVar

from raytrain.errors import StorageError

T = TypeVar("T")

# How long a run rides out an object-store outage before it stops (seconds of retries per call);
# RAYTRAIN_STORAGE_RETRY_S, in the environment of the driver (which passes it to the workers), wins.
DEFAULT_RETRY_S = 120.0
RETRY_ENV = "RAYTRAIN_STORAGE_RETRY_S"
# Backoff between retries of one call: doubling from the first, capped.
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 15.0


def default_retry_s() -> float:
    try:
        return float(os.environ.get(RETRY_ENV, DEFAULT_RETRY_S))
    except ValueError:
        return DEFAULT_RETRY_S


def retry_window_s(store: Any) -> float:
    """How long `store`'s calls ride out an outage (its own `retry_s`, else `default_retry_s`)."""
    return default_retry_s() if store.retry_s is None else store.retry_s


# What to do about a local file system's refusal, by errno.
_FIXES = {
    errno_codes.ENOSPC: "the file system is full: free space there or use another one (--storage)",
    errno_codes.EDQUOT: "the disk quota is exceeded: free space or use another file system (--storage)",
    errno_codes.EROFS: "that file system is read-only: use a writable directory (--storage)",
    errno_codes.EACCES: "no permission to write there: fix its permissions or use another directory",
    errno_codes.EPERM: "no permission to write there: fix its permissions or use another directory",
    errno_codes.ENAMETOOLONG: "the path is too long: choose a shorter name (--name, --storage)",
    errno_codes.ENOTDIR: "part of the path is a file, not a directory",
    errno_codes.EISDIR: "a directory is in the way of a file",
    errno_codes.ENOENT: "a directory on that path is missing and cannot be created there (a mount that went away?)",
}


def storage_error(exc: OSError, path: str | os.PathLike, doing: str) -> StorageError:
    """One message for an OSError: what, where, the errno and the fix."""
    code = exc.errno or 0
    name = errno_codes.errorcode.get(code, str(code))
    fix = _FIXES.get(code, "check the path and its file system")
    return StorageError(code, f"cannot {doing} {path}: {exc.strerror or exc} ({name}); {fix}")


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike, doing: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error(exc, getattr(exc, "filename", None) or path, doing) from None


@contextlib.contextmanager
def local_errors(store: Any, name: str, doing: str) -> Iterator[None]:
    """An OSError on the local file `name` of `store` as one StorageError naming it."""
    try:
        yield
    except OSError as exc:
        raise storage_error(exc, getattr(exc, "filename", None) or store.path / name, doing) from None


def retried(store: Any, doing: str, name: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call`, retried with backoff while the store's errors are transient; a permanent one raises a
    StorageError at once, and an outage longer than the store's `retry_s` a StorageUnavailable."""
    started, delay = time.monotonic(), FIRST_BACKOFF_S
    while True:
        try:
            return call(*args, **kwargs)
        except (FileNotFoundError, StorageError):
            raise
        except OSError as exc:
            permanent = classify(exc)
            where = f"{store}/{name}" if name else str(store)
            if permanent is not None:
                reason, fix = permanent
                raise StorageError(
                    errno_codes.EIO, f"cannot {doing} {where}: {reason} ({cause_of(exc)}); {fix}"
                ) from None
            waited = time.monotonic() - started
            if waited + delay > retry_window_s(store):
                error = StorageUnavailable(errno_codes.EIO, unavailable(str(store), doing, where, waited, exc))
                error.cause = f"cannot {doing} {where}: {cause_of(exc)}"
                raise error from None
            time.sleep(delay)
            delay = min(2 * delay, MAX_BACKOFF_S)


# pyarrow's texts for errors that retrying cannot fix, with what the user does about each.
_PERMANENT = (
    ("NO_SUCH_BUCKET", "the bucket does not exist", "create it, or fix the bucket name in --storage"),
    (
        "INVALID_ACCESS_KEY_ID",
        "the store does not know the access key id",
        "check AWS_ACCESS_KEY_ID (or the profile or role in use)",
    ),
    (
        "SIGNATURE_DOES_NOT_MATCH",
        "the secret key does not match the access key",
        "check AWS_SECRET_ACCESS_KEY (or the profile in use)",
    ),
    (
        "ACCESS_DENIED",
        "access denied",
        "the credentials need list, read, write and delete permission on that bucket and prefix",
    ),
    ("NO_SUCH_KEY", "an object is missing", "the run directory was changed by something else"),
    (
        "OAuth2 access token",
        "no usable Google Cloud credentials",
        "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
    ),
    ("PERMISSION_DENIED", "access denied", "the credentials need read, write, list and delete permission there"),
    ("Unexpected query parameter", "the URI has an option pyarrow does not take", "fix the URI's ?query"),
)
# ... and for errors worth retrying (a store that is down, slow or overloaded).
_TRANSIENT = (
    "NETWORK_CONNECTION",
    "curlCode",
    "SLOW_DOWN",
    "SERVICE_UNAVAILABLE",
    "INTERNAL_FAILURE",
    "HTTP status 5",
    "UNAVAILABLE",
    "Timeout",
    "timed out",
    "REQUEST_TIMEOUT",
    "THROTTL",
    "Connection reset",
)


class StorageUnavailable(StorageError):
    """The object store did not answer for longer than the retries allow: the run stops once,
    resumable from its last complete checkpoint when the store is back. `cause`: the last
    error, in short."""

    cause = ""


def check_local(store: Any) -> bool:
    """Before anything starts: the run directory `store` can be created and written (a StorageError
    naming the fix if not); True when it was created here."""
    storage, run_dir = store.parent.path, store.path
    if storage.exists() and not storage.is_dir():
        raise StorageError(
            errno_codes.ENOTDIR, f"--storage {storage} is a file, not a directory; point --storage at a directory"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise StorageError(
            errno_codes.ENOTDIR, f"run directory {run_dir} is a file, not a directory; choose another --name"
        )
    created = not run_dir.exists()
    with storage_errors(run_dir, "create the run directory"):
        run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".write-test-{os.getpid()}"
    with storage_errors(run_dir, "write in the run directory"):
        probe.write_bytes(b"raytrain")
        probe.unlink()
    return created


def check_store(store: Any) -> bool:
    """Before anything starts: credentials, the bucket, and a write, read and delete round
    trip under this location; one StorageError naming what is wrong and the fix (an
    unreachable endpoint is not retried here). False: an object store has no directory to create."""
    quick = dataclasses.replace(store, retry_s=0.0)
    _check_credentials(quick)
    probe = f".raytrain-check-{os.getpid()}-{time.time_ns()}"
    payload = os.urandom(32)
    try:
        try:
            quick.list()
        except FileNotFoundError:
            pass
        quick.write_bytes(probe, payload)
        echoed = quick.read_bytes(probe)
        quick.delete(probe)
    except StorageUnavailable as exc:
        raise StorageError(
            errno_codes.EHOSTUNREACH,
            f"cannot reach the store of --storage {store} ({exc.cause}); check the endpoint (AWS_ENDPOINT_URL, or "
            "?endpoint_override=HOST:PORT&scheme=http in the URI), the network, and that the store is up",
        ) from None
    if echoed != payload:
        raise StorageError(
            errno_codes.EIO,
            f"--storage {store}: an object written there reads back different ({len(echoed)} bytes for 32): the "
            "requests were not signed (no credentials?); give credentials (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, a profile, or a role)",
        )
    return False


def _check_credentials(store: Any) -> None:
    """S3: some credentials must be found (boto3 looks where pyarrow does: the variables, the
    shared files, a profile, the machine's role); without any, pyarrow sends unsigned requests."""
    if store.scheme != "s3" or "@" in urllib.parse.urlsplit(store.uri).netloc or "anonymous" in store.uri:
        return
    try:
        import boto3
    except ImportError:  # pragma: no cover - a dependency; the round trip still finds out
        return
    if boto3.Session().get_credentials() is None:
        raise StorageError(
            errno_codes.EACCES,
            f"--storage {store}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, choose a "
            "profile with AWS_PROFILE, or run where the machine has a role",
        )


def classify(exc: BaseException) -> tuple[str, str] | None:
    """(reason, fix) for an error no retry can fix; None for a transient one (or an unknown
    one, treated as transient: a store under load says odd things)."""
    text = str(exc)
    for token, reason, fix in _PERMANENT:
        if token in text:
            return reason, fix
    if any(token in text for token in _TRANSIENT):
        return None
    return "the store refused the request", "check the URI, the credentials and the bucket"


def unavailable(store: str, doing: str, where: str, waited_s: float, exc: BaseException) -> str:
    return (
        f"the store {store} did not answer for {waited_s:.0f} s (cannot {doing} {where}: {cause_of(exc)}); "
        "the run stops here and resumes from its last complete checkpoint with --resume once the store is back "
        "(check the endpoint, the network and the store)"
    )


def cause_of(exc: BaseException) -> str:
    """The error's first line without pyarrow's error-code prefix (Ray Train retries an upload
    whose error names one of those codes, which would triple the wait)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = without_credentials(text)  # never a secret in a message
    text = re.sub(r"AWS Error [A-Z_]+ (\(HTTP status \d+\) )?during (\w+) operation: ?", r"\2: ", text)
    text = text.replace("NETWORK_CONNECTION", "network").replace("SERVICE_UNAVAILABLE", "unavailable")
    return re.sub(r"\s+", " ", text).strip()[:300]


_CREDENTIALS = re.compile(r"(://)[^/?#@\s]*:[^@\s]*@")


def without_credentials(text: str) -> str:
    """`text` with every `scheme://KEY:SECRET@` made `scheme://`."""
    return _CREDENTIALS.sub(r"\1", text)


def boto_token(code: str) -> str:
    return {
        "NoSuchBucket": "NO_SUCH_BUCKET",
        "AccessDenied": "ACCESS_DENIED",
        "InvalidAccessKeyId": "INVALID_ACCESS_KEY_ID",
        "SignatureDoesNotMatch": "SIGNATURE_DOES_NOT_MATCH",
        "SlowDown": "SLOW_DOWN",
        "ServiceUnavailable": "SERVICE_UNAVAILABLE",
        "InternalError": "INTERNAL_FAILURE",
    }.get(code, code or "UNKNOWN")


__all__ = [
    "StorageUnavailable",
    "storage_error",
    "storage_errors",
    "check_local",
    "check_store",
    "local_errors",
    "retried",
    "retry_window_s",
    "without_credentials",
    "classify",
    "cause_of",
    "unavailable",
]
