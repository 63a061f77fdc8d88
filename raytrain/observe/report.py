"""`raytrain report RUN_DIR`: the run as pictures and one Markdown page.

Reads the run files (metrics.jsonl, events.jsonl, summary.json, config.yaml) and writes

    RUN_DIR/report.md          summary, per-epoch table, resizes and restarts, plots
    RUN_DIR/plots/loss.png     training loss per logged window and per epoch, validation loss
    RUN_DIR/plots/val.png      validation metrics per pass (when the pipeline has any)
    RUN_DIR/plots/lr.png       the learning rate schedule (warmup, decay, rescaling)
    RUN_DIR/plots/workers.png  world size and global batch over wall time, resizes marked
    RUN_DIR/plots/throughput.png  samples/s per logged window and per epoch
    RUN_DIR/plots/ranks.png    each rank's own step time (a multi-worker run; `ranks`)

It runs at the end of every `raytrain train` and works on a partial or failed run.
Plots use matplotlib's Agg canvas directly (no pyplot, no display, no global state).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain.errors import UserError
from raytrain.observe.goodput import goodput_section
from raytrain.observe.ranks import plot_rank_times, rank_section
from raytrain.observe.render import event_line, figure, flatten, markdown_table
from raytrain.rules import flops
from raytrain.rundir import EPOCH_LOSS, PLOTS, REPORT, Event, Kind, MetricsRow, RunDir, Store, Summary
from raytrain.rundir.records import Goodput
from raytrain.text import is_number, plural


class ReportError(UserError, ValueError):
    """RUN_DIR is not a run directory."""


@dataclass
class RunRecord:
    """What the run files say."""

    run_dir: Store
    rows: list[MetricsRow]
    events: list[Event]
    summary: Summary | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def step_rows(self) -> list[MetricsRow]:
        return [row for row in self.rows if not row.epoch_end]

    @property
    def epoch_rows(self) -> list[MetricsRow]:
        return [row for row in self.rows if row.epoch_end]

    @property
    def marked_events(self) -> list[Event]:
        return [e for e in self.events if e.kind in Kind.MARKED]

    @property
    def validated_rows(self) -> list[MetricsRow]:
        """The rows of validation passes: every epoch's, and those of --eval-every-steps."""
        return [row for row in self.rows if row.validation]

    @property
    def val_names(self) -> list[str]:
        return sorted({key for row in self.validated_rows for key in row.validation})

    @property
    def start_time(self) -> float | None:
        times = [row.time_s for row in self.rows if is_number(row.time_s)] + [
            e.time for e in self.events if is_number(e.time)
        ]
        return min(times) if times else None


def load_run(run_dir: "str | Path | Store") -> RunRecord:
    run_dir = Store.of(run_dir)
    if run_dir.info().type.name != "Directory":
        raise ReportError(
            f"{run_dir} is not a directory; give a run directory (STORAGE/NAME, e.g. ~/raytrain_results/digits-... "
            "or s3://BUCKET/PREFIX/NAME)"
        )
    files = RunDir(run_dir)
    if not files.exists():
        raise ReportError(
            f"{run_dir} is not a raytrain run directory: it has no metrics.jsonl, config.yaml or summary.json"
        )
    return RunRecord(
        run_dir=run_dir, rows=files.metrics(), events=files.events(), summary=files.summary(), config=files.config()
    )


def write_report(run_dir: "str | Path | Store") -> Store:
    """Write plots/ and report.md into `run_dir`; returns the report's location (on an object
    store the plots are drawn on this machine and uploaded)."""
    run = load_run(run_dir)
    store = run.run_dir
    with store.write_locally() as local:
        plots = write_plots(run, local / PLOTS)
    store.write_text(REPORT, render_markdown(run, plots))
    return store / REPORT


# -- plots -----------------------------------------------------------------------------------


def write_plots(run: RunRecord, directory: Path) -> dict[str, Path]:
    """The PNGs this run has data for, by name."""
    if not run.rows:
        return {}
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, draw in (
        ("loss", _plot_loss),
        ("val", _plot_val),
        ("lr", _plot_lr),
        ("workers", _plot_workers),
        ("throughput", _plot_throughput),
        ("ranks", lambda run, figure: plot_rank_times(run.step_rows, run.events, figure)),
    ):
        figure = _new_figure()
        if draw(run, figure) is False:
            continue
        path = directory / f"{name}.png"
        figure.savefig(path, dpi=110)
        written[name] = path
    return written


