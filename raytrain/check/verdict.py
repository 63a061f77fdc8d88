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

The N-worker run's replicas are compared too (`Replicas`): under ddp every rank holds the whole
model, starts from the same weights and applies the same averaged gradients, so after every
step every rank's weights and optimizer state must have the same fingerprint
(`raytrain.instruments.agreement.fingerprint`, bit for bit, no tolerance). A replica that differs
fails the check with its own cause. Under fsdp the ranks hold one sharded copy: nothing to
compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from raytrain.rules.agreement import odd_ranks
from raytrain.text import plural

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


# -- the replicas ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Replicas:
    """The N-worker run's replicas: every rank's fingerprint of its weights and optimizer state
    after each step's update (`raytrain.instruments.agreement.fingerprint`), and how many ranks hold
    one copy of the model between them (1 under ddp, every rank a replica; all of them under
    fsdp, one sharded copy: nothing to compare, nothing fingerprinted)."""

    workers: int
    shards_per_replica: int = 1
    fingerprints: tuple[tuple[int, ...], ...] = ()  # [step - 1][rank], unsigned 64-bit

    @property
    def count(self) -> int:
        """How many copies of the model the workers hold."""
        return self.workers // max(1, self.shards_per_replica)

    @property
    def compared(self) -> bool:
        """Whether there are replicas to compare, and their fingerprints."""
        return self.count > 1 and bool(self.fingerprints)

    def odd(self, step: int) -> list[int]:
        """The ranks whose fingerprint after `step` differs from their shard's majority (`odd_ranks`)."""
        return odd_ranks(list(self.fingerprints[step - 1]), self.shards_per_replica)

    @property
    def first_difference(self) -> int | None:
        """The first step after which a replica differs (None: none does, or nothing compared)."""
        if not self.compared:
            return None
        return next((step for step in range(1, len(self.fingerprints) + 1) if self.odd(step)), None)

    def line(self) -> str:
        """What the check says of the replicas: that they agree, where they part, or that there are none."""
        if self.count <= 1:
            return (
                f"Replicas: one sharded copy: no replicas to compare (each of the {self.workers} workers holds a "
                "distinct shard of the weights and optimizer state)."
            )
        if not self.fingerprints:
            return "Replicas: not fingerprinted."
        steps = len(self.fingerprints)
        span = f"step {steps}" if steps == 1 else f"steps 1–{steps}"
        first = self.first_difference
        if first is None:
            return (
                f"Replicas agree: the {self.workers} workers' weights and optimizer state had the same fingerprint "
                f"after every compared step ({span}; after step {steps}: {_hex(self.fingerprints[-1][0])})."
            )
        parted = sum(1 for step in range(first, steps + 1) if self.odd(step))
        return f"Replicas differ from step {first}: {self._who(first)} (after {parted} of the {steps} steps)."

    def _who(self, step: int) -> str:
        odd, prints = self.odd(step), self.fingerprints[step - 1]
        named = ", ".join(f"rank {rank} ({_hex(prints[rank])})" for rank in odd)
        others = sorted({_hex(value) for rank, value in enumerate(prints) if rank not in odd})
        if not others:  # no majority
            two = " with two replicas" if self.count == 2 else ""
            return f"{named} differ, and{two} there is no majority to say which is wrong"
        verb = "differs" if len(odd) == 1 else "differ"
        return f"{named} {verb} from the other replicas' {', '.join(others)}"

    def cause(self) -> Cause:
        """The cause line of replicas that differ."""
        first = self.first_difference
        odd = self.odd(first) if first is not None else []
        ranks = f"rank{'s' if len(odd) != 1 else ''} {', '.join(str(rank) for rank in odd)}"
        majority = len(odd) < len(self.fingerprints[first - 1]) if first is not None else True
        what = (
            f"the weights and optimizer state of {ranks} no longer have the other replicas' fingerprint"
            if majority
            else f"the replicas' weights and optimizer state no longer have a common fingerprint ({ranks})"
        )
        return Cause(
            "the replicas' weights or optimizer state differ",
            f"After step {first} {what}. DDP's replicas start from the same weights and apply the same averaged "
            "gradients: they stay bit-identical unless something changes one of them outside the step.",
            "look for a change to the weights or the optimizer state that depends on the rank (code that reads the "
            "rank or world size in the model, the optimizer or a hook; a parameter set by hand; optimizer settings "
            f"that differ per rank). If the pipeline has none, the device or host of {ranks} may be faulty (silent "
            "data corruption): check again, and take it out of the cluster if it recurs.",
        )

    def cell(self, step: int) -> str:
        """The table's cell for `step`: the replicas' fingerprint (first 8 hex digits), or who differs."""
        if step > len(self.fingerprints):
            return ""
        odd = self.odd(step)
        if not odd:
            return _hex(self.fingerprints[step - 1][0])[:8]
        return f"rank {odd[0]} differs" if len(odd) == 1 else f"ranks {', '.join(map(str, odd))} differ"


