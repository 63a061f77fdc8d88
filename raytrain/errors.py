"""What can go wrong, by who must act: the user (never retried, exit 2) or nobody (retried).

A `UserFault` is deterministic: bad configuration, data, pipeline code, checkpoint or
storage. Running the attempt again repeats it, so raytrain's failure policy stops the run
at once (`raytrain.driver.run.FailFastPolicy`) and the CLI exits 2 with the message. Worker
deaths, lost nodes and collective timeouts are not UserFaults: they keep --max-failures.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

# Paths that are not the user's code: Python's, libraries', raytrain's own.
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "/ray/", "/torch/")
_RAYTRAIN_DIR = str(Path(__file__).resolve().parent) + os.sep


def is_user_file(path: str) -> bool:
    """Not Python's, a library's or raytrain's own: the pipeline or the user's module."""
    if path.startswith("<"):
        return False
    path = os.path.abspath(path)
    return not path.startswith(_RAYTRAIN_DIR) and not any(part in path for part in _LIBRARY_PARTS)


class UserFault(Exception):
    """An error the user must fix; retrying cannot help."""


class DataError(UserFault, ValueError):
    """A dataset that cannot be trained on, naming the dataset, the file or row, and the fix."""


class StorageError(UserFault, OSError):
    """A run file that cannot be written or read: the path, the errno and what to do."""

    def __str__(self) -> str:
        return str(self.strerror if self.strerror is not None else super().__str__())


class PipelineCodeError(UserFault, RuntimeError):
    """The pipeline's own code raised or returned something raytrain cannot use."""


def find_user_fault(error: BaseException | None) -> UserFault | None:
    """The UserFault inside `error`: itself, its cause chain, a Ray task error's cause, or
    the first rank's exception of a Ray Train worker-group error."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        cause = getattr(current, "cause", None)  # ray.exceptions.RayTaskError: the task's own exception
        if isinstance(cause, UserFault):
            return cause
        if isinstance(current, UserFault):
            return current
        stack.append(getattr(current, "_base_exc", None))  # Ray Train's UserExceptionWithTraceback
        stack.append(cause)
        stack.append(current.__cause__)
        failures = getattr(current, "worker_failures", None) or {}
        stack.extend(failures[rank] for rank in sorted(failures, reverse=True))
    return None


@dataclass
class Frame:
    file: str
    line: int
    func: str
    code: str

    @property
    def is_user_code(self) -> bool:
        """Not Python's, a library's or raytrain's own: the pipeline or the user's module."""
        return is_user_file(self.file)

    def describe(self) -> str:
        return f"{self.file}:{self.line}, in {self.func}" + (f": {self.code}" if self.code else "")


@dataclass
class ErrorSummary:
    """A traceback reduced to what a user reads first (plain data: it pickles, so a worker's
    summary reaches the driver, where Ray keeps only the traceback's text)."""

    exception: list[str]  # "KeyError: 'nope'" (a message may span lines)
    frames: list[Frame]  # where it happened: user frames, innermost last

    def lines(self, max_frames: int = 3, max_message_lines: int = 8) -> list[str]:
        head = self.exception[:max_message_lines] or ["(no message)"]
        return head + [f"  at {frame.describe()}" for frame in self.frames[-max_frames:]]

    @classmethod
    def from_exception(cls, exc: BaseException) -> "ErrorSummary":
        """The exception's type and message, and the innermost frames of user code (else the
        innermost of all) — from its cause chain when the error surfaced in a library."""
        chain = [traceback.TracebackException.from_exception(exc)]
        while chain[-1].__cause__ is not None or (chain[-1].__context__ is not None and not chain[-1].__suppress_context__):
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        frames = [_frame(f) for f in chain[0].stack]
        user = [f for f in frames if f.is_user_code]
        for cause in chain[1:]:
            if user:
                break
            user = [frame for frame in map(_frame, cause.stack) if frame.is_user_code]
        message = [line.rstrip() for part in chain[0].format_exception_only() for line in part.splitlines() if line.strip()]
        return cls(exception=message, frames=user or frames[-2:])


def _frame(summary: traceback.FrameSummary) -> Frame:
    return Frame(summary.filename, summary.lineno or 0, summary.name, (summary.line or "").strip())


SUMMARY_ATTRIBUTE = "raytrain_error_summary"


def summarize_on_raise(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, whose exceptions carry their ErrorSummary when they leave it (the worker
    side of a Ray Train run: the driver explains the failure from it)."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                setattr(exc, SUMMARY_ATTRIBUTE, ErrorSummary.from_exception(exc))
            raise

    return run


def attached_summary(error: BaseException) -> ErrorSummary | None:
    """The ErrorSummary a worker attached to `error` (inside Ray Train's wrapper), if any."""
    base = getattr(error, "_base_exc", error)  # Ray Train's UserExceptionWithTraceback
    summary = getattr(base, SUMMARY_ATTRIBUTE, None)
    return summary if isinstance(summary, ErrorSummary) else None


def user_frames(exc: BaseException, limit: int = 3) -> list[str]:
    """`file:line, in function: code` for the innermost frames of user code in `exc`'s traceback."""
    frames = [frame for frame in map(_frame, traceback.extract_tb(exc.__traceback__)) if frame.is_user_code]
    return [frame.describe() for frame in frames[-limit:]]


@contextlib.contextmanager
def pipeline_code(pipeline, method: str) -> Iterator[None]:
    """Run a pipeline method; an exception from it (the user's code) becomes a
    PipelineCodeError naming the method, the error and where in the user's code."""
    try:
        yield
    except UserFault:
        raise
    except Exception as exc:
        where = user_frames(exc)
        message = f"pipeline {pipeline.name}: {method} raised {innermost_error(exc)}".rstrip(": ")
        raise PipelineCodeError(message + "".join(f"\n  at {frame}" for frame in where)) from exc


def innermost_error(exc: BaseException) -> str:
    """`Type: message` of what the user's code actually raised: the deepest cause of an
    exception that is not one of Ray's wrappers, else the last such line of a Ray task's
    traceback text."""
    chain, current = [], exc
    while current is not None and current not in chain:
        chain.append(current)
        current = getattr(current, "cause", None) or current.__cause__
    own = [e for e in chain if not type(e).__module__.startswith("ray.")]
    if own:
        deepest = own[-1]
        lines = [line.strip() for line in str(deepest).splitlines() if line.strip()]
        if len(lines) <= 1:
            return f"{type(deepest).__name__}: {lines[0] if lines else ''}"[:500]
    lines = [line.strip() for e in chain for line in str(e).splitlines() if line.strip()]
    typed = [
        line for line in lines
        if ":" in line and line.split(":", 1)[0].replace(".", "").replace("_", "").isalnum()
        and line.split(":", 1)[0].endswith(("Error", "Exception", "Invalid", "Interrupt", "Exit"))
        and not line.startswith(("ray.", "Ray"))
    ]  # fmt: skip
    if typed:
        return typed[-1][:500]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
