"""`raytrain bench --predict`: the cost model (`raytrain.rules.costmodel`) from the command line.

Runs nothing: the speedup at 1 to `gpus` workers from a 1-worker step time and a gradient
size, given as options or read from the `bench.json` of a `raytrain bench` run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from raytrain.errors import ConfigError, UserError
from raytrain.fields import flag_name
from raytrain.observe.render import text_table
from raytrain.rules import costmodel


class PredictError(UserError, ValueError):
    """Inputs the cost model cannot use, named as the --predict options."""


@dataclass(kw_only=True)
class PredictOptions:
    """What the cost model predicts from (`raytrain bench --predict`)."""

    gpus: int = 8
    """GPUs of the largest configuration (default 8)."""
    nodes: int = 1
    """Nodes the GPUs are spread over (default 1)."""
    link: str | None = None
    """The link of the ring: inside the node on one node (default nvlink), the inter-node link over several."""
    intra_link: str = costmodel.DEFAULT_INTRA_LINK
    """Link inside a node when --nodes > 1 (default nvlink)."""
    nics_per_node: int = 1
    """Inter-node NICs per node, --link bandwidth each (default 1)."""
    step_time_ms: float | None = None
    """1-worker step time in ms."""
    grad_mb: float | None = None
    """Gradient size in MB (1e6 bytes): 4 × parameters in fp32."""
    bucket_mb: float = 25.0
    """DDP bucket size in MiB (default 25)."""
    overlap: float | None = None
    """Share of the all-reduce hidden under backward (default: all buckets but the last)."""
    source: str | None = field(default=None, metadata={"flags": "--from", "metavar": "BENCH_DIR"})
    """Take the step time and gradient size from a bench run's directory."""


def predict_speedups(opts: PredictOptions, echo: Callable[[str], None] = print) -> list[costmodel.Prediction]:
    """Tabulate the predicted speedup; the inputs from the options, else from `--from`'s bench.json."""
    step_s, grad_bytes, source = None, None, "given"
    if opts.source:
        report_path = Path(opts.source).expanduser() / "bench.json"
        if not report_path.is_file():
            raise ConfigError(
                [("from", f"no bench.json in {opts.source}; give the directory a `raytrain bench` run wrote")]
            )
        report = json.loads(report_path.read_text())
        one = next(r for r in report["results"] if r["workers"] == 1)
        step_s, grad_bytes = one["split_ms"]["step"] / 1e3, report["grad_bytes"]
        source = f"measured in {opts.source}"
    if opts.step_time_ms is not None:
        step_s = opts.step_time_ms / 1e3
    if opts.grad_mb is not None:
        grad_bytes = opts.grad_mb * 1e6
    missing = [
        (name, f"needed by --predict; give {flag_name(name)} or --from BENCH_DIR")
        for name, v in (("step_time_ms", step_s), ("grad_mb", grad_bytes))
        if v is None
    ]
    if missing:
        raise ConfigError(missing)
    link = opts.link or (costmodel.DEFAULT_INTRA_LINK if opts.nodes == 1 else None)
    if link is None:
        raise ConfigError([("link", f"needed with --nodes {opts.nodes}: the inter-node link, e.g. --link ib200")])
    if opts.gpus < 1 or opts.nodes < 1 or opts.gpus % opts.nodes:
        raise ConfigError(
            [("gpus", f"got {opts.gpus} over --nodes {opts.nodes}; give a positive multiple of the node count")]
        )
    try:
        predictions = [
            costmodel.predict(
                gpus=n,
                nodes=nodes,
                step_time_s=step_s,
                grad_bytes=grad_bytes,
                link=link if nodes > 1 else (link if opts.nodes == 1 else opts.intra_link),
                intra_link=opts.intra_link,
                nics_per_node=opts.nics_per_node,
                bucket_mb=opts.bucket_mb,
                overlap=opts.overlap,
            )
            for n, nodes in prediction_points(opts.gpus, opts.nodes)
        ]
    except costmodel.CostModelError as exc:
        raise PredictError(f"--predict: {exc}") from None
    echo(f"Cost model ({source}: 1-worker step {step_s * 1e3:.2f} ms, {grad_bytes / 1e6:.2f} MB of gradients):")
    echo(costmodel.describe(predictions[-1], grad_bytes))
    header = ["GPUs", "nodes", "all-reduce ms", "hidden ms", "step ms", "speedup", "efficiency"]
    rows = [
        [p.gpus, p.nodes, *(f"{s * 1e3:.2f}" for s in (p.comm_s, p.hidden_s, p.step_time_n_s))]
        + [f"{p.speedup:.2f}×", f"{p.efficiency:.1%}"]
        for p in predictions
    ]
    echo("\n".join(text_table(header, rows)))
    return predictions


def prediction_points(gpus: int, nodes: int) -> list[tuple[int, int]]:
    """(GPUs, nodes) to tabulate: powers of two inside one node, then whole nodes up to `nodes`."""
    per_node = gpus // nodes
    points = [(n, 1) for n in (1, 2, 4, 8, 16, 32, 64) if n < per_node] + [(per_node, 1)]
    points += [(k * per_node, k) for k in (2, 4, 8, 16, 32, 64, 128) if k < nodes] + (
        [(gpus, nodes)] if nodes > 1 else []
    )
    return points
