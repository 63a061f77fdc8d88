"""report.md's Goodput section: where a run's wall time went (`raytrain.rules.accounting` counts it)."""

from __future__ import annotations

from raytrain.observe.render import markdown_table
from raytrain.rules.accounting import shares
from raytrain.rundir.records import Goodput


def goodput_section(goodput: Goodput) -> list[str]:
    """report.md's Goodput section: the figure, then a table of where the wall time went."""
    head = (
        f"**{goodput.goodput:.1%}** of the wall time went to steps that were kept "
        f"({goodput.kept_steps_s:,.1f} s of {goodput.wall_s:,.1f} s: the final position's steps at the steady "
        f"{goodput.step_s * 1e3:,.1f} ms a step; {goodput.failures} failure(s) or resize(s), "
        f"{goodput.preemptions} preemption(s), "
        f"{goodput.checkpoints} checkpoint(s) kept)."
        if goodput.goodput is not None
        else "No wall time to account."
    )
    rows = [
        (name, "not recorded" if seconds is None else f"{seconds:,.1f}", "" if share is None else f"{share:.1%}")
        for name, seconds, share in shares(goodput)
    ]
    lines = ["## Goodput", "", head, "", *markdown_table(["where", "seconds", "share of wall time"], rows), ""]
    if goodput.validation_s is None:
        lines += ["Validation passes are not timed by this run: their time is part of *other*.", ""]
    return lines
