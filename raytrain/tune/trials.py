"""What the sweep's driver says and reads of Tune's trials: one console line per trial start, epoch
and end, each trial's name, its error in one line, and its run (`TrialRun`) once it ended."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from raytrain.text import first_line, sci
from raytrain.tune.options import TuneOptions
from raytrain.tune.results import TrialRun
from raytrain.tune.space import SweepRun, point_key, runs_by_point, trial_name


def console_callback(total: int, epochs: int, options: TuneOptions, runs: list[SweepRun], echo: Callable[[str], None]):
    """Tune callback (driver side): one line per trial epoch and per trial end; keeps every
    result Tune received per trial (the results of the sweep come from them), each trial's
    wall time and how it ended."""
    from ray.tune import Callback

    planned = runs_by_point(runs)

    class Console(Callback):
        def __init__(self) -> None:
            self.started: dict[str, float] = {}
            self.ended: dict[str, float] = {}
            self.errors: dict[str, str] = {}
            self.reported: dict[str, list[dict[str, Any]]] = {}
            self.trials: dict[str, Any] = {}  # trial id -> Trial, for the rows of trials.csv

        def on_experiment_end(self, trials, **info):
            self.trials.update((trial.trial_id, trial) for trial in trials)

        def _label(self, trial) -> str:
            run = planned.get(point_key(trial.config["point"]))
            rules = run.rule_names if run is not None else trial.config["point"]["lr_scaling"]
            point = _describe_point({**trial_point(trial), "lr_scaling": rules})
            return f"[{trial_index(trial) + 1:>{len(str(total))}}/{total} {point}]"

        def on_trial_start(self, iteration, trials, trial, **info):
            self.started[trial.trial_id] = time.time()
            self.trials[trial.trial_id] = trial

        def on_trial_result(self, iteration, trials, trial, result, **info):
            self.reported.setdefault(trial.trial_id, []).append(dict(result))
            shown = (k for k in sorted(result) if k.startswith("val_") and isinstance(result[k], (int, float)))
            metrics = "  ".join(f"{k} {result[k]:.4f}" for k in shown)
            echo(f"{self._label(trial)} epoch {result.get('epoch')}/{epochs}  {metrics}")

        def on_trial_complete(self, iteration, trials, trial, **info):
            self.ended[trial.trial_id] = time.time()
            last = trial.last_result or {}
            took = self.ended[trial.trial_id] - self.started.get(trial.trial_id, self.ended[trial.trial_id])
            if last.get("epoch", 0) < epochs:
                echo(f"{self._label(trial)} stopped early by ASHA after epoch {last.get('epoch', 0)} ({took:.0f} s)")
            else:
                value = last.get(options.metric)
                shown = f"{options.metric} {value:.4f}" if isinstance(value, (int, float)) else ""
                echo(f"{self._label(trial)} finished: {shown} ({took:.0f} s)")

        def on_trial_error(self, iteration, trials, trial, **info):
            self.ended[trial.trial_id] = time.time()
            message = trial_error(trial)
            self.errors[trial.trial_id] = message
            echo(f"{self._label(trial)} FAILED: {message} (run files: trials/{trial_name_creator(trial)}/)")

    return Console()


def trial_index(trial) -> int:
    """0-based position among the sweep's runs, from Tune's trial id (`<experiment>_00003`)."""
    return int(str(trial.trial_id).rsplit("_", 1)[-1])


def trial_point(trial) -> dict[str, Any]:
    return {**trial.config["point"], **({"lr": trial.config["lr"]} if "lr" in trial.config else {})}


def trial_name_creator(trial) -> str:
    return trial_name(trial_index(trial), trial_point(trial))


def _describe_point(point: dict[str, Any]) -> str:
    return f"{point['workers']}w {point['lr_scaling']} warmup {point['warmup_epochs']:g} lr {sci(point['lr'])}"


def trial_error(trial) -> str:
    """One line: why a trial failed, from the exception Tune kept. Ray wraps the trial's own
    exception (`cause`); a RunFailed from fit opens with "The run failed: <rank, exception,
    where>", any other exception is said as `Type: message`."""
    from raytrain.errors import RunFailed

    error = None
    with contextlib.suppress(Exception):
        error = trial.get_pickled_error()
    for _ in range(8):  # RayTaskError / TuneError around the trial's exception
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException):
            break
        error = cause
    if isinstance(error, RunFailed):
        return first_line(str(error))[:400]
    if isinstance(error, BaseException):
        return first_line(error)[:400]
    where = getattr(trial, "error_file", None)
    return f"failed (Tune's error file: {where})" if where else "failed"


def trial_run(trial, epochs: int, console) -> TrialRun:
    """What Tune saw of `trial`, and how it ended."""
    reported = (trial.last_result or {}).get("epoch", 0) or 0
    if trial.status == "ERROR":
        status = "failed"
    elif trial.status != "TERMINATED":
        status = str(trial.status).lower()  # never ran: the sweep was interrupted
    elif reported < epochs:
        status = "stopped"
    else:
        status = "finished"
    return TrialRun(
        name=trial_name_creator(trial),
        point=dict(trial.config["point"]),
        status=status,
        reported=console.reported.get(trial.trial_id, []),
        lr=trial.config.get("lr"),
        started=console.started.get(trial.trial_id),
        ended=console.ended.get(trial.trial_id),
        error=(console.errors.get(trial.trial_id) or trial_error(trial)) if status == "failed" else "",
    )
