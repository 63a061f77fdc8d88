"""The pure part of `raytrain check`: how close two runs must be, where they part, what the
figures say, and how the verdict reads. Nothing here touches Ray or torch.

Two runs of the same pipeline from the same weights over the same rows differ only by the
order of floating-point reductions when the pipeline is free of per-rank behaviour: the
per-rank sums of the loss and of the gradients, DDP's all-reduce, and the kernels' own
blocking for another batch shape. Measured on the built-in pipelines (docs/porting.md,
"Check your port"), 20 steps at fp32: every step agreed to within 1.9e-7 relative (digits
and charlm at 2 and 4 workers; parquet, streamed, at 2), about 1.5 float32 epsilons. The
bound, 1e-5, sits 50× above that and below the smallest gap a named cause made (a BatchNorm
layer over 2 × 32 rows of digits: 5.6e-5 on the loss and 1.0e-3 on the gradient norm at
step 1). Under bf16 autocast (8 bits of mantissa) the same 20 steps differed by up to 5.4e-3
(digits) and 1.8e-3 (charlm): the bound is 1e-2, which still sees a loss summed instead of
averaged (a factor of the worker count) or noise, but not the smaller effects fp32 shows.

Rounding differences compound through training, at a rate the pipeline sets: digits and
charlm stay near 1e-7 for 20 steps, but the SGD recipe's ResNet (lr 0.1, BatchNorm, random
crops) turns a 1e-8 difference in the gradient into 5e-6 one step later. So the check also
runs the 1-worker side a second time with each step's rows rotated by half (the same math,
its sums taken in another order, as a split over ranks takes them) and finds the pipeline's
*horizon*: the first step, from the second on, at which the 1-worker run departs from itself
beyond the tolerance. Steps from the horizon on are shown but not judged: no comparison can
tell a cause from rounding there. Step 1, from identical weights, is always judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Relative difference allowed per step, loss and gradient norm alike, by precision.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as a run saw it: the global loss (sample-weighted over every rank's
    rows) and the global gradient norm, both before the step's update."""

    loss: float
    grad_norm: float


