"""Rank 0's JSONL files on an object store, written in the background.

A store has no append: a JSONL file grows by being rewritten whole. Rank 0 cannot do that
in the loop at every row, so `BufferedLogs` keeps the new lines and a background thread
writes each changed file back (read what is there — another writer, a replica leaving, may
have added a line — add the new lines, write the whole object) at most every `interval_s`,
and less often as a file grows: a rewrite never takes more than a twentieth of the time.
`live.jsonl` keeps only its last row. The driver follows the files with ranged reads
(`raytrain.rundir.tail`), so readers see one stream.

An error the store's retries could not ride out is kept and raised by the next call on the
loop's thread (the run stops once, resumable from its last complete checkpoint). Rows of an
attempt whose driver is gone are dropped (`discard`): a resume may be writing the same objects.
"""

from __future__ import annotations

import contextlib
import threading
import time

from raytrain.rundir.storage import Store

FLUSH_INTERVAL_S = 2.0
# A rewrite may take at most this share of the time between rewrites.
MAX_BUSY_SHARE = 0.05


class BufferedLogs:
    def __init__(self, store: Store, keep_last: tuple[str, ...] = (), interval_s: float = FLUSH_INTERVAL_S):
        self.store, self.keep_last, self.interval_s = store, set(keep_last), interval_s
        self.pending: dict[str, list[str]] = {}
        self.lock = threading.Lock()  # guards `pending`
        self.writing = threading.Lock()  # one rewrite at a time
        self.failed: BaseException | None = None
        self.discarded = False
        self.wait_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def append(self, name: str, line: str) -> None:
        """Queue `line` (with its newline) for `name`; raises a failure of an earlier write."""
        self._raise_if_failed()
        with self.lock:
            if self.discarded:
                return
            lines = self.pending.setdefault(name, [])
            if name in self.keep_last:
                lines.clear()
            lines.append(line)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="raytrain-logs", daemon=True)
            self._thread.start()

    def flush(self) -> None:
        """Write every queued line now (in this thread); raises what failed."""
        self._write()
        self._raise_if_failed()

    def close(self) -> None:
        """Flush and stop the background thread (errors are kept, not raised)."""
        self._stop.set()
        with contextlib.suppress(BaseException):  # already kept in self.failed
            self._write()

    def discard(self) -> None:
        """Drop every queued line and rewrite nothing more: the run is another driver's now, and a
        rewrite would wipe the rows it wrote since (a rewrite already under way still lands)."""
        self._stop.set()
        with self.lock:
            self.discarded, self.pending = True, {}

    def _run(self) -> None:
        while not self._stop.wait(self.wait_s):
            try:
                self._write()
            except BaseException:  # kept in self.failed, raised on the loop's thread
                return

    def _write(self) -> None:
        with self.writing:
            with self.lock:
                batch, self.pending = self.pending, {}
            started = time.monotonic()
            try:
                for name, lines in batch.items():
                    if name in self.keep_last:
                        self.store.write_text(name, lines[-1])
                    else:
                        self.store.append_text(name, "".join(lines))
            except BaseException as exc:
                self.failed = self.failed or exc
                raise
            if batch:
                self.wait_s = max(self.interval_s, (time.monotonic() - started) / MAX_BUSY_SHARE)

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise self.failed
