"""`raytrain plan`: goodput and the best checkpoint interval per fault-tolerance mode, on paper,
for worker counts beyond this machine (`raytrain.rules.goodput`; docs/fault-tolerance.md).

Runs nothing. The inputs come from the options, and where a run directory is given (`--run`),
from what that run measured (its steady step time, its stall per save and, if it saw failures,
its recovery per failure); an option given explicitly wins over both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from raytrain.bench.options import worker_counts
from raytrain.errors import ConfigError
from raytrain.observe.render import figure, text_table
from raytrain.rules import goodput
from raytrain.rules.accounting import measured_costs
from raytrain.rules.goodput import HOUR_S, MODES, ModeGoodput, Scenario

MAX_WORKERS = 16_384
DEFAULT_WORKERS = "8,64,512,2048,8192,16384"
DEFAULT_GROUP_SIZE = 8  # a node of 8 GPUs: HSDP's usual group


@dataclass(kw_only=True)
class PlanOptions:
    """What `raytrain plan` predicts from."""

    workers: str = DEFAULT_WORKERS
    """Worker counts (GPUs) to predict for, comma-separated, each 1 to 16,384."""
    gpus_per_node: int = 8
    """Workers (GPUs) per node: a node is what fails."""
    mtbf_hours: float = float(goodput.DEFAULT_NODE_MTBF_H)
    """Mean time between failures of one node, in hours (default: Llama 3's, 419 unexpected interruptions in 54
    days on 2,048 nodes of 8 GPUs)."""
    step_time_s: float | None = None
    """Seconds per optimizer step (default: the run's, with --run; else 1)."""
    checkpoint_stall_s: float | None = None
    """Seconds the loop waits at a save (default: the run's mean, with --run; else 1)."""
    checkpoint_gb: float = 0.0
    """Checkpoint size in GB: written in the background after the stall, at --storage-gbps; a failure before it is
    durable rolls back one save further."""
    storage_gbps: float = 1.0
    """GB/s a checkpoint is written to storage at."""
    recovery_restart_s: float | None = None
    """restart: seconds from a failure to every worker training again (default: the run's, with --run under
    restart and a failure; else 37, measured here)."""
    recovery_per_step_s: float | None = None
    """per-step: the survivors' wait at a failure (default: the run's, with --run under per-step and a failure;
    else 1, measured here)."""
    recovery_groups_s: float = 1.0
    """per-step with replica groups: the survivors' wait at a failure."""
    replace_s: float = 8.0
    """Per-step modes: seconds from a failure to its replacement training (measured here: 8)."""
    detection_s: float = 15.0
    """Seconds from a node going silent (lost, frozen, cut off) to the head acting on it, added to every restart
    from the last save (15: a head raytrain starts, or one given docs/cluster.md's health checks; a head with Ray's
    defaults takes 62–65 s). Not to per-step's failures ridden out: the survivors' own peer wait finds those."""
    preemptions_per_node_day: float = 0.0
    """Preemptions (spot or preemptible nodes reclaimed) per node per day, besides the failures of --mtbf-hours."""
    preemption_notice_s: float = 0.0
    """Seconds of warning a preemption gives (a drain's deadline, SIGTERM's grace); 0: none. A notice shorter than
    a step, a save's stall and its write leaves the preemption a failure."""
    replica_group_size: int | None = None
    """per-step with replica groups: workers per group (default 8, or all the workers when fewer; a given size
    must divide each worker count, as train requires)."""
    run: str | None = None
    """A run directory whose measured step time, stall per save and recovery replace the defaults."""
    plot: str = "goodput.png"
    """Where to draw goodput against the worker count (PNG)."""


def planned_counts(text: str) -> list[int]:
    """`8,64,512` -> [8, 64, 512]; ConfigError naming --workers otherwise."""
    try:
        counts = sorted(set(worker_counts(text)))
    except ConfigError:
        counts = []
    if not counts or not all(1 <= n <= MAX_WORKERS for n in counts):
        why = f"got {text!r}; give worker counts from 1 to {MAX_WORKERS:,}, comma-separated, e.g. 8,512,16384"
        raise ConfigError([("workers", why)])
    return counts


def inputs(opts: PlanOptions) -> tuple[dict[str, float], str]:
    """The costs the plan uses (step_s, stall_s, recovery per mode) and where they came from."""
    measured: dict[str, float] = {}
    mode = "restart"
    if opts.run:
        measured, mode = _measured(opts.run)
    recovery = dict(goodput.RECOVERY_S)
    if "recovery_s" in measured:
        recovery[mode] = measured["recovery_s"]  # the run's mode: restart or per-step
    given = {
        "step_s": opts.step_time_s if opts.step_time_s is not None else measured.get("step_s", 1.0),
        "stall_s": opts.checkpoint_stall_s if opts.checkpoint_stall_s is not None else measured.get("stall_s", 1.0),
        "restart": opts.recovery_restart_s if opts.recovery_restart_s is not None else recovery["restart"],
        "per-step": opts.recovery_per_step_s if opts.recovery_per_step_s is not None else recovery["per-step"],
        "per-step-groups": opts.recovery_groups_s,
    }
    source = f"measured in {opts.run}: {', '.join(sorted(measured)) or 'nothing usable'}" if opts.run else "given"
    return given, source


def _measured(run: str) -> tuple[dict[str, float], str]:
    from raytrain.rundir import RunDir

    files = RunDir(run)
    summary = files.summary() if files.exists() else None
    if summary is None:
        try:
            files.store.read_text("summary.json")
        except (FileNotFoundError, NotADirectoryError):
            why = f"no summary.json in {run}; give the directory of a finished raytrain train run"
            raise ConfigError([("run", why)]) from None
        why = f"{run}/summary.json is not a raytrain summary (not JSON, or no status in it)"
        fix = f"`raytrain report {run}` shows the run, or give the directory of another finished run"
        raise ConfigError([("run", f"{why}; {fix}")])
    mode = str((files.config() or {}).get("fault_tolerance") or "restart")
    return measured_costs(summary.goodput, summary.get("checkpoint_wait_s")), mode


def scenarios(opts: PlanOptions) -> list[Scenario]:
    """One scenario per worker count, checked (ConfigError naming each option)."""
    costs, _ = inputs(opts)
    built = [
        Scenario(
            workers=n,
            gpus_per_node=opts.gpus_per_node,
            node_mtbf_s=opts.mtbf_hours * HOUR_S,
            step_s=costs["step_s"],
            stall_s=costs["stall_s"],
            write_s=opts.checkpoint_gb / opts.storage_gbps if opts.storage_gbps > 0 else 0.0,
            recovery_s={mode: costs[mode] for mode in MODES},
            replace_s=opts.replace_s,
            group_size=min(DEFAULT_GROUP_SIZE, n) if opts.replica_group_size is None else opts.replica_group_size,
            detection_s=opts.detection_s,
            preemptions_per_node_day=opts.preemptions_per_node_day,
            preemption_notice_s=opts.preemption_notice_s,
        )
        for n in planned_counts(opts.workers)
    ]
    # the MTBF as the user gave it, in hours (the scenario holds seconds)
    problems = [(OPTION_OF.get(name, name), why) for name, why in built[0].check() if name != "node_mtbf_s"]
    if not 0 < opts.mtbf_hours < float("inf"):
        problems.append(("mtbf_hours", f"got {opts.mtbf_hours}; must be a positive number of hours per node"))
    if not opts.storage_gbps > 0:
        problems.append(("storage_gbps", f"got {opts.storage_gbps}; must be a positive number of GB/s"))
    if opts.checkpoint_gb < 0:
        problems.append(("checkpoint_gb", f"got {opts.checkpoint_gb}; must be 0 or more"))
    k = opts.replica_group_size
    uneven = [n for n in planned_counts(opts.workers) if n % k] if k is not None and k >= 1 else []
    if uneven:
        # as `train` refuses them: a replica group is whole or holds no model
        problems.append(
            (
                "replica_group_size",
                f"got {k} with --workers {opts.workers}: {', '.join(map(str, uneven))} "
                f"{'is' if len(uneven) == 1 else 'are'} not a whole number of groups of {k} (train refuses that "
                "count); give worker counts that are multiples of it, or a --replica-group-size that divides each",
            )
        )
    if problems:
        raise ConfigError(sorted(set(problems)))
    return built


# The planner's options by the scenario input they set.
OPTION_OF = {
    "node_mtbf_s": "mtbf_hours",
    "step_s": "step_time_s",
    "stall_s": "checkpoint_stall_s",
    "write_s": "checkpoint_gb",
    "group_size": "replica_group_size",
    "detection_s": "detection_s",
    "recovery_s.restart": "recovery_restart_s",
    "recovery_s.per-step": "recovery_per_step_s",
    "recovery_s.per-step-groups": "recovery_groups_s",
}


def run_plan(opts: PlanOptions, echo: Callable[[str], None] = print) -> list[ModeGoodput]:
    """Tabulate each mode's best interval and goodput per worker count; draw goodput against
    the worker count into `opts.plot`."""
    built = scenarios(opts)
    costs, source = inputs(opts)
    predictions = [goodput.best(s, mode) for s in built for mode in MODES]
    preempted = opts.preemptions_per_node_day > 0
    preemptions = (
        f"; {opts.preemptions_per_node_day:g} preemptions per node-day, {opts.preemption_notice_s:.3g} s notice"
    )
    echo(
        f"Goodput on paper ({source}): a step {costs['step_s']:.3g} s, a save stalls {costs['stall_s']:.3g} s"
        f" and is durable {built[0].write_s:.3g} s later; recovery: restart {costs['restart']:.3g} s + "
        f"{opts.detection_s:.3g} s to find a silent node, per-step {costs['per-step']:.3g} s, per-step-groups "
        f"{costs['per-step-groups']:.3g} s (+ the lost node's share of a {opts.replace_s:.3g} s replacement); node "
        f"MTBF {_hours(opts.mtbf_hours)} h, {opts.gpus_per_node} GPUs a node{preemptions if preempted else ''}."
    )
    compared = preempted and opts.preemption_notice_s > 0
    # the same preemptions without notice, at their own best interval: what the notice is worth
    unnoticed = [
        [goodput.best(replace(s, preemption_notice_s=0.0), mode).goodput] if compared else []
        for s in built
        for mode in MODES
    ]
    header = ["workers", "nodes", "failures/day", "mode", "interval", "goodput"]
    header += ["no notice"] * compared + ["stalls", "recovery", "redone"]
    rows = [
        [p.workers, -(-p.workers // opts.gpus_per_node), f"{p.failures_per_day:.2f}", p.mode]
        + [f"{p.interval_steps:,} steps ({_duration(p.interval_steps * costs['step_s'])})"]
        + [f"{share:.1%}" for share in (p.goodput, *without, p.stalls, p.recovery, p.redone)]
        for p, without in zip(predictions, unnoticed)
    ]
    echo("\n".join(text_table(header, rows, left=(3, 4))))
    if preempted:
        echo(notice_saves(built[-1], opts.preemption_notice_s))
    starved = sorted({p.workers for p in predictions if p.goodput < 0.0005})
    if starved:
        fewest = next(s for s in built if s.workers == starved[0])
        echo(
            f"At {', '.join(map(str, starved))} workers a failure comes before a step and a save complete (at "
            f"{starved[0]} workers one every {goodput.restart_mtbf_s(fewest, 'restart'):.3g} s, a step "
            f"{costs['step_s']:.3g} s and a save {costs['stall_s']:.3g} s): nothing is kept at any interval; check "
            "--mtbf-hours and --step-time-s"
        )
    path = draw(predictions, Path(opts.plot))
    echo(f"Goodput against worker count: {path}")
    return predictions


def notice_saves(largest: Scenario, notice_s: float) -> str:
    """What a notice saves at the largest worker count, per mode: the notice given, or where it is too
    short to keep a preempted node's steps, the shortest that would."""
    needed = goodput.notice_needed_s(largest)
    noticed = replace(largest, preemption_notice_s=max(notice_s, needed))
    gains = ", ".join(
        f"{mode} {goodput.best(replace(largest, preemption_notice_s=0.0), mode).goodput:.1%} → "
        f"{goodput.best(noticed, mode).goodput:.1%}"
        for mode in MODES
    )
    at = f"at {largest.workers} workers ({largest.nodes * largest.preemptions_per_node_day:,.3g} preemptions a day)"
    if notice_s >= needed:
        return f"The {notice_s:.3g} s notice keeps every preempted step; goodput without it → with it, {at}: {gains}."
    short = (
        "Without notice a preemption is a failure"
        if notice_s == 0
        else f"A {notice_s:.3g} s notice is too short to save: a preemption still rolls back to the last save"
    )
    why = "the step under way, a save's stall and its write"
    return f"{short}; a notice of {needed:.3g} s ({why}) would take goodput, {at}: {gains}."


def _hours(hours: float) -> str:
    return f"{hours:,.0f}" if hours >= 10 else f"{hours:.3g}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def draw(predictions: list[ModeGoodput], path: Path) -> Path:
    """Goodput against the worker count, a line per mode (log scale of workers)."""
    fig = figure(7.5, 3.6, layout="constrained")
    axes = fig.add_subplot()
    for mode in MODES:
        points = sorted((p.workers, p.goodput) for p in predictions if p.mode == mode)
        axes.plot([x for x, _ in points], [100 * y for _, y in points], "o-", label=f"{mode} (best interval)")
    axes.set_xscale("log", base=2)
    counts = sorted({p.workers for p in predictions})
    axes.set_xticks(counts, labels=[f"{n:,}" for n in counts])
    axes.minorticks_off()
    axes.set(title="Expected goodput at the best checkpoint interval", xlabel="workers (GPUs)", ylabel="goodput %")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
