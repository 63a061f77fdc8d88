"""The one typed configuration tree of a run.

Every knob of DESIGN.md lives here, with its meaning and unit. `TrainConfig` checks
itself in `__post_init__` and raises one `ConfigError` listing every problem, each
naming the option, the value received and the fix. Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, get_args

from raytrain import fields
from raytrain.errors import ConfigError
from raytrain.fields import flag_name
from raytrain.rules import resume

LRRule = Literal["linear", "sqrt", "none"]
Precision = Literal["fp32", "bf16", "fp16"]
ScheduleName = Literal["cosine", "constant", "linear", "step", "onecycle"]
OptimizerName = Literal["adamw", "sgd", "lamb"]
ProgressMode = Literal["auto", "bar", "plain", "off"]
FaultTolerance = Literal["restart", "per-step"]
LR_RULES = get_args(LRRule)
DEFAULT_STORAGE = "~/raytrain_results"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


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
    """Everything a `raytrain train` run needs to know; see DESIGN.md, 'Meaning of the knobs'."""

    epochs: int = 5
    """Passes over the training set."""
    workers: int | str = 2
    """Worker count `N`, or `MIN:MAX` for an elastic run; 0 runs the loop in this process (debugging)."""
    gpu: bool | None = None
    """Train on GPUs (NCCL) or CPUs (gloo); None: GPUs when the cluster has any."""
    global_batch_size: int | None = None
    """Samples per optimizer step across all workers, whatever the worker count."""
    batch_size_per_worker: int | None = None
    """Samples per optimizer step on each worker (global = this × workers). Default 32."""
    micro_batch_size: int | None = None
    """Most samples one worker puts through one forward pass; larger shares use gradient accumulation."""
    lr: float = 1e-3
    """Learning rate tuned for `reference_batch_size` (the single-GPU recipe)."""
    lr_scaling: LRRule = "linear"
    """How the peak rate follows the global batch: linear, sqrt or none."""
    reference_batch_size: int | None = None
    """The batch `lr` was tuned for. Default: the per-worker batch."""
    warmup_epochs: float = 1.0
    """Gradual warmup from `lr` (or from warmup_start_factor × the peak) to the scaled peak, in epochs (counted in
    samples)."""
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
    """fp32, bf16 autocast, or fp16 autocast with a gradient scaler."""
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
    num_checkpoints_to_keep: int = 2
    """Checkpoints kept in storage (the latest is always kept)."""
    log_every_steps: int = 10
    """Write a metrics.jsonl row every this many optimizer steps (and at every epoch end)."""
    storage: str = DEFAULT_STORAGE
    """Where runs are written: STORAGE/NAME/. Must be shared by all nodes of a multi-node cluster."""
    name: str | None = None
    """Run name; default PIPELINE-YYYYmmdd-HHMMSS."""
    resume: bool = field(default=False, metadata={"switch": True})
    """Continue the existing run NAME from its last checkpoint."""
    collective_timeout_s: float = 600.0
    """A collective (all-reduce, barrier) waiting longer than this fails the attempt."""
    cpus_per_worker: float = 1.0
    """CPUs reserved by each training worker."""
    address: str | None = None
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
    shuffle_window_rows: int | None = None
    """How the training set is held: 0 reads it once into memory, shared by every worker (a full shuffle each epoch); N
    streams it from Ray Data, each worker reading only its share, shuffled within a window of about N rows across
    the job (for data larger than memory); unset: in memory up to about 1 GiB, streamed beyond."""
    data_partitions: int = 24
    """Streamed training sets: each epoch their files (row groups) or blocks are dealt into this many partitions, each
    read by one worker. The order depends on it, not on the worker count; workers share partitions evenly when they
    divide it (24: 1, 2, 3, 4, 6, 8, 12 or 24 workers)."""
    time_phases: bool = False
    """Synchronize the GPU around each step phase so the step-time split is exact (slower; for benchmarks)."""
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
        problems = list(_check_types(self)) + list(_check_types(self.ddp, prefix="ddp."))
        if not problems:
            # in the order of the fields, as --help lists them
            order = {name: index for index, name in enumerate(f.name for f in dataclasses.fields(self))}
            found = [*_check_choices(self), *_check_values(self)]
            problems = sorted(found, key=lambda problem: order.get(problem[0].split(".")[0], len(order)))
        if problems:
            raise ConfigError(problems)
        if self.storage:
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
    batch_knobs = {"global_batch_size", "batch_size_per_worker"}
    for layer in layers:
        # A layer that sets one batch knob replaces the other from the layers below
        # (`--global-batch-size` overrides a pipeline's `batch_size_per_worker`).
        knobs = batch_knobs & {key.replace("-", "_") for key in layer}
        if len(knobs) == 1:
            merged.pop(*(batch_knobs - knobs), None)
        for key, value in layer.items():
            key = key.replace("-", "_")
            if key.startswith("ddp."):
                merged.setdefault("ddp", {})[key[4:]] = value
            elif key == "ddp" and isinstance(value, dict):
                merged.setdefault("ddp", {}).update(value)
            elif key == "pipeline_args" and isinstance(value, (dict, list)):
                merged.setdefault("pipeline_args", {}).update(dict(value))
            else:
                merged[key] = value
    return merged


def parse_workers(value: int | str) -> tuple[int, int]:
    """`4` -> (4, 4); `"2:8"` -> (2, 8). Raises ValueError with the fix."""
    if isinstance(value, bool):
        raise ValueError(f"got {value!r}; give a worker count N or MIN:MAX, e.g. 2 or 2:8")
    if isinstance(value, int):
        low = high = value
    else:
        text = str(value).strip()
        parts = text.split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"got {value!r}; give a worker count N or MIN:MAX, e.g. 2 or 2:8")
        low, high = int(parts[0]), int(parts[-1])
    if low < 0 or high < low:
        raise ValueError(f"got {value!r}; need 0 <= MIN <= MAX, e.g. 2:8")
    if low == 0 and high != 0:
        raise ValueError(f"got {value!r}; an elastic run needs MIN >= 1, e.g. 1:{high}")
    return low, high


# -- checks ----------------------------------------------------------------------------


def _check_types(cfg: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    """Each field's value against its type."""
    for option in fields.options(type(cfg)):
        value = getattr(cfg, option.name)
        if not dataclasses.is_dataclass(value) and not option.accepts(value):
            yield prefix + option.name, f"got {value!r} ({type(value).__name__}); expected {option.words()}"