def _new_figure():
    return figure(7.5, 3.2, layout="constrained")


def _series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(row.get(x), row.get(y)) for row in rows if is_number(row.get(x)) and is_number(row.get(y))]
    return [p[0] for p in points], [p[1] for p in points]


def _mark_epochs_and_events(axes, run: RunRecord) -> None:
    """Dotted lines at epoch ends, red dashes at resizes and restarts (by step)."""
    for row in run.epoch_rows:
        axes.axvline(row.step, color="0.85", linewidth=0.8, linestyle=":", zorder=0)
    marked = [e for e in run.marked_events if is_number(e.step)]
    for index, event in enumerate(marked):
        label = "resize / restart (from step)" if index == 0 else None
        axes.axvline(event.step, color="tab:red", linewidth=1, linestyle="--", alpha=0.6, zorder=0, label=label)


def _line(axes, rows: list[MetricsRow], y: str, *style: str, **options: Any) -> None:
    """`y` against the step over `rows`, where any row has both."""
    x, values = _series(rows, "step", y)
    if x:
        axes.plot(x, values, *style, **options)


def _by_step(axes, run: RunRecord, title: str, ylabel: str) -> bool:
    """A plot against the optimizer step finished: epoch ends and events marked, titled, legend, grid."""
    _mark_epochs_and_events(axes, run)
    axes.set(title=title, xlabel="optimizer step", ylabel=ylabel)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return True


def _plot_loss(run: RunRecord, figure) -> bool:
    axes = figure.add_subplot()
    # every row's loss is its window's, an epoch's row's too
    _line(axes, run.rows, "loss", color="tab:blue", linewidth=1, alpha=0.7, label="train (per logged window)")
    _line(axes, run.epoch_rows, EPOCH_LOSS, "o-", color="tab:blue", label="train (epoch mean)")
    _line(axes, run.validated_rows, "val_loss", "s-", color="tab:orange", label="validation")
    if not axes.lines:
        return False
    if all(v > 0 for line in axes.lines for v in line.get_ydata()) and _spread(axes) > 20:
        axes.set_yscale("log")  # losses spanning orders of magnitude
    return _by_step(axes, run, "Loss", "loss")


def _plot_val(run: RunRecord, figure) -> bool:
    names = [name for name in run.val_names if name != "val_loss"]
    if not names:
        return False
    axes = figure.add_subplot()
    for name in names:
        x, y = _series(run.validated_rows, "step", name)
        axes.plot(x, y, "o-", label=name[4:])
    return _by_step(axes, run, "Validation metrics", "value")


def _plot_lr(run: RunRecord, figure) -> bool:
    x, y = _series(sorted(run.rows, key=lambda row: row.step), "step", "lr")
    if not x:
        return False
    axes = figure.add_subplot()
    axes.plot(x, y, ".-", color="tab:green", markersize=3)
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    return _by_step(axes, run, "Learning rate", "lr")


def _plot_workers(run: RunRecord, figure) -> bool:
    start = run.start_time
    rows = [row for row in run.rows if is_number(row.time_s) and row.world_size]
    if start is None or not rows:
        return False
    rows.sort(key=lambda row: row.time_s)
    scale, unit = _time_unit(rows[-1].time_s - start)
    times = [(row.time_s - start) / scale for row in rows]
    axes = figure.add_subplot()
    axes.step(times, [row.world_size for row in rows], where="post", color="tab:purple", label="workers")
    axes.set(title="Workers over time", xlabel=f"{unit} since start", ylabel="world size")
    axes.set_ylim(0, max(row.world_size for row in rows) + 1)
    axes.yaxis.get_major_locator().set_params(integer=True)
    batch = axes.twinx()
    sizes = [row.global_batch_size or math.nan for row in rows]
    batch.step(times, sizes, where="post", color="tab:gray", linestyle="--", label="global batch")
    batch.set_ylabel("global batch")
    batch.set_ylim(0, max((row.global_batch_size or 0) for row in rows) * 1.2 + 1)
    for event in run.marked_events:
        if is_number(event.time):
            at = (event.time - start) / scale
            axes.axvline(at, color="tab:red", linewidth=1, linestyle="--", alpha=0.6)
            style = {"fontsize": "x-small", "color": "tab:red", "rotation": 90, "va": "top", "ha": "right"}
            axes.annotate(event.kind, (at, axes.get_ylim()[1] * 0.95), **style)
    handles = axes.get_legend_handles_labels()[0] + batch.get_legend_handles_labels()[0]
    axes.legend(handles, [h.get_label() for h in handles], fontsize="small", loc="lower right")
    axes.grid(alpha=0.3)
    return True


