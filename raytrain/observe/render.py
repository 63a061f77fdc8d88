"""How raytrain shows things: numbers, tables, figures and one-line errors.

Every report (bench, tune, a run's report, the console) formats through these, so a
learning rate or a table reads the same wherever it appears.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def sci(value: float) -> str:
    """2.0e-3, not 2.0e-03."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool, not None, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plural(count: int, noun: str) -> str:
    """`1 worker`, `2 workers`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def first_line(error: BaseException | str) -> str:
    """`Type: first line of the message` of an exception (torch's load errors run to a dozen
    lines), or the first non-blank line of a text."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return lines[0] if lines else ""


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


def figure(width_in: float, height_in: float, **kwargs: Any):
    """A matplotlib Figure on its own Agg canvas: no pyplot, no display, no global backend
    change, safe in a worker or a server."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), **kwargs)
    FigureCanvasAgg(fig)
    return fig


__all__ = ["figure", "first_line", "is_number", "markdown_table", "plural", "sci", "text_table"]
