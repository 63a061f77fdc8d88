"""What a user brings: a Pipeline (model, data, loss), and where the run is (`context()`)."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from raytrain import fields, hooks
from raytrain.errors import ConfigError, PipelineCodeError, PipelineError, pipeline_code

if TYPE_CHECKING:  # pragma: no cover
    import ray.data
    import torch

    from raytrain.config import TrainConfig

BUILTIN_PIPELINES = {
    "digits": "pipelines.digits:DigitsPipeline",
    "parquet": "pipelines.parquet:ParquetPipeline",
    "charlm": "pipelines.charlm:CharLMPipeline",
    "hf-causal-lm": "pipelines.hf:HFCausalLMPipeline",
    "hf-classification": "pipelines.hf:HFClassificationPipeline",
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
        return default_optimizer(model, cfg)

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
        return default_blocks(model)

    def materialize(self, model: "torch.nn.Module", cfg: "TrainConfig") -> None:
        """Fill the model's weights in place, each rank only its shards. Defined, it makes
        `--strategy fsdp` build the model on the meta device (build_model runs under
        `torch.device("meta")`: shapes only, no weights read), shard it, give each rank storage
        for its own shards, then call this to fill them (`raytrain.meta`: `fill` from
        `WeightFiles` or `UnitInit`), so no worker ever holds the whole model. Not defined (the
        default): the model is built whole on every rank, then sharded."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__


