"""The pure part of `raytrain check`: how close two runs must be, where they part, what the
figures say, and how the verdict reads. Nothing here touches Ray or torch.

Two runs of the same pipeline from the same weights over the same rows differ only by the
order of floating-point reductions when the pipeline is free of per-rank behaviour: the
per-rank sums of the loss and of the gradients, DDP's all-reduce, and the kernels' own
blocking for another batch shape. Measured on the built-in pipelines (docs/porting.md,
"Check your port"): at fp32 every one of 20 steps agreed to within 4.3e-7 relative (digits
and charlm, 2 and 4 workers), a few float32 epsilons (1.2e-7). The bound, 1e-5, sits 20×
above that and 100× below the smallest gap a named cause made (BatchNorm over 2 × 32 rows
of digits: 1e-3 at step 1). Under bf16 or fp16 autocast the rounding is 2^-8 or 2^-11 per
operation and compounds over the steps (digits: 2e-5 at step 2, 6.5e-2 at step 17): the
bound is 0.1, which still sees a loss summed instead of averaged (a factor of the worker
count) or noise, but not the smaller effects fp32 shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Relative difference allowed per step, loss and gradient norm alike, by precision.
TOLERANCE = {"fp32": 1e-5, "bf16": 0.1, "fp16": 0.1}
# Rounding at fp32 compounds through the optimizer: on digits at 4 workers it stayed near
# 1e-7 for ~35 steps, then grew past 1e-5 near step 57. Beyond this many steps the check
# says so, and a late gap whose first steps agree is named drift rather than a cause.
DRIFT_FREE_STEPS = 40
# A first step agreeing to within this is rounding: the same weights gave the same loss.
ROUNDING = 1e-6


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
    """Two runs step by step against a tolerance."""

    rows: tuple[Row, ...]
    tolerance: float
    workers: int

    @property
    def first_difference(self) -> int | None:
        """The first step whose loss or gradient norm differs beyond the tolerance (None: none)."""
        return next((row.step for row in self.rows if row.difference > self.tolerance), None)

    @property
    def equivalent(self) -> bool:
        return self.first_difference is None

    @property
    def largest(self) -> Row:
        return max(self.rows, key=lambda row: row.difference)

    def ratio_at_first_difference(self) -> tuple[float, float] | None:
        """(reference / run) of the loss and of the gradient norm at the first differing step."""
        step = self.first_difference
        if step is None:
            return None
        row = self.rows[step - 1]
        return _ratio(row.reference.loss, row.run.loss), _ratio(row.reference.grad_norm, row.run.grad_norm)

    def scales_with_workers(self) -> bool:
        """Loss and gradient norm off by the worker count at the first differing step: what a
        loss summed over each rank's rows (instead of averaged) does."""
        ratios = self.ratio_at_first_difference()
        return ratios is not None and all(_near(r, self.workers) or _near(r, 1 / self.workers) for r in ratios)

    def looks_like_drift(self) -> bool:
        """A late gap after first steps that agree to rounding: reduction-order differences
        compounded by training, not a per-rank cause."""
        step = self.first_difference
        return step is not None and step > DRIFT_FREE_STEPS // 2 and self.rows[0].difference <= ROUNDING


def compare(reference: list[StepRecord], run: list[StepRecord], tolerance: float, workers: int) -> Comparison:
    """The two runs' common steps against `tolerance`."""
    rows = tuple(Row(index + 1, ref, got) for index, (ref, got) in enumerate(zip(reference, run)))
    return Comparison(rows, tolerance, workers)


def tolerance_for(precision: str, override: float | None = None) -> float:
    return override if override is not None else TOLERANCE[precision]


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def _near(value: float, target: float, within: float = 0.02) -> bool:
    return math.isfinite(value) and abs(value - target) <= within * target


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
        if c.equivalent:
            return [
                f"Equivalent: {c.workers} workers train like 1 over {len(c.rows)} steps; largest relative difference "
                f"{largest.difference:.1e} (step {largest.step}), within the tolerance {c.tolerance:.0e}."
            ]
        first = c.rows[c.first_difference - 1]
        lines = [
            f"Differs from step {first.step}: relative difference {first.difference:.1e} there, beyond the tolerance "
            f"{c.tolerance:.0e} (largest {largest.difference:.1e}, step {largest.step})."
        ]
        for cause in self.causes:
            lines.append(f"Cause: {cause.name}. {cause.evidence}")
            lines.append(f"  Fix: {cause.fix}")
        lines += [f"Confirmed: {sentence}" for sentence in self.confirmed]
        if not self.causes:
            lines.append(no_cause_line(c))
        return lines


def no_cause_line(comparison: Comparison) -> str:
    """What to say when no probe named a cause."""
    if comparison.looks_like_drift():
        return (
            f"Likely drift, not a cause: step 1 agrees to {comparison.rows[0].difference:.1e} and the gap appears only "
            f"at step {comparison.first_difference}, as rounding compounds through training; the probes found no "
            f"per-rank behaviour. Check fewer steps (--steps {DRIFT_FREE_STEPS // 2})."
        )
    return (
        "No probed cause found (BatchNorm, randomness in the model or loss, a loss that scales with the per-rank "
        "batch, state kept in the pipeline object, compute_loss reading raytrain.context()'s rank or world size). "
        "Look for other per-rank behaviour: code that reads the rank or world size (torch.distributed, environment "
        "variables), statistics over the batch inside the model, or buffers updated in forward."
    )


# -- the table -------------------------------------------------------------------------------


def table_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table (step, both losses, both norms, differences)."""
    n = comparison.workers
    header = ["step", "loss 1 worker", f"loss {n} workers", "rel diff", "grad norm 1", f"grad norm {n}", "rel diff", ""]
    rows = []
    for row in comparison.rows:
        mark = "  <- differs" if row.difference > comparison.tolerance else ""
        rows.append(
            [
                str(row.step),
                _shown(row.reference.loss),
                _shown(row.run.loss),
                f"{row.loss_difference:.1e}",
                _shown(row.reference.grad_norm),
                _shown(row.run.grad_norm),
                f"{row.norm_difference:.1e}",
                mark,
            ]
        )
    return header, rows


def _shown(value: float) -> str:
    return f"{value:.7g}" if math.isfinite(value) else str(value)
