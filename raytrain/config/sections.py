"""The sections of `TrainConfig`, one dataclass per concern: data, strategy, fault tolerance,
storage, observe, cluster and run (optimization is `raytrain.config.optimization`).

`TrainConfig` inherits them all, so every option stays a flat name (`cfg.lr`, a YAML key, a
flag). Each section checks its own fields in `own_problems` (called on the whole config, as
`Section.own_problems(cfg)`); a rule that reads two sections is in
`raytrain.config.checks.across_sections`. What the checks once kept in lists sits in each
field's metadata (`raytrain.fields`): `instead_of` (a knob that replaces another from the
layers below) and `on_resume` (what `--resume` makes of a change: `order`, `state`,
`invocation`; `raytrain.rules.resume`)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Literal

from raytrain.config.checks import EMPTY_NAME, FAULT_TOLERANCE_MODES, parse_workers, positive_int, resume_problems

Precision = Literal["fp32", "bf16", "fp16"]
ProgressMode = Literal["auto", "bar", "plain", "off"]
FaultTolerance = Literal[tuple(FAULT_TOLERANCE_MODES)]  # "restart", "per-step"
Strategy = Literal["ddp", "fsdp"]
PrefetchMode = Literal["auto", "on", "off"]
DEFAULT_STORAGE = "~/raytrain_results"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_URI_RE = re.compile(r"^(file://.*|[a-z][a-z0-9+.-]*://[^/?#]+(/[^?#]*)?(\?.*)?)$")


def key_value(text: str) -> tuple[str, str]:
    """`path=/data/train` -> ("path", "/data/train")."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"got {text!r}; expected KEY=VALUE, e.g. path=/data/train")
    return key.strip(), value.strip()


@dataclass(kw_only=True)
class DataSection:
    """How the training set reaches the workers."""

    skip_nan_rows: bool = field(default=False, metadata={"switch": True})
    """Drop rows holding NaN or inf (counted and reported) instead of stopping the run at the first one."""
    shuffle_window_rows: int | None = field(default=None, metadata={"default_text": "by size", "on_resume": "order"})
    """How the training set is held: 0 reads it once into memory, shared by every worker (a full shuffle each epoch); N
    streams it from Ray Data, each worker reading only its share, shuffled within a window of about N rows across
    the job (for data larger than memory); unset: in memory up to about 1 GiB, streamed beyond."""
    data_partitions: int = field(default=24, metadata={"on_resume": "order"})
    """Streamed training sets: each epoch their files (row groups) or blocks are dealt into this many partitions, each
    read by one worker. The order depends on it, not on the worker count; workers share partitions evenly when they
    divide it (24: 1, 2, 3, 4, 6, 8, 12 or 24 workers)."""
    prefetch: PrefetchMode = "auto"
    """Stage each step's batch while the step before it computes: cut on the host, pinned, copied to the GPU on a
    side stream (auto: on GPUs; on: also on CPUs, where the batch is only cut a step early; off: every batch
    copied when its step starts; so does --fault-tolerance per-step, whose steps may be taken again). The rows and
    their order are the same either way."""

    def own_problems(self) -> Iterable[tuple[str, str]]:
        yield from positive_int("data_partitions", self.data_partitions, 24)
        if self.shuffle_window_rows is not None and self.shuffle_window_rows < 0:
            yield (
                "shuffle_window_rows",
                f"got {self.shuffle_window_rows}; must be 0 (hold the data in memory) or a row count, e.g. "
                "--shuffle-window-rows 65536",
            )


@dataclass(kw_only=True)
class DDPConfig:
    """DistributedDataParallel performance flags, passed to `prepare_model`."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB: larger buckets mean fewer, bigger all-reduces."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the communication buckets: saves one copy of the gradients."""
    static_graph: bool = False
    """Declare the graph static (same used parameters every step) for extra overlap."""
    broadcast_buffers: bool = True
    """Sync buffers (BatchNorm running stats) from rank 0 every forward."""
    find_unused_parameters: bool = False
    """Needed only when some parameters get no gradient in a step; costs a graph walk."""