def relative_difference(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude; 0 when equal, inf when only one is finite."""
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


@dataclass(frozen=True)
class Row:
    step: int  # 1-based: the first optimizer step is step 1
    reference: StepRecord
    run: StepRecord

    @property
    def loss_difference(self) -> float:
        return relative_difference(self.reference.loss, self.run.loss)

    @property
    def norm_difference(self) -> float:
        return relative_difference(self.reference.grad_norm, self.run.grad_norm)

    @property
    def difference(self) -> float:
        return max(self.loss_difference, self.norm_difference)


@dataclass(frozen=True)
class Comparison:
    """Two runs step by step against a tolerance, judged up to the horizon (None: every step)."""

    rows: tuple[Row, ...]
    tolerance: float
    workers: int
    horizon: int | None = None

    def judged(self, row: Row) -> bool:
        return self.horizon is None or row.step < self.horizon

    @property
    def judged_rows(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if self.judged(row))

    @property
    def first_difference(self) -> int | None:
        """The first judged step whose loss or gradient norm differs beyond the tolerance (None: none)."""
        return next((row.step for row in self.judged_rows if row.difference > self.tolerance), None)

    @property
    def equivalent(self) -> bool:
        return self.first_difference is None

    @property
    def largest(self) -> Row:
        """The judged step that differs most."""
        return max(self.judged_rows, key=lambda row: row.difference)


def compare(
    reference: list[StepRecord], run: list[StepRecord], tolerance: float, workers: int, horizon: int | None = None
) -> Comparison:
    """The two runs' common steps against `tolerance`, judged before `horizon`."""
    rows = tuple(Row(index + 1, ref, got) for index, (ref, got) in enumerate(zip(reference, run)))
    return Comparison(rows, tolerance, workers, horizon)


def horizon_of(reference: list[StepRecord], reordered: list[StepRecord], tolerance: float) -> int | None:
    """The first step from the second on at which the 1-worker run and the same run with its
    rows summed in another order differ beyond `tolerance` (None: none does)."""
    itself = compare(reference, reordered, tolerance, workers=1)
    return next((row.step for row in itself.rows[1:] if row.difference > tolerance), None)


def tolerance_for(precision: str, override: float | None = None) -> float:
    return override if override is not None else TOLERANCE[precision]


# -- causes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cause:
    """A pitfall a probe found: what it is, what showed it, and the fix."""

    name: str
    evidence: str
    fix: str


@dataclass
class Verdict:
    """What the check concludes: equivalent, or differs from a step with its causes."""

    comparison: Comparison
    causes: list[Cause] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)  # reruns that closed the gap, said as sentences

    @property
    def exit_status(self) -> int:
        return 0 if self.comparison.equivalent else 1

    def lines(self) -> list[str]:
        c = self.comparison
        largest = c.largest
        judged = len(c.judged_rows)
        if c.equivalent:
            lines = [
                f"Equivalent: {c.workers} workers train like 1 over {judged} step{'s' if judged != 1 else ''}; largest "
                f"relative difference {largest.difference:.1e} (step {largest.step}), within the tolerance "
                f"{c.tolerance:.0e}."
            ]
        else:
            first = c.rows[c.first_difference - 1]
            lines = [
                f"Differs from step {first.step}: relative difference {first.difference:.1e} there, beyond the "
                f"tolerance {c.tolerance:.0e} (largest {largest.difference:.1e}, step {largest.step})."
            ]
        if c.horizon is not None and c.horizon <= len(c.rows):
            lines.append(
                f"Steps {c.horizon}–{len(c.rows)} are shown, not judged: from step {c.horizon} the 1-worker run "
                "itself departs from the same run with its rows summed in another order beyond the tolerance, as "
                "rounding compounds through training."
            )
        for cause in self.causes:
            lines.append(f"Cause: {cause.name}. {cause.evidence}")
            lines.append(f"  Fix: {cause.fix}")
        lines += [f"Confirmed: {sentence}" for sentence in self.confirmed]
        if not c.equivalent and not self.causes:
            lines.append(NO_CAUSE)
        return lines


NO_CAUSE = (
    "No probed cause found (BatchNorm, randomness in the model or loss, a loss that scales with the per-rank batch, "
    "state kept in the pipeline object, compute_loss reading raytrain.context()'s rank or world size). Look for "
    "other per-rank behaviour: code that reads the rank or world size (torch.distributed, environment variables), "
    "statistics over the batch inside the model, or buffers updated in forward."
)


# -- the table -------------------------------------------------------------------------------


def table_rows(comparison: Comparison, reordered: list[StepRecord] | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table: step, both losses, both gradient norms, their
    differences, and (given `reordered`) the 1-worker run against itself with its rows reordered."""
    n = comparison.workers
    header = ["step", "loss 1 worker", f"loss {n} workers", "rel diff", "grad norm 1", f"grad norm {n}", "rel diff"]
    if reordered is not None:
        header.append("1 vs 1 reordered")
    header.append("")  # the mark: differs, or not judged
    rows = []
    for row in comparison.rows:
        line = [
            str(row.step),
            _shown(row.reference.loss),
            _shown(row.run.loss),
            f"{row.loss_difference:.1e}",
            _shown(row.reference.grad_norm),
            _shown(row.run.grad_norm),
            f"{row.norm_difference:.1e}",
        ]
        if reordered is not None:
            itself = Row(row.step, row.reference, reordered[row.step - 1]) if row.step <= len(reordered) else None
            line.append(f"{itself.difference:.1e}" if itself else "")
        if not comparison.judged(row):
            line.append("  not judged")
        else:
            line.append("  <- differs" if row.difference > comparison.tolerance else "")
        rows.append(line)
    return header, rows


def _shown(value: float) -> str:
    return f"{value:.7g}" if math.isfinite(value) else str(value)
