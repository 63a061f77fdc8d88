"""A checkpoint being written in the background, and how its writer waits for it (`Save`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain.rundir import formats


@dataclass
class Save:
    """A checkpoint being written: DCP's future (distributed saves) or a writer thread, and
    what failed. `wait` returns once every file of this rank is written, or raises."""

    directory: Path
    future: Any = None
    thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)

    def done(self) -> bool:
        if self.future is not None and not self.future.done():
            return False
        return self.thread is None or not self.thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        """Every file of this rank written; a write that failed raises its own error (an
        OSError with its errno for the file system's), not DCP's wrapper around every rank's.
        With `timeout_s`, TimeoutError past it."""
        try:
            if self.future is not None:
                self.future.result(timeout=timeout_s)
            if self.thread is not None:
                self.thread.join(timeout_s)
                if self.thread.is_alive():
                    raise TimeoutError(f"checkpoint {self.directory.name} still being written after {timeout_s} s")
            if self.errors:
                raise self.errors[0]
        except formats.dcp_errors() as exc:
            inner = _inner(exc)
            if isinstance(inner, Exception):
                raise inner from None
            raise RuntimeError(formats.dcp_failure(exc)) from None


def _inner(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException (else `exc`)."""
    failures = getattr(exc, "failures", None)
    return failures[min(failures)][0] if failures else exc
