"""What a user brings: a Pipeline (model, data, loss), and where the run is (`context()`)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from raytrain import fields
from raytrain.errors import PipelineError

if TYPE_CHECKING:  # pragma: no cover
    import ray.data
    import torch

    from raytrain.config import TrainConfig

BUILTIN_PIPELINES = {
    "digits": "pipelines.digits:DigitsPipeline",
    "parquet": "pipelines.parquet:ParquetPipeline",
    "charlm": "pipelines.charlm:CharLMPipeline",
}


class Pipeline:
    """Model, data and loss of one training job. Subclass and implement the three methods.

    `default_config` holds this pipeline's recipe (epochs, lr, batch, ...): the command
    line uses it under the user's YAML and flags.

    `Args`, optional: a dataclass of the pipeline's own options (`--pipeline-arg KEY=VALUE`,
    YAML `pipeline_args:`). Values are converted to the field types (int, float, bool, str,
    `X | None`), unknown keys and bad values are refused before Ray starts, and
    `self.args(cfg)` returns the instance; its `__post_init__` may raise ValueError with the
    fix. A pipeline without `Args` takes no --pipeline-arg.
    """

    default_config: ClassVar[dict[str, Any]] = {}
    Args: ClassVar[type | None] = None

    def args(self, cfg: "TrainConfig") -> Any:
        """This pipeline's options from `cfg.pipeline_args`, typed (an `Args` instance)."""
        return parse_pipeline_args(self, cfg.pipeline_args)

    def build_model(self, cfg: "TrainConfig") -> "torch.nn.Module":
        raise NotImplementedError("a Pipeline must implement build_model(cfg) -> torch.nn.Module")

    def build_datasets(self, cfg: "TrainConfig") -> dict[str, "ray.data.Dataset | torch.utils.data.Dataset"]:
        """{"train": Dataset, optional "val": Dataset}, each a Ray Dataset or a map-style torch
        Dataset; columns become the batch's tensors."""
        raise NotImplementedError("a Pipeline must implement build_datasets(cfg) -> {'train': ray.data.Dataset}")

    def compute_loss(self, model: "torch.nn.Module", batch: dict[str, "torch.Tensor"]) -> Any:
        """Mean loss over `batch`, or (loss, {"name": value}) with per-batch mean metrics."""
        raise NotImplementedError("a Pipeline must implement compute_loss(model, batch) -> loss")

    # -- optional --------------------------------------------------------------------------

    def build_optimizer(self, model: "torch.nn.Module", cfg: "TrainConfig") -> "torch.optim.Optimizer":
        """The optimizer over `model` (the plain module, not DDP's wrapper). Default: --optimizer
        (adamw, sgd or lamb) with --weight-decay (--no-decay-norm-and-bias: none on biases and
        norms). raytrain sets every group's rate each step: the rules' rate × the group's rate
        at build / --lr (build a group with lr=cfg.lr * 0.1 for a tenth)."""
        from raytrain.worker.optim import build_default_optimizer

        return build_default_optimizer(model, cfg)

    def transform_batch(self, batch: dict[str, "torch.Tensor"], ctx: "RunContext") -> dict[str, "torch.Tensor"]:
        """Training-time augmentation of a training batch, on the worker's device. torch's and
        numpy's random generators are seeded from (seed, epoch, step, rank, micro-batch) for
        the call: a new augmentation every epoch, the same one after a resume. Default: none."""
        return batch

    def lr_factor(self, progress: float) -> float:
        """A schedule of your own: the rate is peak × lr_factor(progress), with progress going
        from 0 at the end of warmup to 1 at the end of training. Used only when overridden."""
        raise NotImplementedError

    def shard_modules(self, model: "torch.nn.Module") -> list["torch.nn.Module"]:
        """The model's blocks: the submodules `--strategy fsdp` shards one by one (then the
        root), and `--activation-checkpointing` and `--compile` apply to. Default: the children
        of every outermost `nn.ModuleList`/`nn.Sequential` of the model (the transformer
        convention: `model.layers`, `model.blocks`), else none (the root alone)."""
        from raytrain.worker.strategy import default_blocks

        return default_blocks(model)

    @property
    def name(self) -> str:
        return type(self).__name__


