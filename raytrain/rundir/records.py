"""The typed records of a run directory: a metrics row, an event, the summary, the progress.

Each holds the keys DESIGN fixes, is written by `to_json` and read back by `from_json`
(unknown keys are kept in `extra`, so a newer run directory still reads). These classes
are the only place a key of a run file is spelled.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

# The files of STORAGE/NAME/, by role.
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
LIVE = "live.jsonl"
PROGRESS = "progress.json"
SUMMARY = "summary.json"
MODEL = "model.pt"  # the final model, a plain state_dict
HEARTBEATS = "heartbeats"  # each rank's last phase and step (node-local state, read to name a hung rank)
REPORT = "report.md"
PLOTS = "plots"

# Keys of a metrics row beyond its fields: every row's `loss` is the mean over the steps since the
# previous row (the window); the epoch's mean, on the epoch's row and the run's last, is this.
EPOCH_LOSS = "epoch_loss"
# A multi-worker run's step rows: each rank's own seconds per step over the window, by rank (its data
# wait, forward and optimizer step: `raytrain.rules.stragglers`); the report plots them.
RANK_STEP_S = "rank_step_s"


class Kind:
    """The kinds of event line in events.jsonl."""

    PLAN = "plan"  # the batch plan and rate of a fresh start
    RESIZE = "resize"  # training continues with another worker count
    RESTORE = "restore"  # an attempt restarted from a checkpoint (same worker count)
    DATA = "data"  # what the data costs the run (skipped rows, uneven partitions)
    EPOCH = "epoch"  # an epoch ended (its line for the console)
    DONE = "done"  # training finished
    INTERRUPTED = "interrupted"  # stopped on request, with a checkpoint at that step
    QUORUM = "quorum"  # per-step mode: the replicas stepping together changed (a loss, a rejoin)
    STALL = "stall"  # per-step mode: a replica stuck in a step leaves to be replaced
    EVAL = "eval"  # a validation pass between epoch ends (--eval-every-steps), or at the step budget's end
    MEMORY = "memory"  # what each worker holds of the model's state, after an attempt's first step
    SKIPPED = "skipped"  # an unusable checkpoint was passed over for an earlier one
    NOTE = "note"  # something about the run's setup worth knowing (an optimizer that leaves parameters out)
    STRAGGLER = "straggler"  # a rank every step waits for (or, `ended`, no longer): raytrain.rules.stragglers
    EVICTED = "evicted"  # --evict-stragglers: a straggler's host taken out of the run
    PREEMPTED = "preempted"  # a preemption notice (a drain, SIGTERM): its ranks leave at a step boundary
    REPLICA_MISMATCH = "replica_mismatch"  # replicas' weights differ: back to a checkpoint, or stop (`recurred`)
    COMPILE = "compile"  # --compile: the graphs each rank built by its first compiled steps, or that it runs eager

    # Events worth a line in the report and a mark on the plots.
    MARKED: ClassVar[tuple[str, ...]] = (RESIZE, RESTORE, QUORUM)


class _Record:
    """to_json/from_json for a dataclass whose last field is `extra` (the keys it does not name)."""

    @classmethod
    def from_json(cls, values: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
        known = {k: v for k, v in values.items() if k in names}
        return cls(**known, extra={k: v for k, v in values.items() if k not in names})

    def to_json(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**values, **self.extra}

    def get(self, key: str, default: Any = None) -> Any:
        """A value by the key the file spells (a field, else one of `extra`)."""
        if key != "extra" and key in self.__dataclass_fields__:
            return getattr(self, key)
        return self.extra.get(key, default)


@dataclass
class MetricsRow(_Record):
    """A line of metrics.jsonl: one per log window, and one at each epoch's end (`epoch_end`).

    `extra` holds the validation metrics (`val_loss`, `val_<name>`) and the pipeline's own.
    """

    epoch: int
    step: int
    samples_seen: int = 0
    world_size: int = 0
    global_batch_size: int = 0
    lr: float | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    time_s: float = 0.0
    epoch_end: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        values = super().to_json()
        if not self.epoch_end:
            values.pop("epoch_end")  # written only on the epoch's row, as DESIGN has it
        return values

    @property
    def validation(self) -> dict[str, Any]:
        """`val_loss`, `val_<name>`: the validation metrics of an epoch's row."""
        return {k: v for k, v in self.extra.items() if k.startswith("val_")}


@dataclass
class Event(_Record):
    """A line of events.jsonl: `kind` (see `Kind`), a sentence for people, and its figures
    (`world_size`, `previous_world_size`, `step`, `epoch`, … in `extra`)."""

    kind: str
    message: str
    time: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        return self.extra.get("step")

    @property
    def last_recorded(self) -> tuple[int, float] | None:
        """An attempt's event: (step, time) of the last training recorded before it (a metrics or
        live row), from which the steps redone and the time to recover are counted."""
        step, at = self.extra.get("last_step"), self.extra.get("last_step_time")
        return (step, at) if isinstance(step, int) and isinstance(at, (int, float)) else None

    @property
    def recovers_a_failure(self) -> bool:
        """A restart from a checkpoint, or training on with fewer workers (a resize, or a
        per-step quorum that lost a replica)."""
        if self.kind == Kind.RESTORE:
            return True
        sizes = self.extra.get("world_size"), self.extra.get("previous_world_size")
        return self.kind in (Kind.RESIZE, Kind.QUORUM) and None not in sizes and sizes[0] < sizes[1]


