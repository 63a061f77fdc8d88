"""The study's outputs: bench.json, bench.md, the console table and scaling.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raytrain.observe.render import figure, markdown_table, text_table
from raytrain.text import plural

METHOD = (
    "Steady samples/s: the samples of all workers in the steady steps over rank 0's time in those steps (the "
    "first {warmup} steps of every epoch are warm-up and left out; evaluation, checkpoints and logging between "
    "steps are not timed). Speedup = samples/s at N workers ÷ samples/s at 1 worker; efficiency = speedup ÷ N. "
    "Step split (rank 0, ms per steady step): data wait = cutting the batch and moving it to the device; "
    "communication = forward+backward at N workers − forward+backward at 1 worker (scaled by the per-worker "
    "batch), clipped at 0 — DDP's all-reduce runs inside backward, so this is the part of it not hidden by "
    "compute, plus any slowdown from workers sharing the machine; compute = forward+backward − communication; "
    "optimizer = optimizer step and zero_grad; other = the rest of the step (lr, bookkeeping). "
    "Baselines (raytrain.baselines.classic_ddp) are timed the same way, with the same epochs, per-worker batch, "
    "model, data and DDP flags, and OMP_NUM_THREADS = the CPUs Ray gives each worker, with the study's embedded "
    "Ray stopped (as a user runs them; when the study joined a running Ray, they run beside it and the CPU its "
    "processes took meanwhile is reported). With --repeat R, rounds alternate raytrain-first and "
    "baselines-first and every figure is the {statistic} round of R (best: the fastest, as timeit does — "
    "interference from other work on the machine only ever slows a run down)."
)


def write_bench_files(out: Path, report: dict[str, Any]) -> None:
    """OUT/bench.json, bench.md and scaling.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(bench_markdown(report))
    plot_scaling(report, out / "scaling.png")


def table_lines(report: dict[str, Any]) -> list[list[str]]:
    predicted = report.get("link") is not None
    header = ["workers", "global batch", "samples/s", "speedup", "efficiency", "step ms", "data wait", "compute"]
    header += ["comm", "optimizer", "other", "TFLOP/s/worker", "MFU"]
    if predicted:
        header.append(f"predicted ({report['link']})")
    lines = [header]
    for row in report["results"]:
        s = row["split_ms"]
        line = [
            str(row["workers"]),
            str(row["global_batch_size"]),
            f"{row['steady_samples_per_s']:,.0f}",
            f"{row['speedup']:.2f}×",
            f"{row['efficiency']:.0%}",
            *(f"{s[part]:.2f}" for part in ("step", "data_wait", "compute", "communication", "optimizer", "other")),
            *_cost_cells(row.get("cost")),
        ]
        if predicted:
            line.append(f"{row['predicted_speedup']:.2f}×")
        lines.append(line)
    return lines


def _cost_cells(cost: dict[str, Any] | None) -> list[str]:
    if not cost:
        return ["–", "–"]
    mfu = cost.get("mfu")
    return [f"{cost['achieved_tflops_per_worker']:.3g}", "–" if mfu is None else f"{mfu:.1%}"]


def cost_sentence(report: dict[str, Any]) -> str | None:
    """The cost view's FLOPs per sample and what the MFU is measured against."""
    cost = next((row["cost"] for row in report["results"] if row.get("cost")), None)
    if cost is None:
        return None
    peak = (
        f"MFU against {cost['peak_tflops']:g} TFLOP/s per device ({cost['device']}, {cost['precision']}, "
        f"{cost['peak_from']})"
        if cost.get("peak_tflops")
        else f"no MFU: no peak known for {cost['device'] or 'this device'} (give --peak-tflops)"
    )
    return (
        f"FLOPs per sample: {cost['flops_per_sample']:,.0f} (forward and backward, torch's FlopCounterMode on one "
        f"batch); TFLOP/s/worker = FLOPs per sample × steady samples/s ÷ workers; {peak}."
    )


def baseline_lines(report: dict[str, Any]) -> list[list[str]]:
    header = ["baseline", "workers", "baseline samples/s", "raytrain samples/s", "raytrain / baseline", "Ray meanwhile"]
    return [header] + [
        [b["baseline"], str(b["workers"]), f"{b['baseline_samples_per_s']:,.0f}", f"{b['raytrain_samples_per_s']:,.0f}"]
        + [f"{b['ratio']:.3f}", _ray_beside(b)]
        for b in report["baselines"]
    ]


def _ray_beside(b: dict[str, Any]) -> str:
    if b.get("ray_beside") != "running":
        return "stopped"
    share = b.get("ray_background_cpu_share")
    return "running" + ("" if share is None else f", {share:.0%} of a CPU")


