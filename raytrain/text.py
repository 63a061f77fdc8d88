"""How a number or an error is written in a sentence: `sci`, `plural`, `first_line`, `is_number`.

Every layer writes messages (a rule's plan line, a checkpoint's error, the console), so these
sit in the foundation; tables and figures are `raytrain.observe.render`'s.
"""

from __future__ import annotations

import math
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
