"""`raytrain report RUN_DIR`: the run as pictures and one Markdown page.

Reads the run files (metrics.jsonl, events.jsonl, summary.json, config.yaml) and writes

    RUN_DIR/report.md          summary, per-epoch table, resizes and restarts, plots
    RUN_DIR/plots/loss.png     training loss per logged window and per epoch, validation loss
    RUN_DIR/plots/val.png      validation metrics per epoch (when the pipeline has any)
    RUN_DIR/plots/lr.png       the learning rate schedule (warmup, decay, rescaling)
    RUN_DIR/plots/workers.png  world size and global batch over wall time, resizes marked
    RUN_DIR/plots/throughput.png  samples/s per logged window and per epoch

It runs at the end of every `raytrain train` and works on a partial or failed run.
Plots use matplotlib's Agg canvas directly (no pyplot, no display, no global state).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raytrain.errors import UserFault

PLOTS_DIR = "plots"
REPORT_FILE = "report.md"
# Events worth a line in the report and a mark on the plots.
MARKED_EVENTS = ("resize", "restore")


class ReportError(UserFault, ValueError):
    """RUN_DIR is not a run directory."""


@dataclass
class RunRecord:
    """What the run files say."""

    run_dir: Path
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def step_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if not row.get("epoch_end")]

    @property
    def epoch_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if row.get("epoch_end")]

    @property
    def val_names(self) -> list[str]:
        return sorted({key for row in self.epoch_rows for key in row if key.startswith("val_")})

    @property
    def start_time(self) -> float | None:
        times = [row["time_s"] for row in self.rows if _finite(row.get("time_s"))] + [e["time"] for e in self.events if _finite(e.get("time"))]
        return min(times) if times else None


def load_run(run_dir: str | Path) -> RunRecord:
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; give a run directory (STORAGE/NAME, e.g. ~/raytrain_results/digits-...)")
    if not any((run_dir / name).exists() for name in ("metrics.jsonl", "config.yaml", "summary.json")):
        raise ReportError(f"{run_dir} is not a raytrain run directory: it has no metrics.jsonl, config.yaml or summary.json")
    return RunRecord(
        run_dir=run_dir,
        rows=_read_jsonl(run_dir / "metrics.jsonl"),
        events=_read_jsonl(run_dir / "events.jsonl"),
        summary=_read_json(run_dir / "summary.json"),
        config=_read_yaml(run_dir / "config.yaml"),
    )


def write_report(run_dir: str | Path) -> Path:
    """Write plots/ and report.md into `run_dir`; returns the report's path."""
    run = load_run(run_dir)
    plots = write_plots(run, run.run_dir / PLOTS_DIR)
    path = run.run_dir / REPORT_FILE
    path.write_text(render_markdown(run, plots))
    return path


# -- plots -----------------------------------------------------------------------------------


def write_plots(run: RunRecord, directory: Path) -> dict[str, Path]:
    """The PNGs this run has data for, by name."""
    if not run.rows:
        return {}
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, draw in (("loss", _plot_loss), ("val", _plot_val), ("lr", _plot_lr), ("workers", _plot_workers), ("throughput", _plot_throughput)):
        figure = _figure()
        if draw(run, figure) is False:
            continue
        path = directory / f"{name}.png"
        figure.savefig(path, dpi=110)
        written[name] = path
    return written


def _figure(rows: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(row[x], row[y]) for row in rows if _finite(row.get(x)) and _finite(row.get(y))]
    return [p[0] for p in points], [p[1] for p in points]


def _mark_epochs_and_events(axes, run: RunRecord) -> None:
    """Dotted lines at epoch ends, red dashes at resizes and restarts (by step)."""
    for row in run.epoch_rows:
        axes.axvline(row["step"], color="0.85", linewidth=0.8, linestyle=":", zorder=0)
    marked = [e for e in run.events if e.get("kind") in MARKED_EVENTS and _finite(e.get("step"))]
    for index, event in enumerate(marked):
        label = "resize / restart (from step)" if index == 0 else None
        axes.axvline(event["step"], color="tab:red", linewidth=1, linestyle="--", alpha=0.6, zorder=0, label=label)


