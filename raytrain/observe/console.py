"""The driver's console: the run's lines, one live progress bar, and failures explained.

Rank 0's stdout does not reach the driver (Ray forwards worker output only with -v), so
progress is drawn here, from the rows rank 0 writes (`raytrain.observe.tracking` tails them):

- on a terminal, ONE tqdm bar for the steps of the current epoch, with loss, samples/s
  and the epoch's ETA; the run's lines (plan, epochs, resizes) print above it;
- elsewhere (CI, `ray job logs`, a pipe), a plain line every `interval_s` seconds and
  never a carriage return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from raytrain.observe.sinks import Sink, number
from raytrain.rundir import Event, Kind, MetricsRow

BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]"
BAR_FORMAT_NO_TOTAL = "{desc} {n_fmt} steps [{elapsed}{postfix}]"


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM", "") != "dumb"


# -- where the run is (pure) -----------------------------------------------------------------


@dataclass
class Snapshot:
    """Where rank 0 is, as the display shows it."""

    epoch: int  # 1-based epoch being trained (or just finished)
    epochs: int | None  # None: the run is counted in steps only
    epoch_step: int | None  # steps done in this epoch (by_steps: in the run)
    epoch_steps: int | None  # steps this epoch has in all (by_steps: the run); None: not known yet
    loss: float | None
    samples_per_s: float | None
    eta_s: float | None  # until the end of this epoch's training steps (by_steps: of the run's)
    world_size: int | None
    by_steps: bool = False  # the run has a step budget (--max-steps): progress counts the run's steps

    @property
    def title(self) -> str:
        """`epoch 2/5`, or `epoch 2` when the run is counted in steps."""
        return f"epoch {self.epoch}/{self.epochs}" if self.epochs else f"epoch {self.epoch}"

    def line(self) -> str:
        """The plain progress line: no carriage return, no bar."""
        parts = [] if self.by_steps else [self.title]
        if self.epoch_step is not None:
            total = f"/{self.epoch_steps}" if self.epoch_steps else ""
            percent = f" ({100 * self.epoch_step / self.epoch_steps:.0f}%)" if self.epoch_steps else ""
            parts.append(f"step {self.epoch_step}{total}{percent}")
        if self.by_steps:
            parts.append(self.title)
        parts.append(self.postfix(workers=True).replace(", ", "  "))
        return "  ".join(part for part in parts if part)

    def postfix(self, workers: bool = False) -> str:
        """`ETA 0:05, loss 0.2500, 2,346 samples/s`: what matters first (a narrow terminal cuts the end)."""
        parts = []
        if self.eta_s is not None:
            parts.append(f"ETA {format_duration(self.eta_s)}")
        if self.loss is not None and math.isfinite(self.loss):
            parts.append(f"loss {self.loss:.4f}")
        if self.samples_per_s:
            parts.append(f"{self.samples_per_s:,.0f} samples/s")
        if workers and self.world_size:
            parts.append(f"{self.world_size} worker{'s' if self.world_size != 1 else ''}")
        return ", ".join(parts)


class EpochProgress:
    """Turns metrics/progress rows into Snapshots.

    The epoch's step count comes from the row (`epoch_step`, `epoch_steps`), else from the
    training set size: in the row (`epoch_rows`, live.jsonl), given, or learned at the
    first epoch end (every epoch sees every sample once, so samples_seen = epoch × rows).
    """

    def __init__(self, epochs: int | None, train_rows: int | None = None, max_steps: int | None = None):
        self.epochs = epochs
        self.train_rows = train_rows
        self.max_steps = max_steps
        self.epoch_start_step: int | None = 0

    def update(self, row: MetricsRow) -> Snapshot | None:
        epoch, step, seen = row.epoch, row.step, row.samples_seen
        if not isinstance(epoch, int) or not isinstance(step, int):
            return None
        if isinstance(row.get("epoch_rows"), int) and row.get("epoch_rows") > 0:
            self.train_rows = row.get("epoch_rows")  # live.jsonl rows say it
        if self.max_steps:
            return self._run_steps(row, epoch, step)
        if row.epoch_end:
            return self._epoch_end(row, epoch, step, seen)
        batch = row.global_batch_size or 0
        epoch_step, epoch_steps, eta = row.get("epoch_step"), row.get("epoch_steps"), None
        rows = self.train_rows
        if rows and isinstance(seen, int) and batch:
            into = min(rows, max(0, seen - (epoch - 1) * rows))  # samples of this epoch done
            left = rows - into
            epoch_step = epoch_step if epoch_step is not None else math.ceil(into / batch)
            epoch_steps = epoch_steps if epoch_steps is not None else epoch_step + math.ceil(left / batch)
            rate = row.samples_per_s
            eta = left / rate if isinstance(rate, (int, float)) and rate > 0 else None
        elif epoch_step is None and self.epoch_start_step is not None:
            epoch_step = step - self.epoch_start_step
        loss, speed = number(row.loss), number(row.samples_per_s)
        return Snapshot(epoch, self.epochs, epoch_step, epoch_steps, loss, speed, eta, row.world_size)

    def _run_steps(self, row: MetricsRow, epoch: int, step: int) -> Snapshot:
        """The run's steps against its budget: --max-steps, or fewer when its epochs end first."""
        total, batch, rate = self.max_steps, row.global_batch_size or 0, row.samples_per_s
        if self.epochs and self.train_rows and batch:
            total = min(total, self.epochs * math.ceil(self.train_rows / batch))
        eta = (total - step) * batch / rate if isinstance(rate, (int, float)) and rate > 0 and batch else None
        if row.epoch_end and epoch >= 1:
            epoch = epoch + 1 if step < total else epoch  # the epoch being trained now
        loss, speed = number(row.loss), number(row.samples_per_s)
        return Snapshot(epoch, self.epochs, step, total, loss, speed, eta, row.world_size, by_steps=True)

    def _epoch_end(self, row: MetricsRow, epoch: int, step: int, seen: Any) -> Snapshot:
        if epoch > 0 and isinstance(seen, int) and seen % epoch == 0:
            self.train_rows = self.train_rows or seen // epoch
        steps = step - self.epoch_start_step if self.epoch_start_step is not None else None
        self.epoch_start_step = step
        loss, speed = number(row.loss), number(row.samples_per_s)
        return Snapshot(epoch, self.epochs, steps, steps, loss, speed, 0.0, row.world_size)

    def restarted(self) -> None:
        """After a restore or resize, the epoch's first step is no longer known from rows."""
        self.epoch_start_step = None

    def next_epoch(self, snapshot: Snapshot, global_batch_size: int | None) -> Snapshot | None:
        """The empty bar of the epoch after `snapshot` (an epoch end), or None after the last
        (and when progress counts the run's steps, whose bar goes on)."""
        if snapshot.by_steps or (self.epochs is not None and snapshot.epoch >= self.epochs):
            return None
        steps = math.ceil(self.train_rows / global_batch_size) if self.train_rows and global_batch_size else None
        return Snapshot(snapshot.epoch + 1, self.epochs, 0, steps, None, None, None, snapshot.world_size)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# -- the console sink ------------------------------------------------------------------------