def render_text(report: dict[str, Any]) -> str:
    text = (
        f"Scaling of {report['pipeline']} (ms per step, rank 0; {report['grad_bytes'] / 1e6:.2f} MB of gradients):\n"
        + _text(table_lines(report))
    )
    if cost_sentence(report):
        text += "\n" + cost_sentence(report)
    if report["baselines"]:
        text += "\n\n" + _text(baseline_lines(report))
    return text


def _text(lines: list[list[str]]) -> str:
    return "\n".join(text_table(lines[0], lines[1:]))


def _markdown(lines: list[list[str]]) -> str:
    return "\n".join(markdown_table(lines[0], lines[1:], align="right"))


def bench_markdown(report: dict[str, Any]) -> str:
    opts = report["train_options"]
    ddp = ", ".join(f"{k}={v}" for k, v in opts["ddp"].items())
    parts = [
        f"# raytrain bench: {report['pipeline']} ({report['date']})",
        "",
        f"Command: `{report['command']}`" if report["command"] else "Command: (Python API)",
        "",
        f"Machine: {report['machine']['cpus']} CPUs, GPU {report['machine']['gpu'] or 'none'}, torch "
        f"{report['machine']['torch']}, ray {report['machine']['ray']}; load average at the end "
        f"{report['machine']['load_average_at_end']}.",
        f"Model: {report['params']:,} trainable parameters, {report['grad_bytes'] / 1e6:.2f} MB of gradients. "
        f"Precision {opts['precision']}; DDP {ddp}. {report['num_train_rows']:,} training rows; "
        f"at least {report['steps']} steady steps per worker count.",
        "",
        "## Scaling (ms per steady step on rank 0)",
        "",
        _markdown(table_lines(report)),
        "",
    ]
    if cost_sentence(report):
        parts += [cost_sentence(report), ""]
    if report["baselines"]:
        parts += [
            "## Baselines (same model, data, per-worker batch and warm-up)",
            "",
            _markdown(baseline_lines(report)),
            "",
        ]
    if report.get("repeat", 1) > 1:
        statistic = report.get("statistic", "median")
        parts += [f"## Rounds (steady samples/s; each figure above is the {statistic} round of {report['repeat']})", ""]
        for mode, by_n in report["rounds"].items():
            rounds = (f"{plural(int(n), 'worker')}: " + ", ".join(f"{x:,.0f}" for x in xs) for n, xs in by_n.items())
            parts.append(f"- {mode}: " + "; ".join(rounds))
        parts += [""]
    implied = [
        f"{r['workers']} workers: {r['implied_bandwidth_GBps']:.2f} GB/s"
        for r in report["results"]
        if r.get("implied_bandwidth_GBps")
    ]
    parts += ["## Method", "", report["method"], ""]
    if implied:
        parts += [f"All-reduce bus bandwidth implied by the communication estimate: {'; '.join(implied)}.", ""]
    if report.get("link"):
        parts += [
            f"Predicted speedup: `raytrain.rules.costmodel` on link {report['link']} from the 1-worker step time and "
            "the gradient size (ring all-reduce 2(N−1)/N × bytes / bandwidth, minus the part hidden under backward).",
            "",
        ]
    return "\n".join(parts)


def plot_scaling(report: dict[str, Any], path: Path) -> None:
    """Speedup vs workers against the linear ideal (Agg canvas: no display, no pyplot state)."""
    workers = [r["workers"] for r in report["results"]]
    top = max(workers)
    fig = figure(6, 4.2, dpi=110)
    ax = fig.add_subplot()
    ax.plot([1, top], [1, top], "--", color="gray", label="linear (ideal)")
    ax.plot(workers, [r["speedup"] for r in report["results"]], "o-", color="tab:blue", label="raytrain (measured)")
    torchrun = {b["workers"]: b["baseline_samples_per_s"] for b in report["baselines"] if b["baseline"] == "torchrun"}
    if 1 in torchrun and len(torchrun) > 1:
        xs = sorted(torchrun)
        ax.plot(
            xs, [torchrun[n] / torchrun[1] for n in xs], "s:", color="tab:orange", label="torchrun template (measured)"
        )
    if report.get("link"):
        predicted = [r["predicted_speedup"] for r in report["results"]]
        ax.plot(workers, predicted, "^-.", color="tab:green", label=f"cost model ({report['link']})")
    for r in report["results"]:
        point = (r["workers"], r["speedup"])
        ax.annotate(f"{r['efficiency']:.0%}", point, textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.set_xticks(workers)
    ax.set(xlabel="workers", ylabel="speedup vs 1 worker", xlim=(0.8, top + 0.2), ylim=(0, top * 1.1))
    ax.set_title(f"raytrain bench: {report['pipeline']} ({report['date']})")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