def _plot_loss(run: RunRecord, figure) -> bool:
    axes = figure.add_subplot()
    x, y = _series(run.step_rows, "step", "loss")
    if x:
        axes.plot(x, y, color="tab:blue", linewidth=1, alpha=0.7, label="train (per logged window)")
    x, y = _series(run.epoch_rows, "step", "loss")
    if x:
        axes.plot(x, y, "o-", color="tab:blue", label="train (epoch mean)")
    x, y = _series(run.epoch_rows, "step", "val_loss")
    if x:
        axes.plot(x, y, "s-", color="tab:orange", label="validation")
    if not axes.lines:
        return False
    if all(v > 0 for line in axes.lines for v in line.get_ydata()) and _spread(axes) > 20:
        axes.set_yscale("log")  # losses spanning orders of magnitude
    _mark_epochs_and_events(axes, run)
    axes.set(title="Loss", xlabel="optimizer step", ylabel="loss")
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return True


def _plot_val(run: RunRecord, figure) -> bool:
    names = [name for name in run.val_names if name != "val_loss"]
    if not names:
        return False
    axes = figure.add_subplot()
    for name in names:
        x, y = _series(run.epoch_rows, "epoch", name)
        axes.plot(x, y, "o-", label=name[4:])
    axes.set(title="Validation metrics", xlabel="epoch", ylabel="value")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return True


def _plot_lr(run: RunRecord, figure) -> bool:
    x, y = _series(sorted(run.rows, key=lambda row: row.get("step", 0)), "step", "lr")
    if not x:
        return False
    axes = figure.add_subplot()
    axes.plot(x, y, ".-", color="tab:green", markersize=3)
    _mark_epochs_and_events(axes, run)
    axes.set(title="Learning rate", xlabel="optimizer step", ylabel="lr")
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return True


def _plot_workers(run: RunRecord, figure) -> bool:
    start = run.start_time
    rows = [row for row in run.rows if _finite(row.get("time_s")) and _finite(row.get("world_size"))]
    if start is None or not rows:
        return False
    rows.sort(key=lambda row: row["time_s"])
    scale, unit = _time_unit(rows[-1]["time_s"] - start)
    times = [(row["time_s"] - start) / scale for row in rows]
    axes = figure.add_subplot()
    axes.step(times, [row["world_size"] for row in rows], where="post", color="tab:purple", label="workers")
    axes.set(title="Workers over time", xlabel=f"{unit} since start", ylabel="world size")
    axes.set_ylim(0, max(row["world_size"] for row in rows) + 1)
    axes.yaxis.get_major_locator().set_params(integer=True)
    batch = axes.twinx()
    batch.step(times, [row.get("global_batch_size", math.nan) for row in rows], where="post", color="tab:gray", linestyle="--", label="global batch")
    batch.set_ylabel("global batch")
    batch.set_ylim(0, max((row.get("global_batch_size") or 0) for row in rows) * 1.2 + 1)
    for event in run.events:
        if event.get("kind") in MARKED_EVENTS and _finite(event.get("time")):
            at = (event["time"] - start) / scale
            axes.axvline(at, color="tab:red", linewidth=1, linestyle="--", alpha=0.6)
            axes.annotate(event["kind"], (at, axes.get_ylim()[1] * 0.95), fontsize="x-small", color="tab:red", rotation=90, va="top", ha="right")
    handles = axes.get_legend_handles_labels()[0] + batch.get_legend_handles_labels()[0]
    axes.legend(handles, [h.get_label() for h in handles], fontsize="small", loc="lower right")
    axes.grid(alpha=0.3)
    return True


def _plot_throughput(run: RunRecord, figure) -> bool:
    axes = figure.add_subplot()
    x, y = _series(run.step_rows, "step", "samples_per_s")
    if x:
        axes.plot(x, y, color="tab:cyan", linewidth=1, label="per logged window")
    x, y = _series(run.epoch_rows, "step", "samples_per_s")
    if x:
        axes.plot(x, y, "o-", color="tab:blue", label="epoch mean")
    if not axes.lines:
        return False
    steady = run.summary.get("steady_samples_per_s")
    if _finite(steady):
        axes.axhline(steady, color="tab:green", linestyle="--", label=f"steady {steady:,.0f}/s")
    _mark_epochs_and_events(axes, run)
    axes.set(title="Throughput", xlabel="optimizer step", ylabel="samples/s")
    axes.set_ylim(bottom=0)
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return True


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s < 120:
        return 1.0, "seconds"
    return (60.0, "minutes") if span_s < 7200 else (3600.0, "hours")


