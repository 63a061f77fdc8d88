"""How raytrain shows things: tables and figures (numbers and one-line errors: `raytrain.text`).

Every report (bench, tune, a run's report, the console) formats through these, so a
table reads the same wherever it appears.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cell(value: Any) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "left") -> list[str]:
    """A Markdown table's lines; `align` "right" for columns of figures."""
    rule = "---:" if align == "right" else "---"
    return [
        "| " + " | ".join(_cell(h) for h in header) + " |",
        "|" + "|".join(rule for _ in header) + "|",
        *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows),
    ]


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[Any]], left: Sequence[int] = (), indent: str = ""
) -> list[str]:
    """A console table's lines, columns padded to their widest cell; right-aligned except
    the column indexes in `left`."""
    lines = [[str(h) for h in header], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(header))]
    return [
        (
            indent
            + "  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        ).rstrip()
        for line in lines
    ]


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested options as one level: `{"ddp": {"bucket_cap_mb": 25}}` -> `{"ddp.bucket_cap_mb": 25}`."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def figure(width_in: float, height_in: float, **kwargs: Any):
    """A matplotlib Figure on its own Agg canvas: no pyplot, no display, no global backend
    change, safe in a worker or a server."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), **kwargs)
    FigureCanvasAgg(fig)
    return fig


def event_line(event: Any, start: float) -> str:
    """A run's event as a report lists it: `- 12:04:31 (+93 s): <its message>` (`start`: the run's first record)."""
    import time

    from raytrain.text import is_number

    stamp = event.time
    if not is_number(stamp):
        return f"- ? (+?): {event.message}"
    try:
        clock = time.strftime("%H:%M:%S", time.localtime(stamp))
    except (OverflowError, OSError, ValueError):  # a time no clock reaches (1e300): the number as written
        clock = f"{stamp:g}"
    since_s = stamp - start
    since = f"{since_s:.0f}" if abs(since_s) < 1e9 else f"{since_s:.3g}"  # not 300 digits
    return f"- {clock} (+{since} s): {event.message}"