def default_blocks(model: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The children of every outermost `nn.ModuleList`/`nn.Sequential` inside the model (the
    transformer convention: `model.layers`, `model.blocks`); none if it has no such container.
    The model itself, when it is a Sequential, is not its own container of blocks."""
    from torch import nn

    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                found.extend(block for block in child.children() if any(True for _ in block.parameters()))
            else:
                visit(child)

    visit(model)
    return found


def default_optimizer(
    model: "torch.nn.Module", cfg: "TrainConfig", groups: list[dict[str, Any]] | None = None
) -> "torch.optim.Optimizer":
    """--optimizer adamw | sgd | lamb over `groups` (default: `param_groups`), at --lr (raytrain
    sets the rate per step)."""
    import torch

    if groups is None:
        groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    if cfg.optimizer == "lamb":
        try:
            from pytorch_optimizer import Lamb
        except ImportError:
            raise ConfigError(
                [("optimizer", "lamb comes from the pytorch-optimizer package: pip install 'raytrain[large-batch]'")]
            ) from None
        return Lamb(groups, lr=cfg.lr)
    return torch.optim.AdamW(groups, lr=cfg.lr)


def param_groups(
    model: "torch.nn.Module", weight_decay: float, decay_norm_and_bias: bool = True
) -> list[dict[str, Any]]:
    """Trainable parameters in groups; without decay on biases and norm weights (tensors of one
    dimension or none) when `decay_norm_and_bias` is False."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_and_bias:
        return [{"params": trainable, "weight_decay": weight_decay}]
    matrices = [p for p in trainable if p.ndim > 1]
    vectors = [p for p in trainable if p.ndim <= 1]
    return [
        g
        for g in ({"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0})
        if g["params"]
    ]


def parse_pipeline_args(pipeline: Pipeline, raw: dict[str, Any] | None) -> Any:
    """`raw` (KEY=VALUE strings, or YAML values) as the pipeline's `Args`, each value converted
    to its field's type as the command line converts flags (`raytrain.fields`); PipelineError
    listing every problem (unknown keys with the known ones, missing or unconvertible values)."""
    raw = dict(raw or {})
    hooks.check_attributes(pipeline)
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
        said = any(p.startswith(f"--pipeline-arg {name}:") for p in problems)  # a value given, but unconvertible
        if option.required and name not in values and not said:
            problems.append(f"needs --pipeline-arg {name}=VALUE ({option.words(none=True)})")
    if not problems:
        try:
            with pipeline_code(pipeline, "Args"):  # __post_init__ says a bad value with ValueError
                return spec(**values)
        except PipelineCodeError as exc:
            if not isinstance(exc.__cause__, (TypeError, ValueError)):
                raise
            problems.append(str(exc.__cause__))
    raise PipelineError(f"pipeline {pipeline.name}: " + "; ".join(problems))


def dated_name(spec: str, form: str = "{}") -> str:
    """A run's default name: the spec's last dotted part, lowercased, in `form`, then when it starts."""
    return f"{form.format(spec.split(':')[-1].split('.')[-1].lower() or 'run')}-{time.strftime('%Y%m%d-%H%M%S')}"


def load_pipeline(spec: "str | Pipeline") -> Pipeline:
    """A built-in name (`digits`), `module:attr` (a Pipeline class or instance), or an instance."""
    if isinstance(spec, Pipeline):
        hooks.check_attributes(spec)
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
    add_working_directory()
    module = import_user_module(spec, module_name)
    if spec not in BUILTIN_PIPELINES:
        check_not_shadowed(spec, module)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise PipelineError(f"pipeline {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) and issubclass(obj, Pipeline):
        obj = build_pipeline(spec, obj)
    if not isinstance(obj, Pipeline):
        raise PipelineError(
            f"pipeline {spec!r}: {attr} is a {type(obj).__name__}, not a raytrain.Pipeline; "
            "subclass raytrain.Pipeline and implement build_model, build_datasets, compute_loss"
        )
    hooks.check_attributes(obj)
    return obj


def import_user_module(spec: str, module_name: str) -> Any:
    """The pipeline's module: PipelineError when it cannot be found or needs a package that is
    not installed; PipelineCodeError (naming the line) when its own code fails as it is
    imported (a syntax error, an exception at import)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise PipelineError(
                f"pipeline {spec!r}: cannot find module {module_name!r} ({exc}); "
                "run from the directory that holds it or put it on PYTHONPATH"
            ) from None
        raise PipelineError(
            f"pipeline {spec!r}: module {module_name!r} imports {exc.name!r}, which is not installed here: install "
            "it (on a cluster, on every node, or in the job's runtime environment)"
        ) from None
    except Exception:
        with pipeline_code(repr(spec), f"importing module {module_name!r}"):
            raise


def build_pipeline(spec: str, cls: type) -> "Pipeline":
    """An instance of the pipeline class `cls`, which raytrain builds without arguments."""
    try:
        return cls()
    except Exception as exc:
        if isinstance(exc, TypeError) and "required" in str(exc) and "__init__" in str(exc):
            raise PipelineError(
                f"pipeline {spec!r}: {cls.__name__}() raised TypeError: {exc}; raytrain builds a pipeline class "
                "without arguments: take its options from --pipeline-arg (a dataclass Args on the class), or point "
                "at an instance built in the module, module:INSTANCE"
            ) from None
        with pipeline_code(repr(spec), f"{cls.__name__}()"):
            raise


def import_path() -> list[str]:
    """Where pipelines are imported from, in order: the installation raytrain and the built-in
    pipelines come from, the interpreter's path, then the working directory — last, so that a
    folder there (a clone of this repository holding `raytrain/`) never shadows an installed
    package; the workers get the same path (`raytrain.driver.session.driver_pythonpath`)."""
    cwd = os.getcwd()
    entries = [*_installation_roots(), *[p for p in sys.path if p and p != cwd and os.path.isdir(p)], cwd]
    return list(dict.fromkeys(entries))


def _installation_roots() -> list[str]:
    """The directories holding the `raytrain` and `pipelines` packages this process imports
    (site-packages, or the checkout of an editable install, which Python's path alone does not
    name)."""
    import importlib.util

    roots = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    with contextlib.suppress(ImportError, ValueError):
        found = sys.modules.get("pipelines") or importlib.util.find_spec("pipelines")
        origin = getattr(found, "__file__", None) or getattr(found, "origin", None)
        if origin:
            roots.append(os.path.dirname(os.path.dirname(os.path.abspath(origin))))
    return roots


def add_working_directory() -> None:
    """`raytrain train my_project.train:MyPipeline` from the directory holding my_project/: the
    console script's path does not include the working directory; it goes last (`import_path`)."""
    cwd = os.getcwd()
    if cwd in sys.path or "" in sys.path:  # `python -m`, or already added: the user's own order
        return
    sys.path.extend(p for p in import_path() if p not in sys.path)


def check_not_shadowed(spec: str, module: Any) -> None:
    """A user's module that an installed one of the same name hides: PipelineError with the fix."""
    top = module.__name__.split(".")[0]
    cwd = os.getcwd()
    mine = [os.path.join(cwd, top + ".py"), os.path.join(cwd, top)]
    imported = sys.modules.get(top)
    # A namespace package (a folder without __init__.py) has no __file__: where its folder is.
    where = getattr(imported, "__file__", None) or next(iter(getattr(imported, "__path__", None) or []), None)
    origin = os.path.abspath(where) if where else ""
    if any(os.path.exists(path) for path in mine) and origin and not origin.startswith(cwd + os.sep):
        raise PipelineError(
            f"pipeline {spec!r}: module {top!r} is imported from {origin}, an installed package of that name, not "
            f"from {top} in the working directory ({cwd}); rename your module (e.g. my_{top}) and point at it, "
            f"e.g. my_{top}{spec[len(top) :]}"
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


def set_plan(plan: Any, config: Any, total_steps: int | None) -> None:
    """Tell `context()` the resolved plan (a `raytrain.rules.batch.BatchPlan`): the driver's
    before build_datasets, each attempt's before build_model."""
    _CONTEXT.global_batch_size = plan.global_batch_size
    _CONTEXT.world_size = plan.world_size
    _CONTEXT.batch_size_per_worker = -(-plan.global_batch_size // max(1, plan.world_size))
    _CONTEXT.accumulation_steps = plan.accumulation_steps
    _CONTEXT.max_steps = config.max_steps
    _CONTEXT.total_steps = total_steps
    _CONTEXT.config = config
