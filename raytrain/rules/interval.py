"""`--checkpoint-every auto`: the interval of step checkpoints, re-derived from what the run
measures (docs/fault-tolerance.md, *Goodput*).

Daly's interval (`raytrain.rules.goodput.daly_interval_s`) needs the loop's stall per save and
the mean time between the failures that send the job back to its last save. The stall is the
median of the last saves' (the first save, which allocates its buffers, weighs no more than
another). The failure rate is a node's, estimated as the posterior mean of a Gamma prior worth one
failure in `--mtbf-hours` (per node): (1 + failures seen) / (MTBF + node-hours trained), so the
prior rules until the run has seen failures of its own and fades as it trains. Under `restart`
every node's failure rolls back; under per-step only the head node's.

The interval is held between `min_steps` and `max_steps`, and moves only when the derived one
differs by `HYSTERESIS` or more, so that noise in the stall does not change it at every save;
each move is returned as an `IntervalChange` whose `line` the caller prints. Until a save has
been measured the interval is `min_steps` (the first save then measures the stall early).
`state()`/`from_state()` carry the counts across restarts in the checkpoint's position. Pure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from raytrain.rules import goodput
from raytrain.rules.goodput import HOUR_S

HYSTERESIS = 0.1  # the derived interval replaces the held one when they differ by this share or more
STALLS_KEPT = 5  # the stall estimate is the median of this many last saves
STEPS_KEPT = 50  # the step time is the median of this many last `on_steps` calls: one slow step does not move it


@dataclass(frozen=True)
class IntervalChange:
    """The interval moved: from `before` to `after` steps, after `cause` ("save", "failure")."""

    before: int
    after: int
    cause: str
    line: str


@dataclass
class AutoInterval:
    """The checkpoint interval of `--checkpoint-every auto`. Call `on_steps` as steps are taken
    (their count and time), `on_save` after every save with the loop's stall, `on_failure` when
    the attempt starts after a failure; ask `due(steps_since_save)`; `held` is the interval in steps."""

    mtbf_hours: float
    """The prior MTBF of one node (--mtbf-hours)."""
    nodes: int
    min_steps: int
    max_steps: int
    per_step: bool = False
    """--fault-tolerance per-step: only the head node's loss rolls the job back."""
    failures: int = 0
    node_hours: float = 0.0
    """Node-hours trained (time trained × nodes)."""
    step_s: float | None = None
    recent_step_s: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    held: int = 0

    def __post_init__(self) -> None:
        if not self.mtbf_hours > 0 or self.nodes < 1 or not 1 <= self.min_steps <= self.max_steps:
            raise goodput.GoodputError(
                f"need a positive MTBF, nodes >= 1 and 1 <= min <= max steps; got {self.mtbf_hours} h, "
                f"{self.nodes} nodes, {self.min_steps}..{self.max_steps} steps"
            )
        # a held interval from a checkpoint, within the bounds given now
        self.held = goodput.bound_steps(self.held, self.min_steps, self.max_steps) if self.held else self._derived()

    # -- what the run tells it -----------------------------------------------------------------
    def on_steps(self, steps: int, seconds: float) -> None:
        """`steps` optimizer steps took `seconds` (training time: exposure to failures, and the
        step time the interval is counted in)."""
        if steps <= 0 or seconds <= 0:
            return
        now = seconds / steps
        self.recent_step_s = [*self.recent_step_s, now][-STEPS_KEPT:]
        self.step_s = statistics.median(self.recent_step_s)
        self.node_hours += seconds * self.nodes / HOUR_S

    def on_save(self, stall_s: float) -> IntervalChange | None:
        """A save stalled the loop `stall_s`; the interval re-derived (the change, if any)."""
        self.stalls = [*self.stalls, max(0.0, stall_s)][-STALLS_KEPT:]
        self.node_hours += stall_s * self.nodes / HOUR_S
        return self._rederive("save")

    def on_failure(self) -> IntervalChange | None:
        """The run recovered from a failure; the rate and the interval re-derived."""
        self.failures += 1
        return self._rederive("failure")

    # -- what it says --------------------------------------------------------------------------
    def due(self, steps_since_save: int) -> bool:
        return steps_since_save >= self.held

    @property
    def stall_s(self) -> float | None:
        """The stall per save: the median of the last saves (None before the first)."""
        return statistics.median(self.stalls) if self.stalls else None

    @property
    def node_mtbf_s(self) -> float:
        """The node's MTBF: the prior's one failure in mtbf_hours, with the run's own added."""
        return (self.mtbf_hours + self.node_hours) / (1 + self.failures) * HOUR_S

    @property
    def rollback_mtbf_s(self) -> float:
        """The mean time between failures that send the job back to its last save."""
        return self.node_mtbf_s / (1 if self.per_step else self.nodes)

    def _derived(self) -> int:
        if self.stall_s is None or self.step_s is None:
            return self.min_steps
        seconds = goodput.daly_interval_s(self.stall_s, self.rollback_mtbf_s)
        return goodput.bound_steps(seconds / self.step_s, self.min_steps, self.max_steps)

    def _rederive(self, cause: str) -> IntervalChange | None:
        before, derived = self.held, self._derived()
        if abs(derived - before) < HYSTERESIS * before and self.min_steps <= before <= self.max_steps:
            return None
        self.held = derived
        return IntervalChange(before, derived, cause, self.describe(before))

    def describe(self, before: int | None = None) -> str:
        """`Checkpoint interval 10 → 240 steps (Daly: a save stalls 2.10 s, a step takes 0.050 s,
        MTBF 3.1 h between rollbacks: 4 nodes, 1 failure in 0.5 node-hours trained)`."""
        moved = f"{before:,} → {self.held:,}" if before is not None else f"{self.held:,}"
        if self.stall_s is None or self.step_s is None:
            return f"Checkpoint interval {moved} steps (--checkpoint-every auto: the first save measures its stall)"
        failures = f"{self.failures} failure{'s' if self.failures != 1 else ''}"
        bound = (
            " (at --checkpoint-min-steps)"
            if self.held == self.min_steps
            else " (at --checkpoint-max-steps)"
            if self.held == self.max_steps
            else ""
        )
        return (
            f"Checkpoint interval {moved} steps{bound} (Daly: a save stalls {self.stall_s:.2f} s, a step takes "
            f"{self.step_s:.3f} s, MTBF {_hours(self.rollback_mtbf_s / HOUR_S)} between rollbacks: "
            f"{self.nodes} node{'s' if self.nodes != 1 else ''}{', per-step' if self.per_step else ''}, "
            f"{failures} in {self.node_hours:,.3g} node-hours trained, prior {_hours(self.mtbf_hours)} per node)"
        )

    # -- across restarts -----------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint keeps (plain JSON values)."""
        return {
            "failures": self.failures,
            "node_hours": self.node_hours,
            "step_s": self.step_s,
            "recent_step_s": list(self.recent_step_s),
            "stalls": list(self.stalls),
            "held": self.held,
        }

    @classmethod
    def from_state(
        cls, state: dict | None, *, mtbf_hours: float, nodes: int, min_steps: int, max_steps: int, per_step: bool
    ) -> "AutoInterval":
        """The interval as a checkpoint left it (a fresh one without); the options as given now."""
        kept = {key: value for key, value in (state or {}).items() if key in cls.__dataclass_fields__}
        return cls(
            mtbf_hours=mtbf_hours, nodes=nodes, min_steps=min_steps, max_steps=max_steps, per_step=per_step, **kept
        )


def _hours(hours: float) -> str:
    """A duration in the unit that shows it: `6,335 h`, `2.5 h`, `12 min`, `30 s`."""
    if hours >= 10:
        return f"{hours:,.0f} h"
    if hours >= 1:
        return f"{hours:.1f} h"
    return f"{hours * 60:.0f} min" if hours * 60 >= 1 else f"{hours * HOUR_S:.0f} s"
