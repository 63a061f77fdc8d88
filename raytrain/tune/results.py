"""What a sweep leaves: trials.csv, best.yaml, trials.png and the console's closing table.

The per-trial results come from what Tune received (each trial's epoch-end reports, kept by
the driver's console callback); a trial's run directory is read, through `RunDir`, only
where Tune has nothing (a trial that failed before its first report) and for the time its
training began (the plan event). No Ray here.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from raytrain.config import TrainConfig
from raytrain.driver.summary import final_figures
from raytrain.observe.render import figure, text_table
from raytrain.rundir import Kind, RunDir, Store, Summary, write_yaml
from raytrain.text import is_number, plural, sci
from raytrain.tune.options import SWEPT, TuneOptions
from raytrain.tune.space import SweepRun, point_key, runs_by_point, trial_config

# Set on a report whose `metric` was not finite: the value Tune got is a stand-in (the worst
# finite value, so that ASHA can stop the trial); the results read it as missing.
SUBSTITUTED = "metric_substituted"


@dataclass
class TrialRun:
    """What Tune saw of one trial (one run of the sweep)."""

    name: str
    point: dict[str, Any]
    """The planned point it ran as (without lr when Tune drew it: see `lr`)."""
    status: str
    """finished, stopped (by ASHA), failed, or Tune's state of a trial that never ran."""
    reported: list[dict[str, Any]] = field(default_factory=list)
    """The results Tune received, in order (rank 0's epoch-end rows)."""
    lr: float | None = None
    """The base rate Tune drew from `lr_range`, if it drew one."""
    started: float | None = None
    ended: float | None = None
    error: str = ""


@dataclass
class SweepResult:
    """What `tune()` returns."""

    sweep_dir: str
    trials: list[dict[str, Any]]
    """One row per grid point, as in trials.csv (points that share a run share its results)."""
    best: dict[str, Any] | None
    """The winning row (best final metric among finished trials); None if none finished."""
    best_per_workers: dict[int, dict[str, Any]]
    best_config_path: str | None
    wall_time_s: float
    leaked_placement_groups: int


# -- per-trial results -----------------------------------------------------------------------


def sweep_rows(
    trials: Sequence[TrialRun],
    runs: Sequence[SweepRun],
    points: Sequence[dict[str, Any]],
    options: TuneOptions,
    sweep_dir: "Path | Store",
    epochs: int,
) -> tuple[list[dict[str, Any]], dict[str, list[tuple[int, float]]]]:
    """The rows of trials.csv, one per grid point in grid order (a run shared by several points
    gives each of them a row, marked in `same_run`), and each run's `metric` curve for the plot."""
    planned = runs_by_point(runs)
    order = {point_key(p): i for i, p in enumerate(points)}
    rows, curves = [], {}
    for index, trial in enumerate(trials):
        run_dir = Store.of(sweep_dir) / "trials" / trial.name
        reported_epoch = (trial.reported[-1].get("epoch", 0) or 0) if trial.reported else 0
        if trial.status == "stopped":
            mark_stopped(run_dir, reported_epoch, trial.started, trial.ended)
        # A stopped trial may have trained on for a moment: its results are what ASHA judged.
        horizon = reported_epoch if trial.status == "stopped" else epochs
        epoch_rows = trial_epoch_rows(trial.reported, run_dir, horizon)
        results = trial_results(epoch_rows, run_dir, options)
        metrics = results.pop("metrics")
        curves[trial.name] = [(r["epoch"], r[options.metric]) for r in epoch_rows if is_number(r.get(options.metric))]
        run = planned.get(point_key(trial.point))
        for point in run.points if run is not None else [trial.point]:
            values = {**point, **({"lr": trial.lr} if trial.lr is not None else {})}
            row = {
                "trial": trial.name,
                **{name: values[name] for name in SWEPT},
                **metrics,
                "status": trial.status,
                "same_run": run.rule_names if run is not None and run.shared else "",
                **results,
                "wall_time_s": round(trial.ended - trial.started, 1) if trial.started and trial.ended else None,
                "error": (trial.error or "failed") if trial.status == "failed" else "",
                "run_dir": run_dir.public_uri,
            }
            rows.append((order.get(point_key(point), len(order)), index, row))
    return [row for _, _, row in sorted(rows, key=lambda item: item[:2])], curves


