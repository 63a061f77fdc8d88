"""The one owner of a run directory's files (STORAGE/NAME/); its modules: docs/architecture.md,
the run directory row. `RunDir` (here) reads and writes the records of one run directory: rank 0's
writer in the loop (`writer`, imported from there: it needs torch), the driver's summary, the
report, the trackers and tune all go through it.

Every run-file name is spelled in this package and nowhere else. Public: `RunDir` and the
records it reads (`MetricsRow`, `Event`, `Summary`, `Progress`, `Kind`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from raytrain.errors import CheckpointError, StorageError
from raytrain.rundir.faults import storage_error
from raytrain.rundir.files import (
    LOCK_BEAT_S,
    STOP_FILE,
    RunLock,
    RunLocked,
    dumps,
    parse_jsonl,
    read_jsonl,
    strict,
    takeover_line,
    write_json,
    write_yaml,
)
from raytrain.rundir.records import (
    CONFIG,
    EPOCH_LOSS,
    EVENTS,
    LIVE,
    METRICS,
    MODEL,
    PLOTS,
    PROGRESS,
    REPORT,
    SUMMARY,
    Event,
    Kind,
    MetricsRow,
    Progress,
    StoredRun,
    Summary,
)
from raytrain.rundir.storage import StorageUnavailable, Store
from raytrain.rundir.tail import Tail


class RunDir:
    """The records of one run directory, on a file system or an object store
    (`raytrain.rundir.storage`). Reads never fail on a missing or torn file (they return what
    is there); writes raise StorageError naming the path and the fix."""

    def __init__(self, path: "str | os.PathLike | Store"):
        self.store = Store.of(path)

    @property
    def path(self) -> Path:
        """The directory (a run on a file system; see `store` for one on an object store)."""
        return self.store.path

    def __repr__(self) -> str:
        return f"RunDir({str(self.store)!r})"

    def exists(self) -> bool:
        """Whether this looks like a run directory (it has a config, metrics or a summary)."""
        return any(self.store.exists(name) for name in (METRICS, CONFIG, SUMMARY))

    def has(self, name: str) -> bool:
        """Whether the run file `name` (model.pt, report.md, …) is there."""
        return self.store.exists(name)

    # -- reading -----------------------------------------------------------------------------

    def metrics(self) -> list[MetricsRow]:
        return [MetricsRow.from_json(row) for row in self._jsonl(METRICS) if _has(row, "epoch", "step")]

    def epoch_rows(self) -> list[MetricsRow]:
        return [row for row in self.metrics() if row.epoch_end]

    def events(self, since: float | None = None) -> list[Event]:
        """The events, or only those written at or after `since` (a time.time())."""
        events = [Event.from_json(e) for e in self._jsonl(EVENTS) if _has(e, "kind", "message")]
        return [e for e in events if since is None or (e.time or 0) >= since]

    def summary(self) -> Summary | None:
        values = self._json(SUMMARY)
        return Summary.from_json(values) if "status" in values else None

    def progress(self) -> Progress | None:
        values = self._json(PROGRESS)
        return Progress.from_json(values) if values else None

    def finished(self, budget: Any) -> bool:
        """Whether the run trained all of its budget (a `raytrain.rules.budget.Budget`: epochs,
        steps; progress.json says so; a resume that trains on to more has not)."""
        progress = self.progress()
        return progress is not None and progress.status == "finished" and budget.done(progress.epoch, progress.step)

    def config(self) -> dict[str, Any]:
        try:
            value = yaml.safe_load(self.store.read_text(CONFIG))
        except (OSError, yaml.YAMLError):
            return {}
        return value if isinstance(value, dict) else {}

    def has_run(self) -> bool:
        """Whether a run was started here (its config, or a checkpoint, is written)."""
        from raytrain.rundir.checkpoints import checkpoint_dirs

        return self.store.exists(CONFIG) or bool(checkpoint_dirs(self.store))

    def stored_run(self) -> StoredRun:
        """The run's config.yaml and its furthest checkpoint whose files open (the workers skip
        an unreadable one as well), for a resume (CheckpointError when config.yaml is there but
        unreadable)."""
        from raytrain.rundir import checkpoints

        where = f"{self.store}/{CONFIG}"
        try:
            config = yaml.safe_load(self.store.read_text(CONFIG)) or {}
        except FileNotFoundError:
            config = {}
        except (OSError, yaml.YAMLError) as exc:
            first = str(exc).splitlines()[0]
            raise CheckpointError(f"{where} cannot be read ({first}); the run cannot be resumed as it was") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{where} is not a mapping of options; the run cannot be resumed as it was")
        pipeline = config.pop("pipeline", None)
        config.pop("gpu", None)
        latest, passed_over = checkpoints.latest_readable(self.store)
        position = checkpoints.stored_position(latest) if latest is not None else {}
        return StoredRun(self.store, config, pipeline, latest, position, passed_over)

    def tail(self, name: str) -> Tail:
        """A follower of the JSONL file `name` (rows appended since the last read)."""
        return Tail(self.store, name)

    def _jsonl(self, name: str) -> list[dict[str, Any]]:
        try:
            return parse_jsonl(self.store.read_text(name))
        except FileNotFoundError:
            return []

    def _json(self, name: str) -> dict[str, Any]:
        try:
            value = json.loads(self.store.read_text(name))
        except StorageError:  # an object store's error (retried, or permanent): not a missing file
            raise
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    # -- writing (rank 0 and the driver) -----------------------------------------------------

    def append_metrics(self, row: MetricsRow) -> None:
        self.store.append_text(METRICS, dumps(row.to_json()) + "\n")

    def append_event(self, event: Event) -> None:
        self.store.append_text(EVENTS, dumps(event.to_json()) + "\n")

    def write_progress(self, progress: Progress) -> None:
        self.store.write_text(PROGRESS, dumps(progress.to_json(), indent=2) + "\n")

    def write_summary(self, summary: Summary) -> None:
        self.store.write_text(SUMMARY, dumps(summary.to_json(), indent=2) + "\n")

    def write_config(self, values: dict[str, Any]) -> None:
        self.store.write_text(CONFIG, yaml.safe_dump(values, sort_keys=False))

    def update_summary(self, **changes: Any) -> Summary | None:
        """Change fields of an existing summary.json (None, and nothing written, if there is none)."""
        summary = self.summary()
        if summary is None:
            return None
        names = {f for f in Summary.__dataclass_fields__ if f != "extra"}
        for key, value in changes.items():
            if key in names:
                setattr(summary, key, value)
            else:
                summary.extra[key] = value
        self.write_summary(summary)
        return summary

    def last_record(self) -> tuple[int, float] | None:
        """(step, time) of the furthest training recorded: the last metrics row or live row,
        whichever came later (read before a restart drops the rows it will redo)."""
        found = [
            (int(row["step"]), float(row[key]))
            for name, key in ((METRICS, "time_s"), (LIVE, "time"))
            for row in self._jsonl(name)[-1:]
            if isinstance(row.get("step"), int) and isinstance(row.get(key), (int, float))
        ]
        return max(found, key=lambda record: record[1]) if found else None

    def truncate_metrics(self, last_step: int) -> None:
        """Keep the rows up to `last_step`: those after a checkpoint describe training that a
        restart is about to redo."""
        if self.store.exists(METRICS):
            kept = [row for row in self._jsonl(METRICS) if row.get("step", 0) <= last_step]
            self.store.write_text(METRICS, "".join(dumps(row) + "\n" for row in kept))

    # -- the stop request (the driver asks, rank 0 looks) ---------------------------------------

    def request_stop(self) -> None:
        self.store.write_text(STOP_FILE, str(time.time()))

    def stop_requested(self) -> bool:
        return self.store.exists(STOP_FILE)

    def clear_stop(self) -> None:
        with contextlib.suppress(OSError):
            self.store.delete(STOP_FILE)


@contextlib.contextmanager
def claimed(
    run_dir: "str | os.PathLike | Store", owner: str = "", echo: Callable[[str], None] | None = None
) -> Iterator[Store]:
    """The run directory, held for one run: checked writable before anything starts (a path
    that cannot hold the run is a StorageError; on an object store: the credentials, the
    bucket and a write, read and delete round trip), locked against a second run of the same
    name, and left clean after (no staging area, no node-local files of an object store's run,
    no stop request; no empty directory when the run was refused before it began). `owner`: the
    driver's id, in the lock for its workers to compare (`files.DriverWatch`), and the lock kept
    fresh; `echo` hears that the run was taken over from an ended driver, whose workers are fenced,
    and that the lock's beat has failed for a while."""
    from raytrain.rundir.checkpoints import staging_dir

    store = Store.of(run_dir)
    created = store.check()
    lock = RunLock(store, owner=owner, beat_s=LOCK_BEAT_S if owner else None, echo=echo)
    lock.acquire()
    if lock.taken_over is not None and echo is not None:
        echo(takeover_line(store, lock.taken_over))
    try:
        yield store
    finally:
        lock.release()
        shutil.rmtree(staging_dir(store), ignore_errors=True)
        store.release_local_dir()
        RunDir(store).clear_stop()
        if created:  # refused before the run began: leave no empty run directory behind
            with contextlib.suppress(OSError):
                store.path.rmdir()


def _has(values: dict[str, Any], *keys: str) -> bool:
    return all(key in values for key in keys)


__all__ = [
    "CONFIG",
    "EPOCH_LOSS",
    "EVENTS",
    "LIVE",
    "METRICS",
    "MODEL",
    "PLOTS",
    "PROGRESS",
    "REPORT",
    "SUMMARY",
    "Event",
    "Kind",
    "MetricsRow",
    "Progress",
    "RunDir",
    "RunLock",
    "RunLocked",
    "claimed",
    "StoredRun",
    "Store",
    "StorageUnavailable",
    "Summary",
    "Tail",
    "dumps",
    "read_jsonl",
    "storage_error",
    "strict",
    "write_json",
    "write_yaml",
]