def _check_choices(cfg: Any) -> Iterable[tuple[str, str]]:
    """A `Literal` field's value against its choices (from the field's type)."""
    for option in fields.options(type(cfg)):
        value = getattr(cfg, option.name)
        if option.choices is not None and value is not None and value not in option.choices:
            choices = [str(choice) for choice in option.choices]
            yield option.name, f"got {value!r}; choose one of {', '.join(choices)}{_close(value, choices)}"


def _check_values(c: TrainConfig) -> Iterable[tuple[str, str]]:
    def positive_int(name: str, value: int | None, example: int) -> Iterable[tuple[str, str]]:
        if value is not None and value < 1:
            yield name, f"got {value}; must be a positive integer, e.g. {flag_name(name)} {example}"

    yield from positive_int("epochs", c.epochs, 5)
    yield from positive_int("global_batch_size", c.global_batch_size, 256)
    yield from positive_int("batch_size_per_worker", c.batch_size_per_worker, 32)
    yield from positive_int("micro_batch_size", c.micro_batch_size, 16)
    yield from positive_int("reference_batch_size", c.reference_batch_size, 32)
    yield from positive_int("log_every_steps", c.log_every_steps, 10)
    yield from positive_int("num_checkpoints_to_keep", c.num_checkpoints_to_keep, 2)

    try:
        min_workers, max_workers = parse_workers(c.workers)
    except ValueError as exc:
        yield "workers", str(exc)
        min_workers = max_workers = None

    if c.fault_tolerance == "per-step" and max_workers is not None:
        if max_workers == 0:
            yield (
                "fault_tolerance",
                "got per-step with --workers 0 (the loop in this process): it needs Ray workers; give --workers N",
            )
        elif min_workers != max_workers:
            yield (
                "fault_tolerance",
                f"got per-step with --workers {c.workers}: per-step replaces a failed worker in place and keeps the "
                f"count fixed; give --workers {max_workers}, or keep --fault-tolerance restart for an elastic run",
            )
    if c.fault_tolerance == "per-step" and importlib.util.find_spec("torchft") is None:
        yield (
            "fault_tolerance",
            "got per-step, but torchft is not installed; install it with pip install 'raytrain[ft]' (torchft-nightly), "
            "or use --fault-tolerance restart",
        )
    if c.fault_tolerance == "per-step" and c.max_failures == 0:
        yield (
            "max_failures",
            f"got {c.max_failures} with --fault-tolerance per-step: a replacement is a recovered failure; give "
            "--max-failures 3",
        )

    if c.global_batch_size is not None and c.batch_size_per_worker is not None:
        yield (
            "global_batch_size",
            f"got {c.global_batch_size} together with --batch-size-per-worker {c.batch_size_per_worker}; "
            "set exactly one: --global-batch-size keeps the optimizer's batch fixed whatever the worker "
            "count, --batch-size-per-worker lets it grow with the workers",
        )
    elif c.global_batch_size is not None and 1 <= c.global_batch_size < (max_workers or 0):
        yield (
            "global_batch_size",
            f"got {c.global_batch_size}, fewer samples per step than the {max_workers} workers asked for; "
            f"raise it to at least {max_workers} or use fewer --workers",
        )
    if not (c.lr > 0 and c.lr < float("inf")):
        yield "lr", f"got {c.lr}; must be a positive number, e.g. --lr 1e-3"
    yield from _check_milestones(c)
    if not 0 < c.lr_gamma <= 1:
        yield "lr_gamma", f"got {c.lr_gamma}; must be in (0, 1], e.g. --lr-gamma 0.1"
    if c.warmup_start_factor is not None and not 0 <= c.warmup_start_factor <= 1:
        yield "warmup_start_factor", f"got {c.warmup_start_factor}; must be in [0, 1], e.g. --warmup-start-factor 0.01"
    if not 0 <= c.momentum < 1:
        yield "momentum", f"got {c.momentum}; must be in [0, 1), e.g. --momentum 0.9"
    if c.nesterov and (c.optimizer != "sgd" or c.momentum == 0):
        yield "nesterov", "applies to --optimizer sgd with a --momentum above 0"
    if c.grad_clip_norm is not None and not 0 < c.grad_clip_norm < math.inf:
        yield "grad_clip_norm", f"got {c.grad_clip_norm}; must be a positive norm, e.g. --grad-clip-norm 1.0"
    if not 0 <= c.warmup_epochs < math.inf:
        yield "warmup_epochs", f"got {c.warmup_epochs}; must be 0 or more, e.g. --warmup-epochs 1"
    elif c.epochs >= 1 and c.warmup_epochs > c.epochs:
        yield (
            "warmup_epochs",
            f"got {c.warmup_epochs}, longer than the {c.epochs} epochs of the run; lower it or raise --epochs",
        )
    if not 0 <= c.weight_decay < math.inf:
        yield "weight_decay", f"got {c.weight_decay}; must be 0 or more"
    if c.seed < 0:
        yield "seed", f"got {c.seed}; must be 0 or more"
    if c.max_failures < -1:
        yield "max_failures", f"got {c.max_failures}; must be 0 or more (-1 retries forever)"
    if c.shuffle_window_rows is not None and c.shuffle_window_rows < 0:
        yield (
            "shuffle_window_rows",
            f"got {c.shuffle_window_rows}; must be 0 (hold the data in memory) or a row count, e.g. "
            "--shuffle-window-rows 65536",
        )
    if c.data_partitions < 1:
        yield "data_partitions", f"got {c.data_partitions}; must be a positive integer, e.g. --data-partitions 24"
    if c.timing_warmup_steps < 0:
        yield "timing_warmup_steps", f"got {c.timing_warmup_steps}; must be 0 or more, e.g. --timing-warmup-steps 3"
    if c.checkpoint_every_steps < 0:
        yield (
            "checkpoint_every_steps",
            f"got {c.checkpoint_every_steps}; must be 0 (epoch ends only) or a positive step count",
        )
    if not 0 < c.collective_timeout_s < math.inf:
        yield "collective_timeout_s", f"got {c.collective_timeout_s}; must be a positive number of seconds, e.g. 600"
    if not 0 < c.cpus_per_worker < math.inf:
        yield "cpus_per_worker", f"got {c.cpus_per_worker}; must be a positive number of CPUs, e.g. 1"
    if not c.storage:
        yield "storage", "is empty; give a directory, e.g. --storage ~/raytrain_results"
    elif "://" in c.storage and not c.storage.startswith("file://"):
        yield (
            "storage",
            f"got {c.storage!r}; only file system paths are supported (a shared mount such as NFS/EFS on multi-node "
            "clusters)",
        )
    if c.name is not None and not _NAME_RE.match(c.name):
        yield "name", f"got {c.name!r}; use letters, digits, '.', '_' and '-' only, e.g. --name digits-lr3e-3"
    yield from resume.config_problems(c.resume, c.name)
    if not 0 < c.progress_interval_s < math.inf:
        yield "progress_interval_s", f"got {c.progress_interval_s}; must be a positive number of seconds, e.g. 10"
    if not 0 < c.ddp.bucket_cap_mb < math.inf:
        yield "ddp.bucket_cap_mb", f"got {c.ddp.bucket_cap_mb}; must be a positive size in MiB, e.g. 25"


