"""A run's goodput, accounted from its records: the time spent on the steps that were kept, over
the wall time, and where the rest went (summary.json's `goodput`, report.md's table).

- kept steps: the steps of the position (the work a checkpoint kept) at the steady step time
  (progress.json's steady time over steady steps);
- checkpoint stalls: the loop's wait at the saves the position kept (`checkpoint_wait_s`);
- start: from an invocation's start to its first attempt's event (Ray, the data, the model, the
  restore), then to its first steps: the time the first logged window took beyond its steps;
- recovery and steps redone, per failure (every attempt after the first, and under per-step every
  quorum that lost a replica): the steps between the checkpoint restored and the last one recorded
  before it are redone; the rest of the gap from that last record to the attempt's event, and
  the first window after it beyond its steps, is recovery. (A quorum's loss redoes one step.)
- validation: the loop's time in validation passes (`validation_s`, in the telemetry); a run
  whose checkpoints predate it has none, and that time is part of `other`;
- other: what is left (warm-up steps beyond the steady step time, epoch ends, the final save).

Counted across resumes: the position's figures are the run's; start, recovery and steps redone
add to those of the earlier invocations' summary. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from raytrain.rundir.records import Event, Goodput, Kind, MetricsRow, Progress

ATTEMPTS = (Kind.PLAN, Kind.RESTORE, Kind.RESIZE)


@dataclass(frozen=True)
class _Mark:
    time: float
    step: int


def account(
    *,
    wall_s: float,
    started: float,
    events: Sequence[Event],
    rows: Sequence[MetricsRow],
    progress: Progress | None,
    earlier: dict[str, Any] | None = None,
) -> Goodput | None:
    """The run's goodput after this invocation (started at `started`, a time.time(); `events`
    and `rows` its own), given the earlier invocations' (`earlier`: their summary's goodput).
    None without a steady step time to count the kept steps at."""
    steady_time_s = progress.get("steady_time_s") if progress is not None else None
    if progress is None or not progress.steady_steps or not steady_time_s:
        return None
    step_s = steady_time_s / progress.steady_steps
    marks = sorted(
        [_Mark(row.time_s, row.step) for row in rows if row.time_s and row.time_s >= started]
        + [_Mark(e.time, e.step) for e in events if e.step is not None and e.kind not in ATTEMPTS]
        + [_Mark(e.time, _attempt_step(e)) for e in events if e.kind in ATTEMPTS],
        key=lambda mark: mark.time,
    )
    start = recovery = redone = preemption = 0.0
    failures = preemptions = 0
    first, noticed = True, False
    for event in events:
        if event.time < started:
            continue
        if event.kind == Kind.PREEMPTED:  # the next restart or lost replica comes of it, not of a failure
            noticed = True
        elif event.kind in ATTEMPTS and first:
            first = False
            start = max(0.0, event.time - started) + _after(event, marks, step_s)
        elif event.kind in ATTEMPTS or (event.kind == Kind.QUORUM and event.recovers_a_failure):
            back = _before(event, marks, started)
            at = _attempt_step(event)
            gap = max(0.0, event.time - back.time - max(0, at - back.step) * step_s)
            if event.kind == Kind.QUORUM:  # the survivors go on: one step taken again
                lost, again = step_s, max(0.0, gap - step_s)
            else:
                lost, again = max(0, back.step - at) * step_s, gap + _after(event, marks, step_s)
            redone += lost
            if noticed:
                preemptions, preemption, noticed = preemptions + 1, preemption + again, False
            else:
                failures, recovery = failures + 1, recovery + again
    earlier = earlier or {}
    kept = progress.step * step_s
    stalls = float(progress.get("checkpoint_wait_s") or 0.0)
    validation = progress.get("validation_s")
    start += earlier.get("start_s") or 0.0
    recovery += earlier.get("recovery_s") or 0.0
    redone += earlier.get("redone_s") or 0.0
    failures += earlier.get("failures") or 0
    preemption += earlier.get("preemption_s") or 0.0
    preemptions += earlier.get("preemptions") or 0
    other = wall_s - kept - stalls - start - recovery - preemption - redone - (validation or 0.0)
    return Goodput(
        goodput=round(kept / wall_s, 4) if wall_s > 0 else None,
        wall_s=round(wall_s, 3),
        kept_steps_s=round(kept, 3),
        step_s=round(step_s, 6),
        start_s=round(start, 3),
        checkpoint_stall_s=round(stalls, 3),
        recovery_s=round(recovery, 3),
        preemption_s=round(preemption, 3),
        redone_s=round(redone, 3),
        validation_s=None if validation is None else round(float(validation), 3),
        other_s=round(max(0.0, other), 3),
        failures=failures,
        preemptions=preemptions,
        checkpoints=int(progress.get("checkpoints") or 0),
    )


def _attempt_step(event: Event) -> int:
    """The step an attempt starts from (a fresh start without a checkpoint: 0)."""
    return int(event.step or 0)


def _before(event: Event, marks: Sequence[_Mark], started: float) -> _Mark:
    """The last record before `event`: when training was last known to be going on (the rows a
    restart drops are gone from metrics.jsonl; its event names the last of them)."""
    earlier = [mark for mark in marks if mark.time < event.time]
    found = earlier[-1] if earlier else _Mark(started, _attempt_step(event))
    said = event.last_recorded
    if said is not None and found.time < said[1] < event.time:
        return _Mark(said[1], said[0])
    return found


def _after(event: Event, marks: Sequence[_Mark], step_s: float) -> float:
    """The first logged window after an attempt's event beyond the steps it took: the attempt
    starting (processes, the restore, the first steps' compile and warm-up)."""
    at = _attempt_step(event)
    later = next((mark for mark in marks if mark.time > event.time and mark.step > at), None)
    if later is None:
        return 0.0
    return max(0.0, later.time - event.time - (later.step - at) * step_s)


def shares(goodput: Goodput) -> list[tuple[str, float | None, float | None]]:
    """(what, seconds, share of the wall time) for report.md, in order; None: not recorded."""
    wall = goodput.wall_s or 0.0
    parts = [
        ("steps kept", goodput.kept_steps_s),
        ("start", goodput.start_s),
        ("checkpoint stalls", goodput.checkpoint_stall_s),
        ("recovery", goodput.recovery_s),
        ("preemptions", goodput.preemption_s),
        ("steps redone", goodput.redone_s),
        ("validation", goodput.validation_s),
        ("other", goodput.other_s),
    ]
    return [(name, seconds, seconds / wall if seconds is not None and wall > 0 else None) for name, seconds in parts]


def measured_costs(goodput: dict[str, Any] | None, checkpoint_wait_s: float | None) -> dict[str, float]:
    """What a run measured for `raytrain plan`: the step time, the stall per save, the recovery
    per failure (only those it has)."""
    found: dict[str, float] = {}
    goodput = goodput or {}
    if goodput.get("step_s"):
        found["step_s"] = float(goodput["step_s"])
    if checkpoint_wait_s is not None:
        found["stall_s"] = float(checkpoint_wait_s)
    if goodput.get("failures"):
        found["recovery_s"] = float(goodput.get("recovery_s") or 0.0) / goodput["failures"]
    return found


def goodput_phrase(goodput: dict[str, Any] | None, steps: int) -> str:
    """The goodput as the run's last line gives it: the figure, and when less than half of the
    wall time went to kept steps, what took the most ("goodput 7%: the start took 24 s of 29 s"),
    so that a short run's figure reads as Ray's start, not as a bad run. Without a figure (too
    few steps for a steady step time), why."""
    value = (goodput or {}).get("goodput")
    if not isinstance(value, (int, float)):
        return f", goodput not measured ({steps:,} step{'s' if steps != 1 else ''}: too few for a steady step time)"
    phrase = f", goodput {value:.0%}"
    wall = float(goodput.get("wall_s") or 0.0)
    if value >= 0.5 or wall <= 0:
        return phrase
    verbs = {
        "start_s": "the start took",
        "checkpoint_stall_s": "checkpoint stalls took",
        "recovery_s": "recovery took",
        "redone_s": "steps redone took",
        "validation_s": "validation took",
        "other_s": "epoch ends, warm-up and the final save took",
    }
    name, seconds = max(((name, float(goodput.get(name) or 0.0)) for name in verbs), key=lambda item: item[1])
    return f"{phrase}: {verbs[name]} {seconds:,.0f} s of {wall:,.0f} s" if seconds > 0 else phrase