def trial_epoch_rows(reported: Sequence[dict[str, Any]], run_dir: Path, horizon: int) -> list[dict[str, Any]]:
    """A trial's epoch-end rows up to `horizon`, one per epoch (an epoch redone after a restart:
    its last report), from what Tune received; from the run's metrics.jsonl only when Tune got
    nothing. A substituted metric (see SUBSTITUTED) reads as missing."""
    rows: list[dict[str, Any]] = [dict(r) for r in reported]
    if not rows:
        rows = [r.to_json() for r in RunDir(run_dir).epoch_rows()]
    by_epoch: dict[int, dict[str, Any]] = {}
    for row in rows:
        substituted = row.pop(SUBSTITUTED, None)
        if substituted:
            row[substituted] = None
        if 0 < (row.get("epoch") or 0) <= horizon:
            by_epoch[row["epoch"]] = row
    return [by_epoch[e] for e in sorted(by_epoch)]


def trial_results(rows: Sequence[dict[str, Any]], run_dir: Path, options: TuneOptions) -> dict[str, Any]:
    """From a trial's epoch-end rows: final and best (by `metric`) validation metrics, the
    epoch of the best, and the epochs and training time to `target` (time from the run's
    plan event, i.e. its first step, startup excluded, to the end of the epoch that reached it)."""
    names = sorted({k for r in rows for k in r if k.startswith("val_")} | {options.metric})
    scored = [r for r in rows if is_number(r.get(options.metric))]
    best = None
    for r in scored:
        if best is None or options.better(r[options.metric], best[options.metric]):
            best = r
    final = rows[-1] if rows else {}
    metrics = {f"final_{n}": final.get(n) for n in names}
    metrics.update({f"best_{n}": (best or {}).get(n) for n in names})
    hit = next((r for r in scored if options.reached(r[options.metric])), None)
    start = _training_start(run_dir) if hit else None
    return {
        "metrics": metrics,
        "best_epoch": best["epoch"] if best else None,
        "epochs": final.get("epoch", 0),
        "global_batch_size": final.get("global_batch_size"),
        "epochs_to_target": hit["epoch"] if hit else None,
        "time_to_target_s": round(hit["time_s"] - start, 2) if hit and start and is_number(hit.get("time_s")) else None,
        "goodput": _goodput(run_dir),
    }


def _goodput(run_dir: Path) -> float | None:
    """The trial's goodput (summary.json; raytrain.rules.accounting), when it wrote one."""
    summary = RunDir(run_dir).summary()
    return (summary.goodput or {}).get("goodput") if summary is not None else None


def _training_start(run_dir: Path) -> float | None:
    return next((e.time for e in RunDir(run_dir).events() if e.kind == Kind.PLAN), None)


def mark_stopped(run_dir: Path, epoch: int, started: float | None, ended: float | None) -> Summary:
    """A trial stopped by ASHA ends with its actor and Train controller killed: its run has no
    summary.json, or one that records the kill as a failure ("actor died"). Say what happened."""
    run = RunDir(run_dir)
    stopped = {"stopped_by": "ASHA", "stopped_after_epoch": epoch}
    summary = run.update_summary(status="stopped", error=None, **stopped)
    if summary is None:
        summary = _stopped_summary(run, started, ended, stopped)
        run.write_summary(summary)
    return summary


def _stopped_summary(run: RunDir, started: float | None, ended: float | None, extra: dict[str, Any]) -> Summary:
    """summary.json for a run killed before it wrote one, from its own records."""
    metrics = run.metrics()
    epoch_rows = [row for row in metrics if row.epoch_end]
    last = epoch_rows[-1] if epoch_rows else (metrics[-1] if metrics else None)
    progress = run.progress()
    figures, window = final_figures(metrics)
    return Summary(
        status="stopped",
        epochs=last.epoch if last else 0,
        steps=last.step if last else 0,
        samples_seen=last.samples_seen if last else 0,
        wall_time_s=round(ended - started, 3) if started and ended else 0.0,
        steady_samples_per_s=progress.steady_samples_per_s if progress else None,
        steady_steps=progress.steady_steps if progress else None,
        world_sizes=list(dict.fromkeys(row.world_size for row in metrics if row.world_size)),
        final_metrics=figures,
        final_loss_steps=window,
        extra=dict(extra),
    )


# -- ranking ---------------------------------------------------------------------------------