class Console(Sink):
    """The run's lines through `echo`, plus progress: `bar` (one live tqdm bar), `plain`
    (a line every interval_s), `off` (lines only), `auto` (bar on a terminal, else plain)."""

    name = "console"

    def __init__(
        self,
        echo: Callable[[str], None],
        *,
        epochs: int | None,
        train_rows: int | None = None,
        mode: str = "auto",
        interval_s: float = 10.0,
        stream: Any = None,
        clock: Callable[[], float] = time.monotonic,
        max_steps: int | None = None,
    ):
        self.echo = echo
        self.stream = stream if stream is not None else sys.stdout
        self.mode = ("bar" if is_terminal(self.stream) else "plain") if mode == "auto" else mode
        self.interval_s = interval_s
        self.clock = clock
        self.state = EpochProgress(epochs, train_rows, max_steps)
        self.snapshot: Snapshot | None = None
        self.bar = None
        self.bar_epoch: int | None = None
        self.last_line_at = clock()
        self.fresh = False  # a snapshot not shown in a plain line yet

    # rows
    def event(self, event: Event) -> None:
        if event.kind in Kind.MARKED:
            self.state.restarted()
        if event.kind == Kind.DONE:
            self._close_bar()
        if event.message:
            self.write(str(event.message))

    def metrics(self, row: MetricsRow) -> None:
        snapshot = self.state.update(row)
        if snapshot is None:
            return
        if row.epoch_end:
            upcoming = self.state.next_epoch(snapshot, row.global_batch_size)
            snapshot = upcoming or snapshot
        self._show(snapshot)

    def progress(self, row: dict[str, Any]) -> None:
        """A live.jsonl row: where rank 0 is within the epoch (never an epoch's end)."""
        with contextlib.suppress(TypeError):  # a row without an epoch and a step
            self.metrics(dataclasses.replace(MetricsRow.from_json(row), epoch_end=False))

    def tick(self) -> None:
        if self.mode == "bar" and self.bar is not None:
            self.bar.refresh()  # elapsed time moves on between rows
        elif self.mode == "plain" and self.fresh and self.clock() - self.last_line_at >= self.interval_s:
            self.echo(self.snapshot.line())
            self.last_line_at, self.fresh = self.clock(), False

    def stop(self) -> None:
        self._close_bar()

    # output
    def write(self, line: str) -> None:
        """A line above the bar (the bar is cleared, the line printed, the bar redrawn)."""
        if self.bar is None:
            self.echo(line)
            return
        self.bar.clear()
        self.echo(line)
        self.bar.refresh()

    def _show(self, snapshot: Snapshot) -> None:
        self.snapshot, self.fresh = snapshot, True
        if self.mode != "bar":
            return
        bar = self._bar_for(snapshot)
        bar.set_postfix_str(snapshot.postfix(), refresh=False)
        if snapshot.epoch_steps and snapshot.epoch_steps != bar.total:
            bar.total = snapshot.epoch_steps
        if snapshot.epoch_step is not None:
            bar.n = min(snapshot.epoch_step, bar.total or snapshot.epoch_step)
        bar.refresh()

    def _bar_for(self, snapshot: Snapshot):
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(
                total=snapshot.epoch_steps,
                file=self.stream,
                dynamic_ncols=True,
                leave=False,
                mininterval=0,
                bar_format=BAR_FORMAT,
            )
        if snapshot.by_steps:  # one bar for the run, titled with the epoch it is in
            self.bar.set_description_str(snapshot.title, refresh=False)
        elif self.bar_epoch != snapshot.epoch:
            self.bar.reset(total=snapshot.epoch_steps)
            self.bar.set_description_str(snapshot.title, refresh=False)
            self.bar_epoch = snapshot.epoch
        self.bar.bar_format = BAR_FORMAT if snapshot.epoch_steps else BAR_FORMAT_NO_TOTAL
        return self.bar

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()  # leave=False: the bar's line is cleared
            self.bar = None
            self.bar_epoch = None