def _hex(fingerprint: int) -> str:
    return f"{fingerprint % (1 << 64):016x}"


@dataclass
class Verdict:
    """What the check concludes: equivalent, or differs from a step with its causes."""

    comparison: Comparison
    causes: list[Cause] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)  # reruns that closed the gap, said as sentences
    replicas: Replicas | None = None  # the N-worker run's replicas, step by step (None: not fingerprinted)

    @property
    def replicas_differ(self) -> bool:
        return self.replicas is not None and self.replicas.first_difference is not None

    @property
    def equivalent(self) -> bool:
        """The losses and gradient norms agree with 1 worker's, and the replicas with each other."""
        return self.comparison.equivalent and not self.replicas_differ

    @property
    def exit_status(self) -> int:
        return 0 if self.equivalent else 1

    def lines(self) -> list[str]:
        c = self.comparison
        largest = c.largest
        judged = len(c.judged_rows)
        within = (
            f"largest relative difference {largest.difference:.1e} (step {largest.step}), within the tolerance "
            f"{c.tolerance:.0e}"
        )
        if self.equivalent:
            lines = [f"Equivalent: {c.workers} workers train like 1 over {plural(judged, 'step')}; {within}."]
        elif c.equivalent:  # the replicas differ
            lines = [
                f"Not equivalent: the {c.workers} workers' replicas differ from step {self.replicas.first_difference}, "
                f"though their loss and gradient norm agree with 1 worker's over {plural(judged, 'step')}; {within}."
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
        if self.replicas is not None:
            lines.append(self.replicas.line())
        causes = [*self.causes, *([self.replicas.cause()] if self.replicas_differ else [])]
        for cause in causes:
            lines.append(f"Cause: {cause.name}. {cause.evidence}")
            lines.append(f"  Fix: {cause.fix}")
        lines += [f"Confirmed: {sentence}" for sentence in self.confirmed]
        if not c.equivalent and not causes:
            lines.append(NO_CAUSE)
        return lines


NO_CAUSE = (
    "No probed cause found (BatchNorm, randomness in the model or loss, a loss that scales with the per-rank batch, "
    "state kept in the pipeline object, compute_loss reading raytrain.context()'s rank or world size). Look for "
    "other per-rank behaviour: code that reads the rank or world size (torch.distributed, environment variables), "
    "statistics over the batch inside the model, or buffers updated in forward."
)


# -- the table -------------------------------------------------------------------------------


def table_rows(
    comparison: Comparison, reordered: list[StepRecord] | None = None, replicas: Replicas | None = None
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table: step, both losses, both gradient norms, their
    differences, (given `reordered`) the 1-worker run against itself with its rows reordered,
    and (given `replicas` to compare) the replicas' fingerprint after the step."""
    shown = replicas if replicas is not None and replicas.compared else None
    n = comparison.workers
    header = ["step", "loss 1 worker", f"loss {n} workers", "rel diff", "grad norm 1", f"grad norm {n}", "rel diff"]
    if reordered is not None:
        header.append("1 vs 1 reordered")
    if shown is not None:
        header.append("replica fingerprint")
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
        if shown is not None:
            line.append(shown.cell(row.step))
        if not comparison.judged(row):
            line.append("  not judged")
        else:
            line.append("  <- differs" if row.difference > comparison.tolerance else "")
        rows.append(line)
    return header, rows


def _shown(value: float) -> str:
    return f"{value:.7g}" if math.isfinite(value) else str(value)