def ranked_trials(rows: list[dict[str, Any]], options: TuneOptions) -> list[dict[str, Any]]:
    """Finished trials, best first: with a target, the fewest epochs to reach it first; then
    the best final metric (ties keep grid order)."""
    key = f"final_{options.metric}"
    done = [r for r in rows if r["status"] == "finished" and is_number(r.get(key))]
    sign = 1 if options.mode == "min" else -1
    return sorted(
        done, key=lambda r: (r.get("epochs_to_target") or math.inf if options.target is not None else 0, sign * r[key])
    )


def best_per_worker_count(rows: list[dict[str, Any]], options: TuneOptions) -> dict[int, dict[str, Any]]:
    best: dict[int, dict[str, Any]] = {}
    for row in ranked_trials(rows, options):
        best.setdefault(row["workers"], row)
    return dict(sorted(best.items()))


def best_config(spec: str, base: TrainConfig, row: dict[str, Any]) -> dict[str, Any]:
    """The winning trial's configuration for `raytrain train --config`: `pipeline:` first,
    no name (a new run) and no resume."""
    values = trial_config(base, {k: row[k] for k in SWEPT}).to_dict()
    for key in ("name", "resume", "address", "verbose"):
        values.pop(key, None)
    return {"pipeline": spec, **values}


def tied_rules(row: dict[str, Any]) -> str:
    """`linear=sqrt=none` when the sweep planned `row`'s point as one run with other rules'
    points (at the reference batch the rules give the same rate: same run, same seed); else
    the row's own rule. The row's rule comes first."""
    return "=".join(dict.fromkeys([row["lr_scaling"], *filter(None, (row.get("same_run") or "").split("="))]))


# -- the files and the console ---------------------------------------------------------------


def write_sweep_files(
    spec: str,
    base: TrainConfig,
    options: TuneOptions,
    rows: list[dict[str, Any]],
    curves: dict[str, list[tuple[int, float]]],
    sweep_dir: Path,
    wall: float,
    leaked: int,
    echo: Callable[[str], None],
    shown_as: str | None = None,
) -> SweepResult:
    """trials.csv, best.yaml (when a trial finished), trials.png, then the closing table
    (`shown_as`: where the files end up, when `sweep_dir` is only where they are written)."""
    write_csv(sweep_dir / "trials.csv", rows)
    ranked = ranked_trials(rows, options)
    best = min(ranked, key=lambda r: (1 if options.mode == "min" else -1) * r[f"final_{options.metric}"], default=None)
    best_path = None
    if best is not None:
        best_path = sweep_dir / "best.yaml"
        write_yaml(best_path, best_config(spec, base, best))
    plot_trials(sweep_dir / "trials.png", rows, base.epochs, options, curves)
    per_workers = best_per_worker_count(rows, options)
    where = shown_as or str(sweep_dir)
    shown_best = f"{where}/best.yaml" if best_path and shown_as else best_path
    for line in closing_table(rows, per_workers, best, options, wall, where, shown_best):
        echo(line)
    return SweepResult(
        sweep_dir=str(sweep_dir),
        trials=rows,
        best=best,
        best_per_workers=per_workers,
        best_config_path=str(best_path) if best_path else None,
        wall_time_s=round(wall, 1),
        leaked_placement_groups=leaked,
    )


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Columns: the trial and its swept values, the final then the best metrics, the rest."""
    seen: list[str] = []
    for row in rows:
        seen += [k for k in row if k not in seen]
    metrics = sorted(k for k in seen if k.startswith("final_")) + sorted(
        k for k in seen if k.startswith("best_") and k != "best_epoch"
    )
    lead = ["trial", *SWEPT]
    columns = lead + metrics + [k for k in seen if k not in lead and k not in metrics]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})


def closing_table(rows, per_workers, best, options, wall, sweep_dir, best_path) -> list[str]:
    """The console's last lines: per worker count, the best (rule, warmup) and its time to target."""
    metric = options.metric
    counts = {s: sum(r["status"] == s for r in rows) for s in ("finished", "stopped", "failed")}
    target, ranking = "", ""
    if options.target is not None:
        target = f"; target {metric} {'≤' if options.mode == 'min' else '≥'} {options.target:g}"
        ranking = "fewest epochs to target, then "
    table = []
    for workers in sorted({r["workers"] for r in rows}):
        row = per_workers.get(workers)
        if row is None:
            table.append([workers, "no trial finished"])
            continue
        table.append(
            [
                workers,
                tied_rules(row),
                f"{row['warmup_epochs']:g}",
                sci(row["lr"]),
                f"{row[f'final_{metric}']:.4f}",
                _target_text(row, options),
            ]
        )
    runs = len({r["trial"] for r in rows})
    shared = f" ({runs} runs: rules that give the same rate share one)" if runs < len(rows) else ""
    lines = [
        "",
        f"Best per worker count ({ranking}final {metric}, {options.mode}; finished trials{target}):",
        *text_table(
            ["workers", "lr_scaling", "warmup", "lr", metric, "time to target"], table, left=(1, 5), indent="  "
        ),
        f"{len(rows)} trials{shared} in {wall:.0f} s: {counts['finished']} finished, {counts['stopped']} stopped "
        f"early by ASHA, {counts['failed']} failed. Files in {sweep_dir}: trials.csv, trials.png"
        + (", best.yaml" if best_path else ""),
    ]
    if best is not None:
        lines.append(
            f"Best: {plural(best['workers'], 'worker')}, {best['lr_scaling']}, warmup {best['warmup_epochs']:g}, lr "
            f"{sci(best['lr'])} ({metric} {best[f'final_{metric}']:.4f}); train it: raytrain train --config {best_path}"
        )
    else:
        lines.append("No trial finished: no best.yaml. See trials.csv (status, error) and the trials/ run directories.")
    return lines