def parse_pipeline_args(pipeline: Pipeline, raw: dict[str, Any] | None) -> Any:
    """`raw` (KEY=VALUE strings, or YAML values) as the pipeline's `Args`, each value converted
    to its field's type as the command line converts flags (`raytrain.fields`); PipelineError
    listing every problem (unknown keys with the known ones, missing or unconvertible values)."""
    raw = dict(raw or {})
    spec = pipeline.Args
    if spec is None:
        if raw:
            raise PipelineError(
                f"pipeline {pipeline.name} takes no --pipeline-arg (got {', '.join(sorted(raw))}); "
                "a pipeline declares its options as a dataclass `Args` on the class"
            )
        return None
    known = {option.name: option for option in fields.options(spec)}
    problems, values = [], {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown --pipeline-arg {key}{hint}; {pipeline.name} knows: {', '.join(known)}")
            continue
        try:
            values[name] = known[name].from_text(value)
        except ValueError:
            problems.append(f"--pipeline-arg {key}: got {value!r}; expected {known[name].words(none=True)}")
    for name, option in known.items():
        if (
            option.required
            and name not in values
            and not any(p.startswith(f"--pipeline-arg {name}:") for p in problems)
        ):
            problems.append(f"needs --pipeline-arg {name}=VALUE ({option.words(none=True)})")
    if not problems:
        try:
            return spec(**values)
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    raise PipelineError(f"pipeline {pipeline.name}: " + "; ".join(problems))


def load_pipeline(spec: "str | Pipeline") -> Pipeline:
    """A built-in name (`digits`), `module:attr` (a Pipeline class or instance), or an instance."""
    if isinstance(spec, Pipeline):
        return spec
    if not isinstance(spec, str) or not spec:
        raise PipelineError(
            f"pipeline: got {spec!r}; give a built-in name ({', '.join(BUILTIN_PIPELINES)}) or module:attr"
        )
    target = BUILTIN_PIPELINES.get(spec, spec)
    if ":" not in target:
        raise PipelineError(
            f"pipeline: unknown name {spec!r}; use a built-in one ({', '.join(BUILTIN_PIPELINES)}) "
            "or point at your own as module:attr, e.g. my_project.train:MyPipeline"
        )
    module_name, attr = target.split(":", 1)
    # `raytrain train my_project.train:MyPipeline` from the directory holding my_project/:
    # the console script's path does not include the working directory (workers get it
    # through the runtime environment: raytrain.driver.run.ray_session).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineError(
            f"pipeline {spec!r}: cannot import module {module_name!r} ({exc}); "
            "run from the directory that holds it or put it on PYTHONPATH"
        ) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise PipelineError(f"pipeline {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) and issubclass(obj, Pipeline):
        return obj()
    if isinstance(obj, Pipeline):
        return obj
    raise PipelineError(
        f"pipeline {spec!r}: {attr} is a {type(obj).__name__}, not a raytrain.Pipeline; "
        "subclass raytrain.Pipeline and implement build_model, build_datasets, compute_loss"
    )


def overrides(pipeline: Pipeline, method: str) -> bool:
    """Whether the pipeline defines `method` itself (an optional hook)."""
    return getattr(type(pipeline), method, None) is not getattr(Pipeline, method)


@dataclass
class RunContext:
    """Where the run is, and its resolved plan, readable from inside a pipeline's methods via
    `raytrain.context()`. In `build_datasets` (on the driver, before any worker starts) the plan
    is the planned one: the largest worker count, `total_steps` not known yet (it needs the
    training set's size); in `build_model`, `build_optimizer`, `lr_factor`, `compute_loss` and
    `transform_batch` it is this attempt's."""

    epoch: int = 0
    step: int = 0
    samples_seen: int = 0
    world_rank: int = 0
    world_size: int = 1
    global_batch_size: int = 0
    lr: float = 0.0
    batch_size_per_worker: int = 0
    """The most samples one worker takes in a step (global batch ÷ workers, rounded up)."""
    accumulation_steps: int = 1
    max_steps: int | None = None
    """The step budget (--max-steps); None: the run is counted in epochs only."""
    total_steps: int | None = None
    """The optimizer steps the whole run takes at this plan (--max-steps or --epochs, whichever comes first)."""
    config: Any = None
    """The run's TrainConfig (its pipeline options: `pipeline.args(context().config)`)."""


_CONTEXT = RunContext()


def context() -> RunContext:
    """The current run's position and plan: epoch, step, samples_seen, world_rank, world_size,
    global_batch_size, batch_size_per_worker, accumulation_steps, max_steps, total_steps, lr, config."""
    return _CONTEXT


def set_plan(
    *,
    global_batch_size: int,
    world_size: int,
    accumulation_steps: int,
    max_steps: int | None,
    total_steps: int | None,
    config: Any,
) -> None:
    """Tell `context()` the resolved plan (the driver before build_datasets, each attempt
    before build_model)."""
    _CONTEXT.global_batch_size = global_batch_size
    _CONTEXT.world_size = world_size
    _CONTEXT.batch_size_per_worker = -(-global_batch_size // max(1, world_size))
    _CONTEXT.accumulation_steps = accumulation_steps
    _CONTEXT.max_steps = max_steps
    _CONTEXT.total_steps = total_steps
    _CONTEXT.config = config
