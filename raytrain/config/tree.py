"""The one typed configuration tree of a run.

Every knob of a run lives here, with its meaning and unit (its text is the flag's `--help`). `TrainConfig` checks
itself in `__post_init__` and raises one `ConfigError` listing every problem, each
naming the option, the value received and the fix. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, get_args

from raytrain.config.checks import did_you_mean, parse_workers, problems_of
from raytrain.errors import ConfigError

LRRule = Literal["linear", "sqrt", "none"]
Precision = Literal["fp32", "bf16", "fp16"]
ScheduleName = Literal["cosine", "constant", "linear", "step", "onecycle"]
OptimizerName = Literal["adamw", "sgd", "lamb"]
ProgressMode = Literal["auto", "bar", "plain", "off"]
FaultTolerance = Literal["restart", "per-step"]
Strategy = Literal["ddp", "fsdp"]
PrefetchMode = Literal["auto", "on", "off"]
LR_RULES = get_args(LRRule)
# Knobs of which a layer (pipeline defaults < --config < flags) that names one replaces the other below it.
EXCLUSIVE_PAIRS = (
    {"global_batch_size", "batch_size_per_worker"},
    {"epochs", "max_steps"},
    {"warmup_epochs", "warmup_steps"},
    {"checkpoint_every", "checkpoint_every_steps"},
)
DEFAULT_STORAGE = "~/raytrain_results"


def comma_numbers(text: str) -> list[float | int]:
    """`30,60,80` -> [30, 60, 80] (epochs may be fractional: 0.5,1.5)."""
    try:
        values = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"got {text!r}; expected comma-separated numbers, e.g. 30,60") from None
    return [int(v) if v.is_integer() else v for v in values]


def key_value(text: str) -> tuple[str, str]:
    """`path=/data/train` -> ("path", "/data/train")."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"got {text!r}; expected KEY=VALUE, e.g. path=/data/train")
    return key.strip(), value.strip()


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
class TrainConfig:
    """Everything a `raytrain train` run needs to know; README.md, 'Command line', says how to give it."""

    epochs: int | None = field(default=None, metadata={"default_text": "5; none with --max-steps alone"})
    """Passes over the training set (each one every row once). With --max-steps too: whichever comes first."""
    max_steps: int | None = None
    """Stop after this many optimizer steps, mid-epoch if need be (a checkpoint and the final model there); the
    schedule spans them. With --epochs too: whichever comes first."""
    workers: int | str = 2
    """Worker count `N`, or `MIN:MAX` for an elastic run; 0 runs the loop in this process (debugging)."""
    gpu: bool | None = field(default=None, metadata={"default_text": "auto"})
    """Train on GPUs (NCCL) or CPUs (gloo); None: GPUs when the cluster has any."""
    global_batch_size: int | None = None
    """Samples per optimizer step across all workers, whatever the worker count."""
    batch_size_per_worker: int | None = field(default=None, metadata={"default_text": "32 without --global-batch-size"})
    """Samples per optimizer step on each worker (global = this × workers)."""
    micro_batch_size: int | None = None
    """Most samples one worker puts through one forward pass; larger shares use gradient accumulation."""
    lr: float = 1e-3
    """Learning rate tuned for `reference_batch_size` (the single-GPU recipe)."""
    lr_scaling: LRRule = "linear"
    """How the peak rate follows the global batch: linear, sqrt or none."""
    reference_batch_size: int | None = field(default=None, metadata={"default_text": "the per-worker batch"})
    """The batch `lr` was tuned for."""
    warmup_epochs: float | None = field(default=None, metadata={"default_text": "1; 0 with --warmup-steps"})
    """Gradual warmup from `lr` (or from warmup_start_factor × the peak) to the scaled peak, in epochs (counted in
    samples)."""
    warmup_steps: int | None = None
    """The warmup in optimizer steps instead of epochs (counted in samples: steps × the planned global batch, so a
    resize never changes it)."""
    schedule: ScheduleName = "cosine"
    """After warmup: cosine (to 0), constant, linear (to 0), step (×lr_gamma at each of lr_milestones) or onecycle; a
    pipeline's lr_factor(progress) replaces it."""
    lr_milestones: list | None = field(default=None, metadata={"parse": comma_numbers, "metavar": "EPOCH,..."})
    """With --schedule step: the epochs at which the rate is multiplied by lr_gamma, e.g. 30,60,80."""
    lr_gamma: float = 0.1
    """With --schedule step: the factor applied at each milestone."""
    warmup_start_factor: float | None = None
    """Warmup starts at this fraction of the peak rate (e.g. 0.01); default: at lr, the unscaled rate (Goyal et al.)."""
    optimizer: OptimizerName = "adamw"
    """adamw, sgd (momentum, optionally Nesterov) or lamb (large-batch Adam, from pytorch-optimizer); a pipeline's
    build_optimizer replaces it."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    """SGD with Nesterov momentum."""
    weight_decay: float = 0.01
    """Weight decay (decoupled for adamw and lamb, L2 for sgd)."""
    decay_norm_and_bias: bool = True
    """Apply weight decay to biases and normalization weights too (--no-decay-norm-and-bias: only to weight matrices
    and kernels)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this (after unscaling, under fp16); none by default."""
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
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them (the blocks of the
    pipeline's shard_modules): less memory for about one more forward of compute."""
    compile: bool = False
    """torch.compile the model: each block under --strategy fsdp, the whole model under ddp, before it is
    sharded or wrapped (needs a C++ compiler on CPU, Triton on GPU)."""
    seed: int = 0
    """One seed for model init on every rank and for the data order of every epoch."""
    max_failures: int = 3
    """Failures recovered before the run fails (worker-group restarts; under per-step, replica replacements)."""
    fault_tolerance: FaultTolerance = "restart"
    """What a failed worker costs: restart (every worker restarts from the last checkpoint) or per-step (torchft: each
    worker is a replica group, the survivors keep stepping, the replacement heals from a live peer; needs pip
    install 'raytrain[ft]')."""
    checkpoint_every_steps: int = 0
    """Also checkpoint every this many optimizer steps (0: at the end of each epoch only)."""
    checkpoint_every: Literal["auto"] | None = None
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
    log_every_steps: int = 10
    """Write a metrics.jsonl row every this many optimizer steps (and at every epoch end)."""
    eval_every_steps: int | None = None
    """Also validate every this many optimizer steps (a metrics row with val_ figures, on the console and in
    TensorBoard); validation runs at every epoch end regardless."""
    eval_batches: int | None = None
    """Bound every validation pass to this many global batches of the validation set, the same rows every time so
    that passes compare (nanoGPT's eval_iters); default: all of it."""
    storage: str = DEFAULT_STORAGE
    """Where runs are written: STORAGE/NAME/. A directory shared by all nodes of a multi-node cluster,
    or an object store's URI (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, any URI pyarrow.fs resolves)."""
    name: str | None = field(default=None, metadata={"text": True, "default_text": "PIPELINE-YYYYmmdd-HHMMSS"})
    """Run name; default PIPELINE-YYYYmmdd-HHMMSS."""
    resume: bool = field(default=False, metadata={"switch": True})
    """Continue the existing run NAME from its last checkpoint."""
    collective_timeout_s: float = 600.0
    """A collective (all-reduce, barrier) waiting longer than this fails the attempt."""
    cpus_per_worker: float = 1.0
    """CPUs reserved by each training worker."""
    address: str | None = field(default=None, metadata={"default_text": "RAY_ADDRESS, else an embedded Ray"})
    """Ray cluster address; default RAY_ADDRESS, else an embedded local Ray."""
    verbose: bool = field(default=False, metadata={"switch": True, "flags": ("-v", "--verbose")})
    """Show Ray's own logs and the workers' output."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (http://HOST:5000, sqlite:///mlflow.db, or a directory): params, per-step metrics and the
    final model. Needs pip install 'raytrain[mlflow]'."""
    mlflow_experiment: str = "raytrain"
    """MLflow experiment the run is logged under."""
    wandb_project: str | None = None
    """Weights & Biases project (needs pip install wandb and wandb login; WANDB_MODE=offline works)."""
    progress: ProgressMode = "auto"
    """Console progress: auto (a live bar on a terminal, plain lines otherwise), bar, plain or off."""
    progress_interval_s: float = 10.0
    """Seconds between plain progress lines when the output is not a terminal."""
    skip_nan_rows: bool = field(default=False, metadata={"switch": True})
    """Drop rows holding NaN or inf (counted and reported) instead of stopping the run at the first one."""
    shuffle_window_rows: int | None = field(default=None, metadata={"default_text": "by size"})
    """How the training set is held: 0 reads it once into memory, shared by every worker (a full shuffle each epoch); N
    streams it from Ray Data, each worker reading only its share, shuffled within a window of about N rows across
    the job (for data larger than memory); unset: in memory up to about 1 GiB, streamed beyond."""
    data_partitions: int = 24
    """Streamed training sets: each epoch their files (row groups) or blocks are dealt into this many partitions, each
    read by one worker. The order depends on it, not on the worker count; workers share partitions evenly when they
    divide it (24: 1, 2, 3, 4, 6, 8, 12 or 24 workers)."""
    sync_batchnorm: bool = False
    """Normalize BatchNorm layers with the statistics of the whole global batch across workers, as one worker would
    (torch's SyncBatchNorm on GPUs; raytrain's own all-reduced BatchNorm over gloo on CPUs), instead of each worker's
    share: costs a collective per BatchNorm layer per forward. `raytrain check` says when a pipeline needs it."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s at the run's precision, for the model FLOPs utilization (MFU) in the report and in
    raytrain bench; default: a table of known GPUs (raytrain.rules.flops.DEVICE_PEAK_TFLOPS)."""
    time_phases: bool = False
    """Synchronize the GPU around each step phase so the step-time split is exact (slower; for benchmarks)."""
    prefetch: PrefetchMode = "auto"
    """Stage each step's batch while the step before it computes: cut on the host, pinned, copied to the GPU on a
    side stream (auto: on GPUs; on: also on CPUs, where the batch is only cut a step early; off: every batch
    copied when its step starts; so does --fault-tolerance per-step, whose steps may be taken again). The rows and
    their order are the same either way."""
    timing_warmup_steps: int = 3
    """Steps at the start of every epoch left out of the steady throughput (first-step allocation, caches)."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """DistributedDataParallel flags."""
    pipeline_args: dict = field(
        default_factory=dict,
        metadata={"flags": "--pipeline-arg", "parse": key_value, "repeat": True, "metavar": "KEY=VALUE"},
    )
    """An option of the pipeline itself, repeatable (e.g. the parquet pipeline's --pipeline-arg path=DIR; YAML: a
    mapping)."""

    def __post_init__(self) -> None:
        if isinstance(self.ddp, Mapping):
            self.ddp = _build(DDPConfig, dict(self.ddp), prefix="ddp.")
        if not isinstance(self.ddp, DDPConfig):
            raise ConfigError(
                [
                    (
                        "ddp",
                        f"got {self.ddp!r} ({type(self.ddp).__name__}); expected a mapping of DDP flags, e.g. ddp: "
                        f"{{bucket_cap_mb: 25}}",
                    )
                ]
            )
        if self.global_batch_size is None and self.batch_size_per_worker is None:
            self.batch_size_per_worker = 32
        if self.epochs is None and self.max_steps is None:
            self.epochs = 5
        if self.warmup_epochs is None:
            self.warmup_epochs = 0.0 if self.warmup_steps is not None else 1.0
        problems = problems_of(self)
        if problems:
            raise ConfigError(problems)
        if self.storage and "://" in self.storage and not self.storage.startswith("file://"):
            self.storage = self.storage.rstrip("/")  # an object store's URI (raytrain.rundir.storage)
        elif self.storage:
            self.storage = self.storage.removeprefix("file://")
            self.storage = os.path.abspath(os.path.expanduser(self.storage))

    # -- derived, read-only views --------------------------------------------------------
    @property
    def min_workers(self) -> int:
        return parse_workers(self.workers)[0]

    @property
    def max_workers(self) -> int:
        return parse_workers(self.workers)[1]

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Build from a plain mapping (YAML); unknown keys are errors with a suggestion."""
        return _build(cls, dict(values))