@dataclass(kw_only=True)
class StrategySection:
    """How the model is held, computed and wrapped on the workers."""

    precision: Precision = "fp32"
    """fp32, bf16 autocast, or fp16 autocast with a gradient scaler. Under --strategy fsdp, bf16 is FSDP2's
    mixed-precision policy (bf16 parameters in compute, fp32 gradient reduction)."""
    strategy: Strategy = "ddp"
    """How the model is held: ddp (every worker holds all of it, its gradients and optimizer state; gradients are
    averaged) or fsdp (FSDP2: each worker holds a shard of them, gathered block by block when needed, so a model
    that outgrows one worker trains). Checkpoints resume under either."""
    fsdp_reshard_after_forward: bool = True
    """With --strategy fsdp: free each block's gathered parameters after its forward (ZeRO-3, least memory);
    --no-fsdp-reshard-after-forward keeps them for the backward (ZeRO-2, one all-gather fewer per block)."""
    tf32: bool = True
    """At fp32 on a GPU, matmuls and convolutions on TF32 tensor cores (torch's "high" float32 precision: a 10-bit
    mantissa, several times faster on Ampere and later); --no-tf32 keeps full fp32. raytrain check always runs
    without."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them (the blocks of the
    pipeline's shard_modules): less memory for about one more forward of compute."""
    compile: bool = False
    """torch.compile the model: each block under --strategy fsdp, the whole model under ddp, before it is
    sharded or wrapped (needs a C++ compiler on CPU, Triton and a C compiler on GPU)."""
    sync_batchnorm: bool = False
    """Normalize BatchNorm layers with the statistics of the whole global batch across workers, as one worker would
    (torch's SyncBatchNorm on GPUs; raytrain's own all-reduced BatchNorm over gloo on CPUs), instead of each worker's
    share: costs a collective per BatchNorm layer per forward. `raytrain check` says when a pipeline needs it."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """DistributedDataParallel flags."""

    def own_problems(self) -> Iterable[tuple[str, str]]:
        if not 0 < self.ddp.bucket_cap_mb < math.inf:
            yield "ddp.bucket_cap_mb", f"got {self.ddp.bucket_cap_mb}; must be a positive size in MiB, e.g. 25"


@dataclass(kw_only=True)
class FaultToleranceSection:
    """What a failure costs: how it is recovered and how often the run checkpoints."""

    max_failures: int = 3
    """Failures recovered before the run fails (worker-group restarts; under per-step, replica replacements)."""
    fault_tolerance: FaultTolerance = "restart"
    """What a failed worker costs: restart (every worker restarts from the last checkpoint) or per-step (torchft: each
    worker is a replica group, the survivors keep stepping, the replacement heals from a live peer; needs pip
    install 'raytrain[ft]')."""
    replica_group_size: int = 1
    """With --fault-tolerance per-step and --strategy fsdp: workers per replica group (HSDP). Each group of K shards
    one copy of the model; the groups average their gradients through torchft, a lost worker takes its group out
    while the other groups keep stepping, and the group's replacement heals from a live group's shards. K must
    divide --workers (an elastic run's MIN and MAX alike: it counts in whole groups; docs/fault-tolerance.md)."""
    checkpoint_every_steps: int = 0
    """Also checkpoint every this many optimizer steps (0: at the end of each epoch only)."""
    checkpoint_every: Literal["auto"] | None = field(default=None, metadata={"instead_of": "checkpoint_every_steps"})
    """auto: checkpoint every so many steps, the interval chosen by Daly's rule from the run's measured stall per
    save and step time and the failure rate (--mtbf-hours, updated by the run's own failures), re-derived after
    every save and failure, printed when it changes (docs/fault-tolerance.md); instead of --checkpoint-every-steps."""
    mtbf_hours: float = 6335.0
    """With --checkpoint-every auto: the mean time between failures of one node, in hours, before the run has seen
    its own (default: Llama 3's 419 unexpected interruptions in 54 days on 2,048 nodes of 8 GPUs)."""
    checkpoint_min_steps: int = 10
    """With --checkpoint-every auto: the fewest steps between two checkpoints."""
    checkpoint_max_steps: int = 100_000
    """With --checkpoint-every auto: the most steps between two checkpoints."""
    num_checkpoints_to_keep: int = 2
    """Checkpoints kept in storage (the latest is always kept)."""
    checkpoint_async: bool = True
    """Write checkpoints in the background: the loop waits only while the state is copied to host memory
    (--no-checkpoint-async waits for every file: less host memory, and a worker lost right after a checkpoint
    never loses it)."""
    collective_timeout_s: float = 600.0
    """A collective (all-reduce, barrier) waiting longer than this fails the attempt."""

    def own_problems(self) -> Iterable[tuple[str, str]]:
        yield from positive_int("num_checkpoints_to_keep", self.num_checkpoints_to_keep, 2)
        if self.checkpoint_every_steps < 0:
            why = f"got {self.checkpoint_every_steps}; must be 0 (epoch ends only) or a positive step count"
            yield "checkpoint_every_steps", why
        yield from self._auto_interval_problems()
        if self.max_failures < -1:
            yield "max_failures", f"got {self.max_failures}; must be 0 or more (-1 retries forever)"
        yield from positive_int("replica_group_size", self.replica_group_size, 2)
        if not 0 < self.collective_timeout_s < math.inf:
            why = f"got {self.collective_timeout_s}; must be a positive number of seconds, e.g. 600"
            yield "collective_timeout_s", why

    def _auto_interval_problems(self) -> Iterable[tuple[str, str]]:
        """--checkpoint-every auto and its inputs (raytrain.rules.interval)."""
        if self.checkpoint_every == "auto" and self.checkpoint_every_steps > 0:
            yield (
                "checkpoint_every",
                f"got auto together with --checkpoint-every-steps {self.checkpoint_every_steps}; give one: "
                "--checkpoint-every auto chooses the interval from the measured costs, --checkpoint-every-steps N "
                "fixes it",
            )
        if not 0 < self.mtbf_hours < math.inf:
            yield (
                "mtbf_hours",
                f"got {self.mtbf_hours}; must be a positive number of hours per node, e.g. --mtbf-hours 6335",
            )
        yield from positive_int("checkpoint_min_steps", self.checkpoint_min_steps, 10)
        if self.checkpoint_min_steps >= 1 and self.checkpoint_max_steps < self.checkpoint_min_steps:
            yield (
                "checkpoint_max_steps",
                f"got {self.checkpoint_max_steps}, fewer than --checkpoint-min-steps {self.checkpoint_min_steps}; "
                "raise it or lower --checkpoint-min-steps",
            )


@dataclass(kw_only=True)
class StorageSection:
    """Where the run is written, under which name, and whether it continues."""

    storage: str = field(default=DEFAULT_STORAGE, metadata={"on_resume": "invocation"})
    """Where runs are written: STORAGE/NAME/. A directory shared by all nodes of a multi-node cluster,
    or an object store's URI (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, any URI pyarrow.fs resolves)."""
    name: str | None = field(
        default=None,
        metadata={"text": True, "default_text": "PIPELINE-YYYYmmdd-HHMMSS", "on_resume": "invocation"},
    )
    """Run name; default PIPELINE-YYYYmmdd-HHMMSS."""
    resume: bool = field(default=False, metadata={"switch": True, "on_resume": "invocation"})
    """Continue the existing run NAME from its last checkpoint."""

    def own_problems(self) -> Iterable[tuple[str, str]]:
        if not self.storage:
            yield "storage", "is empty; give a directory, e.g. --storage ~/raytrain_results"
        elif "://" in self.storage and not _URI_RE.match(self.storage):
            yield (
                "storage",
                f"got {self.storage!r}; give a directory or an object store's URI with its bucket, e.g. "
                "s3://my-bucket/raytrain or gs://my-bucket/raytrain",
            )
        if self.name is not None and not self.name.strip():
            yield "name", f"got {self.name!r}; {EMPTY_NAME} (PIPELINE-DATE-TIME)"
        elif self.name is not None and not _NAME_RE.match(self.name):
            yield "name", f"got {self.name!r}; use letters, digits, '.', '_' and '-' only, e.g. --name digits-lr3e-3"
        yield from resume_problems(self.resume, self.name)

    def settle_storage(self) -> None:
        """An object store's URI without its trailing slash (raytrain.rundir.storage); a
        directory (or file:// URI) as an absolute path."""
        if self.storage and "://" in self.storage and not self.storage.startswith("file://"):
            self.storage = self.storage.rstrip("/")
        elif self.storage:
            self.storage = self.storage.removeprefix("file://")
            self.storage = os.path.abspath(os.path.expanduser(self.storage))


@dataclass(kw_only=True)
class ObserveSection:
    """What the run records and shows while it goes: metrics, validation, trackers, progress, timing."""

    log_every_steps: int = 10
    """Write a metrics.jsonl row every this many optimizer steps (and at every epoch end)."""
    eval_every_steps: int | None = None
    """Also validate every this many optimizer steps (a metrics row with val_ figures, on the console and in
    TensorBoard); validation runs at every epoch end regardless."""
    eval_batches: int | None = None
    """Bound every validation pass to this many global batches of the validation set, the same rows every time so
    that passes compare (nanoGPT's eval_iters); default: all of it."""
    verbose: bool = field(
        default=False, metadata={"switch": True, "flags": ("-v", "--verbose"), "on_resume": "invocation"}
    )
    """Show Ray's own logs and the workers' output."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (http://HOST:5000, sqlite:///mlflow.db, or a directory): params, per-step metrics and the
    final model. Needs pip install 'raytrain[mlflow]'."""
    mlflow_experiment: str = "raytrain"
    """MLflow experiment the run is logged under."""
    wandb_project: str | None = None
    """Weights & Biases project (needs pip install wandb and wandb login; WANDB_MODE=offline works)."""
    progress: ProgressMode = field(default="auto", metadata={"on_resume": "invocation"})
    """Console progress: auto (a live bar on a terminal, plain lines otherwise), bar, plain or off."""
    progress_interval_s: float = field(default=10.0, metadata={"on_resume": "invocation"})
    """Seconds between plain progress lines when the output is not a terminal."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s at the run's precision, for the model FLOPs utilization (MFU) in the report and in
    raytrain bench; default: a table of known GPUs (raytrain.rules.flops.DEVICE_PEAK_TFLOPS)."""
    time_phases: bool = False
    """Synchronize the GPU around each step phase so the step-time split is exact (slower; for benchmarks)."""
    timing_warmup_steps: int = 3
    """Steps at the start of every epoch left out of the steady throughput (first-step allocation, caches)."""

    def own_problems(self) -> Iterable[tuple[str, str]]:
        yield from positive_int("eval_every_steps", self.eval_every_steps, 100)
        yield from positive_int("eval_batches", self.eval_batches, 20)
        yield from positive_int("log_every_steps", self.log_every_steps, 10)
        if self.timing_warmup_steps < 0:
            why = f"got {self.timing_warmup_steps}; must be 0 or more, e.g. --timing-warmup-steps 3"
            yield "timing_warmup_steps", why
        if not 0 < self.progress_interval_s < math.inf:
            why = f"got {self.progress_interval_s}; must be a positive number of seconds, e.g. 10"
            yield "progress_interval_s", why
        if self.peak_tflops is not None and not 0 < self.peak_tflops < math.inf:
            yield "peak_tflops", f"got {self.peak_tflops}; must be a positive number of TFLOP/s, e.g. --peak-tflops 989"


@dataclass(kw_only=True)
class WatchSection:
    """The faults that announce nothing: a slow rank every step waits for, a replica whose weights differ."""

    straggler_factor: float = 1.5
    """A rank whose own step time (its data wait, forward and optimizer step: the phases in which it waits for no
    other rank) is more than this many times the median of the others' is slow."""
    straggler_steps: int = 20
    """A rank slow for this many steps running is named a straggler: one "straggler" event (its rank, host, how much
    slower, and whether it waits for data or computes slowly), again only when that changes."""
    evict_stragglers: bool = False
    """With an elastic run (--workers MIN:MAX): a rank that stays a straggler for --straggler-evict-steps steps is
    treated as failed and its host kept out to the run's end: the run resizes without it (per-step: its replica group
    leaves, the others train on). Without it nothing is evicted."""
    straggler_evict_steps: int = 200
    """With --evict-stragglers: the steps running a rank must stay a straggler before it is evicted."""
    replica_check_steps: int | None = None
    """Compare the replicas' weights and optimizer state (a fingerprint of bit patterns, one small collective) every
    this many steps; default: before every checkpoint, and at least every 1,000 steps. A mismatch rolls the run back
    to the last checkpoint whose replicas agreed; 0 turns the check off."""

    def own_problems(self) -> Iterable[tuple[str, str]]:
        if not 1 < self.straggler_factor < math.inf:
            why = f"got {self.straggler_factor}; must be a ratio above 1, e.g. --straggler-factor 1.5"
            yield "straggler_factor", why
        yield from positive_int("straggler_steps", self.straggler_steps, 20)
        yield from positive_int("straggler_evict_steps", self.straggler_evict_steps, 200)
        # The default cannot be told from the same value given; any other, from any layer, was
        # meant to act, and without the switch nothing reads it.
        default = WatchSection.straggler_evict_steps
        if not self.evict_stragglers and self.straggler_evict_steps >= 1 and self.straggler_evict_steps != default:
            yield (
                "straggler_evict_steps",
                f"got {self.straggler_evict_steps} without --evict-stragglers, so nothing would be evicted: add "
                "--evict-stragglers (with --workers MIN:MAX) to evict a rank a straggler for that many steps, or "
                f"leave --straggler-evict-steps at its default {default}",
            )
        if self.replica_check_steps is not None and self.replica_check_steps < 0:
            why = f"got {self.replica_check_steps}; must be 0 (off) or a positive step count, e.g. 1000"
            yield "replica_check_steps", why


@dataclass(kw_only=True)
class ClusterSection:
    """Where the workers run and what each one holds."""

    workers: int | str = 2
    """Worker count `N`, or `MIN:MAX` for an elastic run; 0 runs the loop in this process (debugging)."""
    gpu: bool | None = field(default=None, metadata={"default_text": "auto"})
    """Train on GPUs (NCCL) or CPUs (gloo); None: GPUs when the cluster has any."""
    cpus_per_worker: float = 1.0
    """CPUs reserved by each training worker."""
    address: str | None = field(
        default=None, metadata={"default_text": "RAY_ADDRESS, else an embedded Ray", "on_resume": "invocation"}
    )
    """Ray cluster address; default RAY_ADDRESS, else an embedded local Ray."""

    @property
    def min_workers(self) -> int:
        return parse_workers(self.workers)[0]

    @property
    def max_workers(self) -> int:
        return parse_workers(self.workers)[1]

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    def own_problems(self) -> Iterable[tuple[str, str]]:
        try:
            parse_workers(self.workers)
        except ValueError as exc:
            yield "workers", str(exc)
        if not 0 < self.cpus_per_worker < math.inf:
            yield "cpus_per_worker", f"got {self.cpus_per_worker}; must be a positive number of CPUs, e.g. 1"


@dataclass(kw_only=True)
class RunSection:
    """What is trained beyond the sections above: the seed and the pipeline's own options."""

    seed: int = field(default=0, metadata={"on_resume": "order"})
    """One seed for model init on every rank and for the data order of every epoch."""
    pipeline_args: dict = field(
        default_factory=dict,
        metadata={"flags": "--pipeline-arg", "parse": key_value, "repeat": True, "metavar": "KEY=VALUE"},
    )
    """An option of the pipeline itself, repeatable (e.g. the parquet pipeline's --pipeline-arg path=DIR; YAML: a
    mapping)."""

    def own_problems(self) -> Iterable[tuple[str, str]]:
        if self.seed < 0:
            yield "seed", f"got {self.seed}; must be 0 or more"