def _plot_throughput(run: RunRecord, figure) -> bool:
    axes = figure.add_subplot()
    _line(axes, run.step_rows, "samples_per_s", color="tab:cyan", linewidth=1, label="per logged window")
    _line(axes, run.epoch_rows, "samples_per_s", "o-", color="tab:blue", label="epoch mean")
    if not axes.lines:
        return False
    steady = run.summary.steady_samples_per_s if run.summary else None
    if is_number(steady):
        axes.axhline(steady, color="tab:green", linestyle="--", label=f"steady {steady:,.0f}/s")
    axes.set_ylim(bottom=0)
    return _by_step(axes, run, "Throughput", "samples/s")


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s < 120:
        return 1.0, "seconds"
    return (60.0, "minutes") if span_s < 7200 else (3600.0, "hours")


def _spread(axes) -> float:
    values = [v for line in axes.lines for v in line.get_ydata() if is_number(v)]
    return max(values) / min(values) if values and min(values) > 0 else 1.0


# -- Markdown --------------------------------------------------------------------------------


def render_markdown(run: RunRecord, plots: dict[str, Path]) -> str:
    s, cfg = run.summary, run.config
    name = cfg.get("name") or run.run_dir.name
    lines = [f"# {name}", ""]
    lines += [_headline(run), ""]
    if s and s.error:
        lines += [f"**Error:** {s.error}", ""]
    if s and s.get("cost"):
        lines += [f"Cost: {flops.describe_cost(s.get('cost'))}.", ""]
    if s and s.goodput:
        lines += goodput_section(Goodput.from_json(s.goodput))
    if s and s.compile:
        lines += [_compiled(s.compile), ""]
    if s and s.final_metrics:
        labelled = [(final_label(key, s), _fmt(value)) for key, value in s.final_metrics.items()]
        lines += [*markdown_table(["final metric", "value"], labelled), ""]
    lines += _epoch_table(run)
    if run.marked_events:
        start = run.start_time or 0
        lines += ["## Resizes and restarts", ""]
        lines += [event_line(e, start) for e in run.marked_events]
        lines.append("")
    lines += rank_section(run.step_rows, run.events, run.start_time)
    if plots:
        lines += ["## Plots", ""]
        for key, path in plots.items():
            lines += [f"![{key}]({PLOTS}/{path.name})", ""]
    if cfg:
        options = [(key, _fmt(value, "option")) for key, value in flatten(cfg).items()]
        lines += ["## Configuration", "", *markdown_table(["option", "value"], options), ""]
    plan = next((e.message for e in run.events if e.kind == Kind.PLAN), None)
    if plan:
        lines += [f"Batch plan and learning rate: `{plan}`", ""]
    lines += [
        "## Files",
        "",
        "config.yaml (resolved configuration), metrics.jsonl (one row per report), events.jsonl (plan, epochs, "
        "resizes, restarts), summary.json, model.pt (plain state_dict). "
        f"TensorBoard: `tensorboard --logdir {run.run_dir}`.",
        "",
        f"_Written by `raytrain report` at {time.strftime('%Y-%m-%d %H:%M:%S')}._",
        "",
    ]
    return "\n".join(lines)