@dataclass
class Summary(_Record):
    """summary.json: how the run ended (strict JSON: a non-finite number is written as null).

    `status` is finished, failed, interrupted or diverged (a tune trial stopped early by ASHA:
    stopped); `error` is the first line of the cause when it did not finish. It covers the whole
    run across resumes: the position, the final figures and `wall_time_s`, summed over the
    invocations that wrote a summary (a driver killed outright leaves none, and its time is not
    counted).
    """

    status: str
    epochs: int = 0
    steps: int = 0
    samples_seen: int = 0
    wall_time_s: float = 0.0
    steady_samples_per_s: float | None = None
    steady_steps: int | None = None
    world_sizes: list[int] = field(default_factory=list)
    failures_recovered: int = 0
    """Worker or node failures the run trained on after (restarts, shrinks, lost replicas)."""
    preemptions: int = 0
    """Preemption notices (a drain, SIGTERM) the run left a node on and trained on after: not failures."""
    resumes: int = 0
    """1 when this invocation continued the run from a checkpoint (--resume)."""
    interruptions: int = 0
    """1 when this invocation was stopped by SIGINT or SIGTERM."""
    checkpoints_skipped: int = 0
    """Unusable checkpoints passed over for an earlier one."""
    final_metrics: dict[str, Any] = field(default_factory=dict)
    """`loss`: the mean training loss of the last logged window (its steps: `final_loss_steps`);
    `epoch_loss`: the mean over the last epoch (so far, when the run ended inside one); `val_*`:
    the last validation pass."""
    final_loss_steps: list[int] | None = None
    """[first, last]: the steps `final_metrics.loss` is the mean over."""
    starts: int = 1
    """Invocations that trained the run (the first, then every --resume); `wall_time_s` is their sum."""
    best_checkpoint: str | None = None
    model_path: str | None = None
    goodput: dict[str, Any] | None = None
    """The run's goodput and where the rest of its wall time went (`Goodput`'s keys), across resumes."""
    compile: dict[str, Any] | None = None
    """Under --compile (absent otherwise), the last attempt's: `graphs`, built by each rank, `seconds`,
    each rank's compiling, and `compiled`, whether every rank built a graph (if not, the model ran
    eager there; null figures: no sync counted them)."""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        values = super().to_json()
        for key in ("error", "goodput", "compile"):
            if values[key] is None:
                values.pop(key)
        return values


@dataclass
class Goodput(_Record):
    """summary.json's `goodput` (raytrain.rules.accounting): seconds of the run's wall time, summed
    over its invocations, by where they went."""

    goodput: float | None
    """Time on the steps that were kept over the wall time (0 to 1)."""
    wall_s: float = 0.0
    kept_steps_s: float = 0.0
    """The steps of the final position at the steady step time."""
    step_s: float = 0.0
    """The steady step time the kept steps are counted at."""
    start_s: float = 0.0
    """From each invocation's start to its first steps."""
    checkpoint_stall_s: float = 0.0
    """The loop's wait at the saves the position kept."""
    recovery_s: float = 0.0
    """From the last record before each failure (or resize) to training again, less the steps redone."""
    preemption_s: float = 0.0
    """The same for each preemption notice the run left a node on (`preemptions`), apart from failures."""
    redone_s: float = 0.0
    """Steps trained again after a failure (those since the checkpoint restored; one under per-step)."""
    validation_s: float | None = None
    """Validation passes (None: not recorded by this run; then part of other_s)."""
    other_s: float = 0.0
    """The rest: warm-up steps beyond the steady step time, epoch ends, the final save."""
    failures: int = 0
    """Interruptions accounted: restarts, resizes and quorums that lost a replica (preemptions apart)."""
    preemptions: int = 0
    """Restarts and lost replicas that came of a preemption notice (a `preempted` event)."""
    checkpoints: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Progress(_Record):
    """progress.json: where rank 0's training stands (rewritten at the end of an attempt)."""

    epoch: int = 0
    step: int = 0
    samples_seen: int = 0
    steady_samples_per_s: float | None = None
    steady_steps: int | None = None
    world_sizes: list[int] = field(default_factory=list)
    status: str = ""
    time: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StoredRun:
    """What a run directory says about the run before it resumes: its resolved config, its
    pipeline, and its furthest checkpoint that can be read with the position stored there."""

    run_dir: Any  # a Store (raytrain.rundir.storage): a directory or an object store's prefix
    config: dict[str, Any]
    pipeline: str | None
    checkpoint: Any  # its furthest complete checkpoint: a Path, or a Store on an object store; None
    position: dict[str, Any]
    passed_over: list[str] = field(default_factory=list)  # why each further checkpoint cannot be resumed from

    @property
    def mid_epoch(self) -> bool:
        return bool(self.position.get("epoch_offset"))
