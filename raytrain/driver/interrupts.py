"""SIGINT and SIGTERM during a run: stop within seconds, keep the run resumable.

First signal: the driver writes RUN_DIR/.stop; rank 0 sees it, the next sync (every
--log-every-steps steps) tells every rank, and they report a checkpoint at that step and
return. If that does not happen within STOP_GRACE_S, or on a second signal, the driver
aborts Ray Train's controller (the workers are stopped; the last checkpoint stands; a
controller that does not answer is killed). A third signal exits at once. `fit` then writes
summary.json with status "interrupted" and raises `Interrupted`, which the CLI turns into exit
status 130 (SIGINT) or 143 (SIGTERM).

A run whose training finished ends too, whatever its controller waits for (`EndsWhenDone`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from raytrain.observe.sinks import Sink
from raytrain.rundir.records import Kind

# Seconds the workers get to checkpoint and stop on their own before the run is aborted.
STOP_GRACE_S = 30.0
# Seconds Ray Train's controller gets to return once training finished: it polls the workers
# every 2 s, and shutting them down takes a few more.
FINISHED_GRACE_S = 60.0
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}

# The running controller (set by raytrain.driver.failfast.FailFastTrainer), to abort it.
_controller: Any = None


def set_controller(controller: Any) -> None:
    global _controller
    _controller = controller


class Interrupted(Exception):
    """The run was stopped by a signal; it is resumable."""

    def __init__(self, signum: int, run_dir: Any, cfg: Any = None, spec: str | None = None):
        from raytrain.rundir import Store

        self.signum, self.run_dir = signum, Store.of(run_dir)
        name = signal.Signals(signum).name
        storage = f" --storage {self.run_dir.parent.public_uri}" if cfg is not None else ""
        again = f"raytrain train {spec or 'PIPELINE'} --name {self.run_dir.name}{storage} --resume"
        super().__init__(f"stopped by {name}; the run is resumable from its last checkpoint: {again}")

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 128 + self.signum)


@dataclass
class StopRequest:
    run_dir: Any  # the run's Store (or path)
    echo: Callable[[str], None]
    signal: int = 0  # the first signal received (0: none)
    requested_at: float | None = None  # its time.time()
    count: int = 0
    _timer: threading.Timer | None = field(default=None, repr=False)

    def handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            self.signal, self.requested_at = signum, time.time()
            from raytrain import rundir

            with contextlib.suppress(Exception):
                rundir.RunDir(self.run_dir).request_stop()
            self.echo(
                f"raytrain: {signal.Signals(signum).name}: stopping — the workers save a checkpoint at their next sync "
                f"(within {STOP_GRACE_S:.0f} s, else the run is aborted); press Ctrl-C again to stop at once"
            )
            self._timer = threading.Timer(STOP_GRACE_S, self.abort, args=("the workers did not stop in time",))
            self._timer.daemon = True
            self._timer.start()
        elif self.count == 2:
            self.abort("asked again")
        else:
            os._exit(EXIT_STATUS.get(self.signal, 130))

    def abort(self, why: str) -> None:
        self.echo(f"raytrain: aborting the run ({why}); it resumes from its last checkpoint")
        end_controller(abort_timeout_s=30)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def end_controller(abort_timeout_s: float) -> bool:
    """Abort Ray Train's controller (its workers stop with it); one that does not answer within
    `abort_timeout_s` (stuck in a wait of its own, as for a replacement with no node) is killed,
    so that `fit` always returns. Whether there was one."""
    controller = _controller
    if controller is None:
        return False
    import ray

    try:
        ray.get(controller.abort.remote(), timeout=abort_timeout_s)
    except Exception:  # noqa: BLE001 - not answering, or gone: killed either way
        with contextlib.suppress(Exception):
            ray.kill(controller, no_restart=True)  # its worker actors are its own: they go with it
    return True


class EndsWhenDone(Sink):
    """A sink of the run's records: once rank 0 says
    training finished (the final model and progress.json written, then the `done` event), Ray
    Train's controller has `grace_s` to return; one still waiting then (a per-step replica that
    waits for room it never gets, a replacement stuck in Ray's unbounded start) is ended, and
    the run counts as finished."""

    name = "the end of a finished run"

    def __init__(
        self, echo: Callable[[str], None], grace_s: float = FINISHED_GRACE_S, end: Callable[[], bool] | None = None
    ):
        self.echo, self.grace_s = echo, grace_s
        self.end = end or (lambda: end_controller(abort_timeout_s=10))
        self.ended = False  # the controller was ended after training finished
        self._timer: threading.Timer | None = None

    def event(self, event: Any) -> None:
        if event.kind == Kind.DONE and self._timer is None:
            self._timer = threading.Timer(self.grace_s, self._end_now)
            self._timer.daemon = True
            self._timer.start()

    def _end_now(self) -> None:
        self.echo(
            f"raytrain: training finished {self.grace_s:.0f} s ago but Ray Train's controller has not returned "
            "(a replica still waiting for room?); ending it"
        )
        self.ended = self.end()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


@contextlib.contextmanager
def stop_on_signals(run_dir: Any, echo: Callable[[str], None]) -> Iterator[StopRequest]:
    """Handle SIGINT and SIGTERM as above while the block runs (main thread only; elsewhere,
    as in a Tune trial, signals are left to the caller)."""
    request = StopRequest(run_dir, echo)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, request.handle)
    try:
        yield request
    finally:
        request.cancel_timer()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        set_controller(None)
