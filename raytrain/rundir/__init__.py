"""The one owner of a run directory's files (STORAGE/NAME/).

- `files`: atomic writes, strict JSON, JSONL appends, the run lock, storage errors;
- `records`: the typed records (`MetricsRow`, `Event`, `Summary`, `Progress`) and file names;
- `tail`: following a JSONL file while it grows;
- `writer`: `RunWriter`, rank 0's writer during training (imported from there: it needs torch);
- `RunDir` (here): read and write the records of one run directory. Rank 0's writer in the
  loop, the driver's summary, the report, the trackers and tune all go through it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

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
from raytrain.rundir.records import CONFIG, EVENTS, LIVE, METRICS, PROGRESS, SUMMARY, Event, Kind, MetricsRow, Progress, Summary
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

    def config(self) -> dict[str, Any]:
        try:
            value = yaml.safe_load((self.path / CONFIG).read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return value if isinstance(value, dict) else {}

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


def _has(values: dict[str, Any], *keys: str) -> bool:
    return all(key in values for key in keys)


__all__ = [
    "CONFIG", "EVENTS", "LIVE", "LOCK_FILE", "METRICS", "PROGRESS", "STOP_FILE", "SUMMARY",
    "Event", "Kind", "MetricsRow", "Progress", "RunDir", "RunLock", "RunLocked", "Summary", "Tail",
    "append_jsonl", "check_storage", "dumps", "read_json", "read_jsonl", "storage_error", "storage_errors",
    "strict", "write_atomic", "write_json", "write_yaml",
]  # fmt: skip