def _headline(run: RunRecord) -> str:
    s, cfg = run.summary, run.config
    rows = run.rows
    last = rows[-1] if rows else None
    status = s.status if s else ("running or interrupted" if rows else "no metrics yet")
    parts = [f"**{status}**"]
    if cfg.get("pipeline"):
        parts.append(f"pipeline `{cfg['pipeline']}`")
    epochs = s.epochs if s else max((row.epoch for row in run.epoch_rows), default=0)
    parts.append(f"{epochs}/{cfg['epochs']} epochs" if cfg.get("epochs") else plural(epochs, "epoch"))
    steps = s.steps if s else (last.step if last else 0)
    parts.append(f"{steps:,}/{cfg['max_steps']:,} steps" if cfg.get("max_steps") else f"{steps:,} steps")
    parts.append(f"{s.samples_seen if s else (last.samples_seen if last else 0):,} samples")
    if s and is_number(s.wall_time_s):
        starts = f" over {s.starts} starts" if (s.starts or 1) > 1 else ""
        parts.append(f"{s.wall_time_s:.1f} s wall{starts}")
    if s and is_number(s.steady_samples_per_s):
        parts.append(f"{s.steady_samples_per_s:,.0f} samples/s steady")
    sizes = (s.world_sizes if s else None) or _distinct([row.world_size for row in rows])
    if sizes:
        parts.append(f"workers {' → '.join(map(str, sizes))}")
    if s:
        parts.append(f"{plural(s.failures_recovered, 'failure')} recovered")
        if s.preemptions:
            parts.append(f"{plural(s.preemptions, 'preemption')} trained through")
        if s.goodput and is_number(s.goodput.get("goodput")):
            parts.append(f"goodput {s.goodput['goodput']:.0%}")
        if s.resumes:
            parts.append("resumed from a checkpoint")
        if s.checkpoints_skipped:
            parts.append(f"{plural(s.checkpoints_skipped, 'unusable checkpoint')} skipped")
    return " · ".join(parts)


def _epoch_table(run: RunRecord) -> list[str]:
    if not run.epoch_rows:
        return []
    names = sorted({key for row in run.epoch_rows for key in row.validation})
    head = ["epoch", "step", "epoch_loss", "loss (last window)", *names, "lr", "samples/s", "workers", "global batch"]
    cells = [
        [row.epoch, row.step, row.get(EPOCH_LOSS), row.loss, *[row.get(n) for n in names], row.lr]
        + [row.samples_per_s, row.world_size, row.global_batch_size]
        for row in run.epoch_rows
    ]
    return [
        "## Epochs",
        "",
        *markdown_table(head, [[_fmt(cell, key) for cell, key in zip(line, head)] for line in cells]),
        "",
    ]


def _compiled(figures: dict) -> str:
    """summary.json's `compile` in a sentence: what --compile built, or that the model ran eager."""
    graphs, seconds = figures.get("graphs"), figures.get("seconds")
    if not graphs:
        return "Compile: not counted (no sync after the first steps); not reported compiled."
    counted = f"graphs built by rank {', '.join(map(str, graphs))}, in {', '.join(f'{t:.1f}' for t in seconds)} s"
    if figures.get("compiled"):
        return f"Compile: {counted}."
    eager = ", ".join(str(rank) for rank, built in enumerate(graphs) if built == 0)
    return f"Compile: **not compiled** on rank {eager}, which ran eager ({counted})."


def final_label(key: str, summary: Summary) -> str:
    """A final metric with what it is the mean of: `loss (last window: steps 291–300)`."""
    if key == "loss" and summary.final_loss_steps:
        first, last = summary.final_loss_steps
        return f"loss (last window: steps {first:,}–{last:,})" if first < last else f"loss (last window: step {last:,})"
    if key == EPOCH_LOSS:
        return f"{EPOCH_LOSS} (mean over the last epoch)"
    return key


def _fmt(value: Any, key: str = "") -> str:
    """A table cell: thousands separators for counts and rates, 4 decimals for losses and
    metrics, scientific for learning rates."""
    if isinstance(value, float) and math.isfinite(value) and key != "option":
        if key == "lr":
            return f"{value:.2e}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3e}"
    if isinstance(value, int) and not isinstance(value, bool) and key not in ("epoch", "option"):
        return f"{value:,}"
    return "" if value is None else str(value)


def _distinct(values: list[Any]) -> list[Any]:
    out = []
    for value in values:
        if value is not None and (not out or out[-1] != value):
            out.append(value)
    return out
