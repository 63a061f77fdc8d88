"""`--resume`: continue the run that was, with only the changes it can honour.

A resumed run starts from its own resolved `config.yaml`; options given with `--resume`
override only what they name (`raytrain.cli` merges them). Before anything is written, the
driver checks here what the new options would change:

- refused (exit 2): another pipeline; while an epoch is half done, another `seed`,
  `shuffle_window_rows` or `data_partitions` — each changes that epoch's order, so the rest
  of it would skip some samples and repeat others (at an epoch boundary they are allowed);
- allowed and said in the restart line: everything else (epochs, batch knobs — the plan is
  derived again —, learning rate and schedule, workers, precision, cadences, trackers).

The latest *complete* checkpoint is found from the run directory itself (`checkpoint.py`),
so a resume never depends on what Ray's snapshot managed to record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrain.rundir import checkpoints as ckpt
ORDER_FIELDS = ("seed", "shuffle_window_rows", "data_partitions")
# Fields whose change the checkpoint's optimizer state cannot follow.
STATE_FIELDS = ("optimizer", "decay_norm_and_bias")
# Fields that are about this invocation, not the run: never reported as changes.
INVOCATION_FIELDS = ("resume", "address", "verbose", "progress", "progress_interval_s", "name", "storage")


@dataclass
class StoredRun:
    """What a run directory says about the run: its resolved config and where it got to."""

    run_dir: Path
    config: dict[str, Any]
    pipeline: str | None
    checkpoint: Path | None
    position: dict[str, Any]

    @property
    def mid_epoch(self) -> bool:
        return bool(self.position.get("epoch_offset"))


def read_stored_run(run_dir: str | Path) -> StoredRun:
    """The run's config.yaml and its furthest complete checkpoint (CheckpointError if unreadable)."""
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        config = {}
    except (OSError, yaml.YAMLError) as exc:
        raise ckpt.CheckpointError(f"{path} cannot be read ({str(exc).splitlines()[0]}); the run cannot be resumed as it was") from None
    if not isinstance(config, dict):
        raise ckpt.CheckpointError(f"{path} is not a mapping of options; the run cannot be resumed as it was")
    pipeline = config.pop("pipeline", None)
    config.pop("gpu", None)
    latest = ckpt.latest_complete(run_dir)
    position = {}
    if latest is not None:
        try:
            position = json.loads((latest / ckpt.POSITION_FILE).read_text())
        except (OSError, ValueError):
            position = {}
    return StoredRun(run_dir, config, pipeline, latest, position)


def changes(stored: StoredRun, new_config: dict[str, Any], new_pipeline: str) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, str]]]:
    """(what the resume changes: (field, before, now)), (what it cannot honour: (field, why))."""
    refused: list[tuple[str, str]] = []
    if stored.pipeline and new_pipeline != stored.pipeline:
        refused.append(("pipeline", f"the run {stored.run_dir.name!r} trains {stored.pipeline!r}, not {new_pipeline!r}; resume it with "
                        f"{stored.pipeline!r} (or leave the pipeline out), or start a new run with another --name"))  # fmt: skip
    changed = []
    for name in sorted(set(stored.config) | set(new_config)):
        if name in INVOCATION_FIELDS:
            continue
        before, now = stored.config.get(name), new_config.get(name)
        if before == now:
            continue
        if name in STATE_FIELDS and stored.checkpoint is not None:
            refused.append((name, (
                f"got {now!r}, but the run's checkpoint holds the state of its optimizer with {before!r}; resume with {before!r}, "
                "or start a new run with another --name"
            )))  # fmt: skip
            continue
        if name in ORDER_FIELDS and stored.mid_epoch:
            epoch = int(stored.position.get("epoch", 0)) + 1
            refused.append((name, (
                f"got {now!r}, but the run is {stored.position.get('epoch_offset'):,} samples into epoch {epoch} with {before!r}; "
                f"another value changes that epoch's order, so the rest of it would skip and repeat samples. Resume without it, "
                "or change it at an epoch boundary"
            )))  # fmt: skip
            continue
        changed.append((name, before, now))
    return changed, refused


def describe_changes(changed: list[tuple[str, Any, Any]]) -> str:
    from raytrain.config import flag_name

    if not changed:
        return "no options changed"
    return "changed: " + ", ".join(f"{flag_name(name)} {_short(before)} → {_short(now)}" for name, before, now in changed)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