def merge_layers(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; `ddp.x` flags and `ddp: {x: ..}` mappings merge into one ddp mapping."""
    merged: dict[str, Any] = {}
    for layer in layers:
        # A layer that sets one knob of a pair replaces the other from the layers below
        # (`--global-batch-size` overrides a pipeline's `batch_size_per_worker`; `--max-steps`
        # alone its `epochs`); one layer that sets both keeps both.
        given = {key.replace("-", "_") for key in layer}
        for pair in EXCLUSIVE_PAIRS:
            knobs = pair & given
            if len(knobs) == 1:
                merged.pop(*(pair - knobs), None)
        for key, value in layer.items():
            key = key.replace("-", "_")
            if key.startswith("ddp."):
                merged.setdefault("ddp", {})[key[4:]] = value
            elif key == "ddp" and isinstance(value, dict):
                merged.setdefault("ddp", {}).update(value)
            elif key == "pipeline_args" and _pairs(value):
                merged.setdefault("pipeline_args", {}).update(dict(value))
            else:
                merged[key] = value
    return merged


def _pairs(value: Any) -> bool:
    """A mapping, or (key, value) pairs (repeated --pipeline-arg): what merges key by key.
    Anything else is left for the type check to name."""
    if isinstance(value, dict):
        return True
    return isinstance(value, list) and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in value)


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    values = {str(key): value for key, value in values.items()}
    unknown = [key for key in values if key.replace("-", "_") not in names]
    if unknown:
        known = ", ".join(names)
        raise ConfigError(
            [
                (prefix + key, f"unknown option{did_you_mean(key.replace('-', '_'), names)}; known: {known}")
                for key in unknown
            ]
        )
    return cls(**{key.replace("-", "_"): value for key, value in values.items()})