def _spread(axes) -> float:
    values = [v for line in axes.lines for v in line.get_ydata() if _finite(v)]
    return max(values) / min(values) if values and min(values) > 0 else 1.0


# -- Markdown --------------------------------------------------------------------------------


def render_markdown(run: RunRecord, plots: dict[str, Path]) -> str:
    s, cfg = run.summary, run.config
    name = cfg.get("name") or run.run_dir.name
    lines = [f"# {name}", ""]
    lines += [_headline(run), ""]
    if s.get("error"):
        lines += [f"**Error:** {s['error']}", ""]
    if s.get("final_metrics"):
        lines += ["| final metric | value |", "|---|---|"]
        lines += [f"| {key} | {_fmt(value)} |" for key, value in s["final_metrics"].items()]
        lines.append("")
    lines += _epoch_table(run)
    marked = [e for e in run.events if e.get("kind") in MARKED_EVENTS]
    if marked:
        start = run.start_time or 0
        lines += ["## Resizes and restarts", ""]
        lines += [f"- {_clock(e.get('time'))} (+{_since(e.get('time'), start)}): {e.get('message', '')}" for e in marked]
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for key, path in plots.items():
            lines += [f"![{key}]({path.relative_to(run.run_dir).as_posix()})", ""]
    if cfg:
        lines += ["## Configuration", "", "| option | value |", "|---|---|"]
        for key, value in _flatten(cfg).items():
            lines.append(f"| {key} | {_fmt(value, 'option')} |")
        lines.append("")
    plan = next((e.get("message") for e in run.events if e.get("kind") == "plan"), None)
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
    last = rows[-1] if rows else {}
    status = s.get("status") or ("running or interrupted" if rows else "no metrics yet")
    parts = [f"**{status}**"]
    if cfg.get("pipeline"):
        parts.append(f"pipeline `{cfg['pipeline']}`")
    epochs = s.get("epochs", max((row.get("epoch", 0) for row in run.epoch_rows), default=0))
    if cfg.get("epochs"):
        parts.append(f"{epochs}/{cfg['epochs']} epochs")
    parts.append(f"{s.get('steps', last.get('step', 0)):,} steps")
    parts.append(f"{s.get('samples_seen', last.get('samples_seen', 0)):,} samples")
    if _finite(s.get("wall_time_s")):
        parts.append(f"{s['wall_time_s']:.1f} s wall")
    if _finite(s.get("steady_samples_per_s")):
        parts.append(f"{s['steady_samples_per_s']:,.0f} samples/s steady")
    sizes = s.get("world_sizes") or _distinct([row.get("world_size") for row in rows])
    if sizes:
        parts.append(f"workers {' → '.join(map(str, sizes))}")
    if "failures_recovered" in s:
        parts.append(f"{s['failures_recovered']} failure{'s' if s['failures_recovered'] != 1 else ''} recovered")
    return " · ".join(parts)


def _epoch_table(run: RunRecord) -> list[str]:
    if not run.epoch_rows:
        return []
    names = run.val_names
    head = ["epoch", "step", "train loss", *names, "lr", "samples/s", "workers", "global batch"]
    lines = ["## Epochs", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in run.epoch_rows:
        cells = [row.get("epoch"), row.get("step"), row.get("loss"), *[row.get(n) for n in names], row.get("lr"), row.get("samples_per_s"), row.get("world_size"), row.get("global_batch_size")]
        lines.append("| " + " | ".join(_fmt(cell, key) for cell, key in zip(cells, head)) + " |")
    lines.append("")
    return lines


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
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _distinct(values: list[Any]) -> list[Any]:
    out = []
    for value in values:
        if value is not None and (not out or out[-1] != value):
            out.append(value)
    return out


def _clock(stamp: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(stamp)) if _finite(stamp) else "?"


def _since(stamp: Any, start: float) -> str:
    return f"{stamp - start:.0f} s" if _finite(stamp) else "?"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        value = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}