def _target_text(row: dict[str, Any], options: TuneOptions) -> str:
    if options.target is None:
        return "— (no --target)"
    if row.get("epochs_to_target") is None:
        return "not reached"
    seconds = row.get("time_to_target_s")
    return (f"{seconds:.1f} s" if seconds is not None else "?") + f" (epoch {row['epochs_to_target']})"


def plot_trials(
    path: Path,
    rows: list[dict[str, Any]],
    epochs: int,
    options: TuneOptions,
    curves: dict[str, list[tuple[int, float]]] | None = None,
) -> None:
    """Validation `metric` per run vs epoch: one panel per worker count, colour = lr scaling
    rule, line style = warmup, marker = base lr; a trial stopped by ASHA ends with ×. A run
    shared by several rules is drawn once, labelled `linear=sqrt=none`. The curves are the
    runs' reports (`curves`, by trial name), else read from each row's run directory."""
    from matplotlib.ticker import MaxNLocator

    counts = sorted({r["workers"] for r in rows}) or [1]
    fig = figure(4.2 * len(counts) + 1.5, 4)
    axes = fig.subplots(1, len(counts), sharey=True, squeeze=False)
    colors = {"linear": "tab:blue", "sqrt": "tab:orange", "none": "tab:green"}
    warmups = sorted({r["warmup_epochs"] for r in rows})
    styles = dict(zip(warmups, ["-", "--", ":", "-."] * 4))
    lrs = sorted({r["lr"] for r in rows})
    markers = dict(zip(lrs, "osD^vP*X<>" * (len(lrs) // 10 + 1)))
    positive, drawn = True, set()
    for ax, workers in zip(axes[0], counts):
        for row in (r for r in rows if r["workers"] == workers):
            if row.get("trial") is not None and row["trial"] in drawn:
                continue
            drawn.add(row.get("trial"))
            points = _curve(row, options, curves)
            if not points:
                continue
            xs, ys = zip(*points)
            positive = positive and min(ys) > 0
            label = f"{tied_rules(row)}, warmup {row['warmup_epochs']:g}" + (
                f", lr {sci(row['lr'])}" if len(lrs) > 1 else ""
            )
            style = {"color": colors.get(row["lr_scaling"]), "marker": markers[row["lr"]], "markersize": 4}
            ax.plot(xs, ys, styles[row["warmup_epochs"]], label=label, **style)
            if row["status"] == "stopped":
                ax.plot(xs[-1:], ys[-1:], "x", color="black", markersize=8)
        if options.target is not None:
            ax.axhline(options.target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(plural(workers, "worker"))
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0.8, epochs + 0.2)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, handlelength=3)
    axes[0][0].set_ylabel(options.metric)
    if positive:
        axes[0][0].set_yscale("log")
    fig.suptitle(f"{options.metric} per trial (× = stopped by ASHA)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _curve(
    row: dict[str, Any], options: TuneOptions, curves: dict[str, list[tuple[int, float]]] | None
) -> list[tuple[int, float]]:
    if curves is not None and row.get("trial") in curves:
        return curves[row["trial"]]
    horizon = row.get("epochs") or 0
    return [
        (m.epoch, m.get(options.metric))
        for m in RunDir(row["run_dir"]).epoch_rows()
        if m.epoch <= horizon and is_number(m.get(options.metric))
    ]
