"""Rank 0's writer of a run directory during training: events, metrics, live rows, progress
and the final model.

Every rank holds one; only rank 0's writes (`enabled`), so the other ranks call the same
lines at no cost. It knows records, not the loop: the loop hands it an `Event`, a
`MetricsRow`, a `Progress`, the final weights.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from raytrain.rundir import RunDir, formats
from raytrain.rundir import checkpoints as ckpt
from raytrain.rundir.buffered import BufferedLogs
from raytrain.rundir.faults import storage_errors
from raytrain.rundir.files import DriverWatch, dumps
from raytrain.rundir.records import EPOCH_LOSS, EVENTS, LIVE, METRICS, MODEL, Event, Kind, MetricsRow, Progress
from raytrain.rundir.storage import Store

LIVE_INTERVAL_S = 1.0  # rank 0 writes live.jsonl at most this often


class RunWriter:
    """The run directory's files written from the workers: by rank 0 only, strict JSON,
    and any OSError as one StorageError naming the path and errno (not retried). On an
    object store the JSONL rows are written in the background (`raytrain.rundir.buffered`)
    and the stop request is looked for at most every `Store.poll_s`. `driver`: the id of the
    driver that started the attempt, which must still hold the run (`driver`, a DriverWatch)."""

    def __init__(self, run_dir: "str | os.PathLike | Store", enabled: bool, driver: str = ""):
        self.store = Store.of(run_dir)
        self.rundir = RunDir(self.store)
        self.enabled = enabled
        self.last_live = 0.0
        self.live_mark: tuple[float, int] | None = None  # (time, samples seen) of the last live row
        self.logs = None if self.store.appends_in_place else BufferedLogs(self.store, keep_last=(LIVE,))
        self.stop_checked = (0.0, False)  # (when, what) the stop request was last looked for
        self.driver = DriverWatch(self.store, driver, on_gone=lambda why: self.logs and self.logs.discard())
        self.driver_checked: tuple[float, str | None] = (0.0, None)  # (when, why gone) it was last looked at
        self.last_row_step = 0  # the step of the last metrics row: a row's loss covers the steps since
        self.window_steps = 0  # the steps the last row's loss covers

    @property
    def run_dir(self) -> Path:
        """The run directory on a file system (see `store` for either kind)."""
        return self.store.path

    def event(self, kind: str, message: str, **extra: Any) -> None:
        """A line of events.jsonl; `kind` is one of `Kind`."""
        if self.enabled:
            self._append(EVENTS, Event(kind, message, extra=extra).to_json())

    def metrics(self, row: MetricsRow) -> None:
        if self.enabled:
            self._append(METRICS, row.to_json())
        self.window_steps = row.step - self.last_row_step
        self.last_row_step = row.step

    def _append(self, name: str, values: dict[str, Any]) -> None:
        if self.logs is None:
            self.rundir.store.append_text(name, dumps(values) + "\n")
        else:
            self.logs.append(name, dumps(values) + "\n")

    def flush(self) -> None:
        """Rows still queued for an object store, written now."""
        if self.logs is not None and self.enabled:
            self.logs.flush()

    def close(self) -> None:
        """At the end of the attempt, however it ends: the queued rows written (none once the driver
        was found gone: `self.driver` dropped them, and a resume may own the files)."""
        if self.logs is not None:
            self.logs.close()

    def stop_requested(self, anyone: bool = False) -> bool:
        """The driver asks the run to stop (SIGINT/SIGTERM) with a file; rank 0 looks, and the
        next sync tells every rank (`anyone`: this rank looks too)."""
        if not (self.enabled or anyone):
            return False
        when, asked = self.stop_checked
        if not asked and time.monotonic() - when >= self.store.poll_s:
            self.stop_checked = (time.monotonic(), self.rundir.stop_requested())
        return self.stop_checked[1]

    def driver_gone(self) -> str | None:
        """Why the driver that started this attempt no longer holds the run (None: it does);
        rank 0 looks, at most every `Store.poll_s`, and the next sync tells every rank."""
        if not self.enabled:
            return None
        when, why = self.driver_checked
        if why is None and time.monotonic() - when >= self.store.poll_s:
            self.driver_checked = (time.monotonic(), self.driver.why_gone())
        return self.driver_checked[1]

    def clear_staging(self) -> None:
        """Checkpoints half-written by an attempt that died: never published, so removed."""
        if self.enabled:
            shutil.rmtree(ckpt.staging_dir(self.store), ignore_errors=True)

    def start_attempt(self, announcement: Event, checkpoint_step: int) -> None:
        """An attempt begins from the checkpoint at `checkpoint_step` (0: none) and says so."""
        if not self.enabled:
            return
        # Rows written after the checkpoint we resume from describe training that is
        # about to be redone: drop them so the curve continues from the checkpoint.
        self.flush()
        last = self.rundir.last_record()
        if last is not None:
            # where training was last seen before this attempt: the steps redone and the time to
            # recover are counted from it (raytrain.rules.accounting), once the rows are dropped
            announcement.extra.update(last_step=last[0], last_step_time=last[1])
        self.rundir.truncate_metrics(checkpoint_step)
        self._append(EVENTS, announcement.to_json())
        self.last_row_step = checkpoint_step

    def update_config(self, values: dict[str, Any]) -> None:
        """config.yaml rewritten as `values` (what ran, once a worker knows it)."""
        if self.enabled and values:
            self.rundir.write_config(values)

    def live_due(self) -> bool:
        """Whether a live row is due (about once a second, rank 0 only)."""
        return self.enabled and time.time() - self.last_live >= LIVE_INTERVAL_S

    def live(
        self,
        *,
        epoch: int,
        step: int,
        samples_seen: int,
        epoch_rows: int,
        global_batch_size: int,
        world_size: int,
        loss: float | None,
    ) -> None:
        """Where rank 0 is in the epoch (`epoch` 1-based), for the driver's progress bar, with
        the rate since the last live row. `loss` is rank 0's own running loss: no collective,
        so it costs the other ranks nothing."""
        now = time.time()
        previous, self.live_mark = self.live_mark, (now, samples_seen)
        rate = (samples_seen - previous[1]) / (now - previous[0]) if previous and now > previous[0] else None
        self.last_live = now
        row = dict(time=now, epoch=epoch, step=step, samples_seen=samples_seen, epoch_rows=epoch_rows)
        row.update(global_batch_size=global_batch_size, world_size=world_size, loss=loss, samples_per_s=rate)
        self._append(LIVE, row)

    def epoch_end(self, row: MetricsRow, epochs: int | None) -> None:
        """The epoch's metrics row and its line for the console: the epoch's mean loss, then the
        last window's, each named."""
        self.metrics(dataclasses.replace(row, epoch_end=True))
        parts = [f"epoch {row.epoch}/{epochs}" if epochs else f"epoch {row.epoch}", *self._losses(row)]
        parts += [f"{key} {value:.4f}" for key, value in row.validation.items()]
        parts += [f"lr {row.lr:.2e}", f"{row.samples_per_s:,.0f} samples/s"]
        self.event(Kind.EPOCH, "  ".join(parts), epoch=row.epoch)

    def evaluation(self, row: MetricsRow, final: bool = False) -> None:
        """The line of a validation pass between epoch ends (`final`: the one at the step budget's
        end), for the console: `step 200 (epoch 1): loss 2.4301 (steps 191–200)  val_loss 2.5123`."""
        parts = [*self._losses(row), *(f"{key} {value:.4f}" for key, value in row.validation.items())]
        where = f"step {row.step:,} (epoch {row.epoch}{', the last step' if final else ''}):"
        self.event(Kind.EVAL, f"{where} {'  '.join(parts)}", step=row.step, epoch=row.epoch)

    def _losses(self, row: MetricsRow) -> list[str]:
        """`epoch_loss 0.4500` (when the row has it) and `loss 0.3100 (steps 91–100)`: the last window's."""
        parts = [f"{EPOCH_LOSS} {row.get(EPOCH_LOSS):.4f}"] if row.get(EPOCH_LOSS) is not None else []
        window = self.window_steps
        steps = f" (steps {row.step - window + 1:,}–{row.step:,})" if window > 1 else f" (step {row.step:,})"
        return [*parts, f"loss {row.loss:.4f}{steps}" if row.loss is not None else "loss n/a"]

    def finish(self, weights: dict[str, torch.Tensor], progress: Progress) -> None:
        """Training finished: the final model (`weights`, a plain state_dict), progress.json and
        the last event."""
        if not self.enabled:
            return
        with self.store.staged_file(MODEL) as tmp, storage_errors(self.store / MODEL, "write the final model"):
            formats.save_torch(weights, tmp)
        self.rundir.write_progress(progress)
        self.event(Kind.DONE, f"finished {progress.epoch} epochs, {progress.step} steps", step=progress.step)
        self.flush()

    def interrupted(self, progress: Progress) -> None:
        """Stopped on request after a checkpoint at this step: no final model, resumable."""
        if self.enabled:
            self.rundir.write_progress(progress)
            self.event(Kind.INTERRUPTED, f"stopped at step {progress.step} with a checkpoint there", step=progress.step)
            self.flush()
