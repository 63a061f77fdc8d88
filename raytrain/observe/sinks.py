"""What receives a run's records while it trains, and the follower that feeds them.

Rank 0 appends records to the run directory; the driver (which may sit on another machine,
reading the same storage) follows the files and sends every new record, in time order, to
a list of sinks. The console (`raytrain.observe.console`) and the trackers (`raytrain.observe.tracking`)
are sinks; neither knows the other.
"""

from __future__ import annotations

import contextlib
import math
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from raytrain.rundir import EVENTS, LIVE, METRICS, Event, MetricsRow, RunDir, Store, Summary
from raytrain.text import first_line


class Sink:
    """Receives the run's records. Override what you need; calls come from one thread at a time."""

    name = "sink"

    def event(self, event: Event) -> None:
        """A line of events.jsonl: kind, message and figures."""

    def metrics(self, row: MetricsRow) -> None:
        """A line of metrics.jsonl (`epoch_end` on the row written at an epoch's end)."""

    def progress(self, row: dict[str, Any]) -> None:
        """A line of live.jsonl: where rank 0 is within the epoch, about once a second."""

    def tick(self) -> None:
        """After each poll of the files (flush, refresh a display)."""

    def stop(self) -> None:
        """Training is over (finished, failed or interrupted): release the console."""

    def finish(self, summary: Summary | None, run_dir: Path) -> None:
        """The run's summary is written (None when the driver was interrupted); close."""


class Dispatcher:
    """Calls every sink; a sink that raises is dropped with one warning, the run goes on."""

    def __init__(self, sinks: Sequence[Sink], warn: Callable[[str], None]):
        self.sinks = list(sinks)
        self.warn = warn

    def send(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # a tracker's outage must not fail training
                self.sinks.remove(sink)
                with contextlib.suppress(Exception):
                    getattr(sink, "abandon", lambda: None)()
                self.warn(f"raytrain: {sink.name} stopped tracking this run: {first_line(exc)}")


# The files followed: the sink method each line goes to, and how it is read.
_FOLLOWED: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    METRICS: ("metrics", MetricsRow.from_json),
    LIVE: ("progress", dict),
    EVENTS: ("event", Event.from_json),
}


def number(value: Any) -> float | None:
    """A figure of a record as a float (NaN and inf included); None for anything else, a bool too."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def record_time(record: Any) -> float:
    value = record.get("time", record.get("time_s"))
    return float(value) if isinstance(value, (int, float)) else math.inf


@contextlib.contextmanager
def follow(
    run_dir: "Path | Store", dispatcher: Dispatcher, since: float, interval_s: float = 0.5
) -> Iterator[Callable[[], None]]:
    """Follow the run files in a background thread while the body runs; each poll sends the
    new records of all files to the sinks in time order, then `tick`. Yields `pump` (one poll).
    On an object store a poll is a size check per file and a ranged read of what is new; a
    store that does not answer skips the poll (the next one catches up)."""
    files = RunDir(run_dir)
    interval_s = max(interval_s, files.store.poll_s)
    tails = {name: files.tail(name) for name in _FOLLOWED}
    lock = threading.Lock()

    def pump() -> None:
        with lock:
            batch = []
            for order, (name, tail) in enumerate(tails.items()):
                method, parse = _FOLLOWED[name]
                try:
                    lines = tail.read()
                except OSError:  # the store is away: the run's own writes will say so if it lasts
                    continue
                for line in lines:
                    with contextlib.suppress(TypeError):  # a line without a record's keys
                        record = parse(line)
                        # events.jsonl outlives a driver: older lines belong to an earlier session.
                        if method == "event" and record_time(record) < since - 1:
                            continue
                        batch.append((record_time(record), order, len(batch), method, record))
            batch.sort(key=lambda item: item[:3])
            for *_, method, record in batch:
                dispatcher.send(method, record)
            dispatcher.send("tick")

    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            pump()

    thread = threading.Thread(target=loop, name="raytrain-follow", daemon=True)
    thread.start()
    try:
        yield pump
    finally:
        stop.set()
        thread.join()
        pump()
