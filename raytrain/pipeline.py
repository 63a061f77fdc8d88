"""What a user brings: a Pipeline (model, data, loss), and where the run is (`context()`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

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
    """

    default_config: ClassVar[dict[str, Any]] = {}

    def build_model(self, cfg: "TrainConfig") -> "torch.nn.Module":
        raise NotImplementedError("a Pipeline must implement build_model(cfg) -> torch.nn.Module")

    def build_datasets(self, cfg: "TrainConfig") -> dict[str, "ray.data.Dataset"]:
        """{"train": Dataset, optional "val": Dataset}; columns become the batch's tensors."""
        raise NotImplementedError("a Pipeline must implement build_datasets(cfg) -> {'train': ray.data.Dataset}")

    def compute_loss(self, model: "torch.nn.Module", batch: dict[str, "torch.Tensor"]) -> Any:
        """Mean loss over `batch`, or (loss, {"name": value}) with per-batch mean metrics."""
        raise NotImplementedError("a Pipeline must implement compute_loss(model, batch) -> loss")

    @property
    def name(self) -> str:
        return type(self).__name__


class PipelineError(ValueError):
    """The pipeline named by the user cannot be found or is not a Pipeline."""


def load_pipeline(spec: "str | Pipeline") -> Pipeline:
    """A built-in name (`digits`), `module:attr` (a Pipeline class or instance), or an instance."""
    if isinstance(spec, Pipeline):
        return spec
    if not isinstance(spec, str) or not spec:
        raise PipelineError(f"pipeline: got {spec!r}; give a built-in name ({', '.join(BUILTIN_PIPELINES)}) or module:attr")
    target = BUILTIN_PIPELINES.get(spec, spec)
    if ":" not in target:
        raise PipelineError(
            f"pipeline: unknown name {spec!r}; use a built-in one ({', '.join(BUILTIN_PIPELINES)}) "
            "or point at your own as module:attr, e.g. my_project.train:MyPipeline"
        )
    module_name, attr = target.split(":", 1)
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


@dataclass
class RunContext:
    """Where the run is, readable from inside a pipeline's methods via `raytrain.context()`."""

    epoch: int = 0
    step: int = 0
    samples_seen: int = 0
    world_rank: int = 0
    world_size: int = 1
    global_batch_size: int = 0
    lr: float = 0.0


_CONTEXT = RunContext()


def context() -> RunContext:
    """The current run's position: epoch, step, samples_seen, world_rank, world_size, global_batch_size, lr."""
    return _CONTEXT
