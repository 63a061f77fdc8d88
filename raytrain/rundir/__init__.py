"""The one owner of a run directory's files (STORAGE/NAME/).

- `files`: atomic writes, strict JSON, JSONL appends, the run lock, storage errors;
- `records`: the typed records (`MetricsRow`, `Event`, `Summary`, `Progress`) and file names;
- `tail`: following a JSONL file while it grows;
- `writer`: `RunWriter`, rank 0's writer during training (imported from there: it needs torch);
- `checkpoints`: the checkpoint directories of a run, written and read back safely;
- `export`: a run's or a checkpoint's weights as a plain state_dict (`raytrain export`);
- `RunDir` (here): read and write the records of one run directory. Rank 0's writer in the
  loop, the driver's summary, the report, the trackers and tune all go through it.

Every run-file name is spelled in this package and nowhere else. Public: `RunDir` and the
records it reads (`MetricsRow`, `Event`, `Summary`, `Progress`, `Kind`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import yaml

from raytrain.errors import CheckpointError
from raytrain.rundir.files import (
    LOCK_FILE,
    STOP_FILE,
    RunLock,
    RunLocked,
    append_jsonl,
    check_storage,
    dumps,
    read_json,
    read_jsonl,
    storage_error,
    storage_errors,
    strict,
    write_atomic,
    write_json,
    write_yaml,
)
from raytrain.rundir.records import (
    CONFIG,
    EPOCH_LOSS,
    EVENTS,
    HEARTBEATS,
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
from raytrain.rundir.tail import Tail


class RunDir:
    """The records of one run directory. Reads never fail on a missing or torn file (they
    return what is there); writes raise StorageError naming the path and the fix."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def exists(self) -> bool:
        """Whether this looks like a run directory (it has a config, metrics or a summary)."""
        return any((self.path / name).exists() for name in (METRICS, CONFIG, SUMMARY))

    # -- reading -----------------------------------------------------------------------------

    def metrics(self) -> list[MetricsRow]:
        return [MetricsRow.from_json(row) for row in read_jsonl(self.path / METRICS) if _has(row, "epoch", "step")]

    def epoch_rows(self) -> list[MetricsRow]:
        return [row for row in self.metrics() if row.epoch_end]

    def events(self, since: float | None = None) -> list[Event]:
        """The events, or only those written at or after `since` (a time.time())."""
        events = [Event.from_json(e) for e in read_jsonl(self.path / EVENTS) if _has(e, "kind", "message")]
        return [e for e in events if since is None or (e.time or 0) >= since]

    def summary(self) -> Summary | None:
        values = read_json(self.path / SUMMARY)
        return Summary.from_json(values) if "status" in values else None

    def progress(self) -> Progress | None:
        values = read_json(self.path / PROGRESS)
        return Progress.from_json(values) if values else None

    def finished(self, budget: Any) -> bool:
        """Whether the run trained all of its budget (a `raytrain.rules.budget.Budget`: epochs,
        steps; progress.json says so; a resume that trains on to more has not)."""
        progress = self.progress()
        return progress is not None and progress.status == "finished" and budget.done(progress.epoch, progress.step)

    def config(self) -> dict[str, Any]:
        try:
            value = yaml.safe_load((self.path / CONFIG).read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return value if isinstance(value, dict) else {}

    def has_run(self) -> bool:
        """Whether a run was started here (its config, or a checkpoint, is written)."""
        from raytrain.rundir.checkpoints import checkpoint_dirs

        return (self.path / CONFIG).exists() or bool(checkpoint_dirs(self.path))

    def stored_run(self) -> StoredRun:
        """The run's config.yaml and its furthest complete checkpoint, for a resume
        (CheckpointError when config.yaml is there but unreadable)."""
        from raytrain.rundir import checkpoints

        path = self.path / CONFIG
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            config = {}
        except (OSError, yaml.YAMLError) as exc:
            first = str(exc).splitlines()[0]
            raise CheckpointError(f"{path} cannot be read ({first}); the run cannot be resumed as it was") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{path} is not a mapping of options; the run cannot be resumed as it was")
        pipeline = config.pop("pipeline", None)
        config.pop("gpu", None)
        latest = checkpoints.latest_complete(self.path)
        position = {}
        if latest is not None:
            try:
                position = json.loads((latest / checkpoints.POSITION_FILE).read_text())
            except (OSError, ValueError):
                position = {}
        return StoredRun(self.path, config, pipeline, latest, position)

    # -- writing (rank 0 and the driver) -----------------------------------------------------

    def append_metrics(self, row: MetricsRow) -> None:
        append_jsonl(self.path / METRICS, row.to_json())

    def append_event(self, event: Event) -> None:
        append_jsonl(self.path / EVENTS, event.to_json())

    def append_live(self, values: dict[str, Any]) -> None:
        append_jsonl(self.path / LIVE, values)

    def write_progress(self, progress: Progress) -> None:
        write_json(self.path / PROGRESS, progress.to_json())

    def write_summary(self, summary: Summary) -> None:
        write_json(self.path / SUMMARY, summary.to_json())

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

    def truncate_metrics(self, last_step: int) -> None:
        """Keep the rows up to `last_step`: those after a checkpoint describe training that a
        restart is about to redo."""
        path = self.path / METRICS
        if path.exists():
            kept = [row for row in read_jsonl(path) if row.get("step", 0) <= last_step]
            write_atomic(path, "".join(dumps(row) + "\n" for row in kept))


@contextlib.contextmanager
def claimed(run_dir: str | os.PathLike, storage: str | os.PathLike) -> Iterator[Path]:
    """The run directory, held for one run: checked writable before anything starts (a path
    that cannot hold the run is a StorageError), locked against a second run of the same
    name, and left clean after (no staging area, no stop request; no empty directory when
    the run was refused before it began)."""
    from raytrain.rundir.checkpoints import staging_dir

    run_dir = Path(run_dir)
    created = not run_dir.exists()
    check_storage(storage, run_dir)
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        yield run_dir
    finally:
        lock.release()
        shutil.rmtree(staging_dir(run_dir), ignore_errors=True)
        with contextlib.suppress(OSError):
            (run_dir / STOP_FILE).unlink()
        if created:  # refused before the run began: leave no empty run directory behind
            with contextlib.suppress(OSError):
                run_dir.rmdir()


def _has(values: dict[str, Any], *keys: str) -> bool:
    return all(key in values for key in keys)


__all__ = [
    "CONFIG",
    "EPOCH_LOSS",
    "EVENTS",
    "HEARTBEATS",
    "LIVE",
    "LOCK_FILE",
    "METRICS",
    "MODEL",
    "PLOTS",
    "PROGRESS",
    "REPORT",
    "STOP_FILE",
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
    "Summary",
    "Tail",
    "append_jsonl",
    "check_storage",
    "dumps",
    "read_json",
    "read_jsonl",
    "storage_error",
    "storage_errors",
    "strict",
    "write_atomic",
    "write_json",
    "write_yaml",
]