def _check_milestones(c: "TrainConfig") -> Iterable[tuple[str, str]]:
    milestones = c.lr_milestones
    if c.schedule == "step" and not milestones:
        yield "lr_milestones", "--schedule step needs the epochs at which to decay, e.g. --lr-milestones 30,60"
    if milestones is None:
        return
    if c.schedule != "step":
        yield (
            "lr_milestones",
            f"got {milestones}; milestones apply to --schedule step only (the schedule is {c.schedule})",
        )
        return
    if not all(isinstance(m, (int, float)) and not isinstance(m, bool) for m in milestones):
        yield "lr_milestones", f"got {milestones}; give epochs as numbers, e.g. --lr-milestones 30,60"
    elif any(b <= a for a, b in zip(milestones, milestones[1:])) or milestones[0] <= 0:
        yield "lr_milestones", f"got {milestones}; epochs must be positive and increasing, e.g. --lr-milestones 30,60"


def _close(value: Any, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    values = {str(key): value for key, value in values.items()}
    unknown = [key for key in values if key.replace("-", "_") not in names]
    if unknown:
        raise ConfigError(
            [
                (prefix + key, f"unknown option{_close(key.replace('-', '_'), names)}; known: {', '.join(names)}")
                for key in unknown
            ]
        )
    return cls(**{key.replace("-", "_"): value for key, value in values.items()})
