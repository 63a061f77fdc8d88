"""A pipeline's hooks, called under one rule.

Every method a user's `Pipeline` may define, and its attributes `Args` and `default_config`,
is a hook. raytrain calls each method through `call`, and checks the attributes with
`check_attributes` when the pipeline is loaded, so that one rule holds for all of them: an
exception from a hook, or a value its entry in `HOOKS` refuses, is a `PipelineCodeError`
naming the pipeline, the hook and where in the user's code (exit 2, never retried: it would
only repeat). The checks are cheap (types, shapes, counts; no device sync), so they run on
every call.

A hook added to `Pipeline` gets the rule by being listed in `HOOKS`; tests/test_hooks.py fails
while one is not, or while raytrain calls one directly.

torch and Ray Data are imported only inside the checks that need them: this module sits in
the foundation layer, under the data layer and the worker.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
from dataclasses import dataclass, is_dataclass
from typing import Any, Callable

from raytrain.errors import DataError, PipelineCodeError, innermost_error, pipeline_code, user_frames


@dataclass(frozen=True)
class Hook:
    """What a hook must give back. `check(value, before)` names what is wrong with a return
    (None: nothing), where `before` is `inputs(*args)` taken before the call (a hook may
    change its arguments in place); `convert` turns an accepted return into what raytrain uses."""

    check: Callable[[Any, Any], str | None]
    inputs: Callable[..., Any] = lambda *args: args
    convert: Callable[[Any], Any] = lambda value: value
    reads_data: bool = False  # a reader's error in it (pyarrow, a missing file) is the data's: a DataError


def call(pipeline: Any, hook: str, *args: Any, passthrough: Callable[[BaseException], bool] | None = None) -> Any:
    """`pipeline.<hook>(*args)` under the rule: its exception, or a return `HOOKS[hook]`
    refuses, is a PipelineCodeError naming the hook and the user's code. `passthrough(exc)`:
    an exception that is not the pipeline's fault (a peer that died inside compute_loss's
    all-reduce) is raised as it is."""
    spec = HOOKS[hook]
    before = spec.inputs(*args)
    try:
        with pipeline_code(pipeline, hook):
            value = getattr(pipeline, hook)(*args)
    except PipelineCodeError as exc:
        cause = exc.__cause__
        if passthrough is not None and cause is not None and passthrough(cause):
            raise cause from None
        if spec.reads_data and cause is not None and is_reader_error(cause):
            raise data_error(pipeline, hook, cause) from None
        raise
    problem = spec.check(value, before)
    if problem:
        raise PipelineCodeError(f"pipeline {pipeline.name}: {hook} {problem}" + where(pipeline, hook))
    return spec.convert(value)


def is_reader_error(exc: BaseException) -> bool:
    """An error of reading files (pyarrow's, or the file system's), not of the code itself."""
    return type(exc).__module__.split(".")[0] == "pyarrow" or isinstance(
        exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    )


def data_error(pipeline: Any, hook: str, exc: BaseException) -> DataError:
    """A reader's error inside the pipeline's own code (Ray Data reading footers as
    build_datasets runs), as the data's: the file named where it can be found."""
    path = getattr(exc, "filename", None) or _file_in_traceback(exc)
    what = f" (file {path})" if path else ""
    return DataError(
        f"pipeline {pipeline.name}: {hook} cannot read its data{what}: {innermost_error(exc)}; the file is missing, "
        "truncated, damaged or not in the format read: restore or replace it, or move it out of what the pipeline "
        "reads" + "".join(f"\n  at {frame}" for frame in user_frames(exc))
    )


def _file_in_traceback(exc: BaseException) -> str | None:
    """The file a reader was at when it failed: a path-like local of the innermost frames that
    names an existing file (Ray Data reads Parquet footers in threads; the frame keeps `path`)."""
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for name in ("path", "file_path", "filename", "fname", "file"):
            value = frame.f_locals.get(name)
            if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
                return os.fspath(value)
    return None


def bound(pipeline: Any, hook: str) -> Callable[..., Any]:
    """`call(pipeline, hook, ...)` as a function of the hook's arguments."""
    return functools.partial(call, pipeline, hook)


def where(pipeline: Any, hook: str) -> str:
    """`\\n  at FILE:LINE, in HOOK`: the pipeline's own definition of the hook (a wrong return
    has no traceback to point into), when its source can be found."""
    target = getattr(type(pipeline), hook, None)
    target = inspect.unwrap(target) if callable(target) else target
    source = target if inspect.isfunction(target) else type(pipeline)
    try:
        path, line = inspect.getsourcefile(source), inspect.getsourcelines(source)[1]
    except (OSError, TypeError):
        return ""
    owner = hook if source is target else f"class {type(pipeline).__name__}"
    return f"\n  at {path}:{line}, in {owner}" if path else ""


# The hooks that are attributes, not methods: checked once, when the pipeline is loaded.
ATTRIBUTES = ("Args", "default_config")


def check_attributes(pipeline: Any) -> None:
    """The pipeline's attributes (`ATTRIBUTES`) hold what raytrain reads from them."""
    for name in ATTRIBUTES:
        problem = HOOKS[name].check(getattr(pipeline, name, None), None)
        if problem:
            raise PipelineCodeError(f"pipeline {pipeline.name}: {name} {problem}" + where(pipeline, name))


# -- the checks ----------------------------------------------------------------------------------


def _model(value: Any, before: Any) -> str | None:
    """A module with parameters (there would be nothing to train)."""
    import torch

    if not isinstance(value, torch.nn.Module):
        return f"returned a {type(value).__name__}, not a torch.nn.Module"
    if not any(True for _ in value.parameters()):
        return (
            f"returned a {type(value).__name__} without parameters: there is nothing to train; return the model "
            "with its layers (nn.Linear, nn.Conv2d, ...)"
        )
    return None


def _datasets(value: Any, before: Any) -> str | None:
    import ray.data
    import torch.utils.data

    from raytrain import hf_datasets as hf

    value = hf.splits_of(value)  # a DatasetDict: its train and validation splits
    if not isinstance(value, dict) or "train" not in value:
        got = f"a dict with keys {sorted(map(str, value))}" if isinstance(value, dict) else f"a {type(value).__name__}"
        return f"must return a dict with a 'train' dataset (and optionally 'val'); it returned {got}"
    from raytrain.sampled import Sampled

    for name, dataset in value.items():
        if hf.problem(name, dataset):
            return hf.problem(name, dataset)
        if not isinstance(dataset, (ray.data.Dataset, torch.utils.data.Dataset, Sampled)) and not hf.is_hf_dataset(
            dataset
        ):
            return (
                f"returned dataset {name!r} as a {type(dataset).__name__}, not a ray.data.Dataset, a torch Dataset, "
                "a datasets.Dataset or a raytrain.Sampled"
            )
    return None


def _loss(value: Any, before: Any) -> str | None:
    """A scalar tensor (with grad, when the model trains) or (loss, dict of metrics)."""
    import torch

    model = before[0]
    what = "must return a scalar loss tensor or (loss, {name: value})"
    if isinstance(value, tuple) and len(value) != 2:
        return f"{what}; it returned a tuple of {len(value)}"
    loss, metrics = value if isinstance(value, tuple) else (value, {})
    if not isinstance(loss, torch.Tensor):
        return (
            f"{what}; it returned a {type(loss).__name__} ({str(loss)[:60]}): return the torch tensor itself, "
            "not .item() or a float"
        )
    if loss.numel() != 1:
        return (
            f"{what}; its loss has shape {tuple(loss.shape)}: reduce it, e.g. "
            "F.cross_entropy(..., reduction='mean') or loss.mean()"
        )
    if getattr(model, "training", False) and not loss.requires_grad:
        return (
            f"{what}; its loss has no gradient (requires_grad=False): compute it from the model's output, "
            "without .detach() or torch.no_grad()"
        )
    if not isinstance(metrics, dict):
        return f"{what}; its second item is a {type(metrics).__name__}, not a dict of metrics"
    return None


def _optimizer(value: Any, before: Any) -> str | None:
    """A torch optimizer over the model's own parameters.

    Refused: parameters that are not the model's (raytrain averages, checkpoints and restores
    the model's parameters only: another tensor would train apart on every rank and be lost at
    the first restart), and an optimizer that holds none of the model's trainable parameters
    (nothing would train). Allowed: one that leaves some trainable parameters out, as freezing
    part of a model that way is a known recipe; `optimizer_note` says how many."""
    import torch

    model = before[0]
    if not isinstance(value, torch.optim.Optimizer):
        return f"returned a {type(value).__name__}, not a torch.optim.Optimizer"
    own = {id(p) for p in model.parameters()}
    held = [p for group in value.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in own]
    fix = (
        "build it over the model it is given (e.g. torch.optim.SGD(model.parameters(), lr=cfg.lr), or parameter "
        "groups of model.named_parameters()); a tensor of your own belongs in the model, as an nn.Parameter attribute"
    )
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3]) + (" …" if len(foreign) > 3 else "")
        return (
            f"returned an optimizer over {len(foreign)} tensor(s) that are not the model's parameters "
            f"(shapes {shapes}); raytrain averages, checkpoints and restores the model's parameters only: {fix}"
        )
    if not any(p.requires_grad for p in held):
        return f"returned an optimizer over none of the model's trainable parameters, so nothing would train: {fix}"
    return None


def optimizer_note(model: Any, optimizer: Any) -> str | None:
    """A line for the run's events when the pipeline's optimizer leaves trainable parameters
    of the model out (they keep their initial values), else None."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if not left:
        return None
    total = sum(1 for p in model.parameters() if p.requires_grad)
    names = ", ".join(left[:4]) + (" …" if len(left) > 4 else "")
    return (
        f"build_optimizer leaves {len(left)} of the model's {total} trainable parameter tensors out ({names}): they "
        "keep their initial values. If that is not meant, build the optimizer over model.parameters(); to freeze "
        "them, set requires_grad=False as well (no gradient is then computed for them)"
    )


def _batch_shape(batch: Any) -> tuple[list[str], int | None]:
    """A batch's keys and its row count, before transform_batch sees it."""
    first = next(iter(batch.values()), None)
    return list(batch), int(first.shape[0]) if getattr(first, "shape", None) else None


def _transformed(value: Any, before: Any) -> str | None:
    """The batch again: a dict of tensors, every column it was given, every row."""
    import torch

    keys, rows = before
    if not isinstance(value, dict):
        return (
            f"must return the batch (a dict of tensors); it returned a {type(value).__name__}: end it with "
            "`return batch`"
        )
    if sorted(value) != sorted(keys):
        missing, added = sorted(set(keys) - set(value)), sorted(set(value) - set(keys))
        change = "; ".join(
            part for part in (f"missing {missing}" if missing else "", f"added {added}" if added else "") if part
        )
        return (
            f"returned the columns {sorted(value)} for a batch of {sorted(keys)} ({change}); it must return the "
            "columns it was given, changed in place (batch['x'] = ...); a new column belongs in build_datasets, a "
            "value computed from the batch in compute_loss"
        )
    for column, tensor in value.items():
        if not isinstance(tensor, torch.Tensor):
            return f"returned column {column!r} as a {type(tensor).__name__}, not a torch.Tensor"
        if rows is not None and (tensor.dim() == 0 or tensor.shape[0] != rows):
            got = tensor.shape[0] if tensor.dim() else "a scalar instead of rows"
            return (
                f"returned {got} row(s) in column {column!r} for a batch of {rows}; it must return every row it was "
                "given, each augmented: raytrain trains every sample exactly once per epoch and counts them in "
                "summary.json. Drop or add samples in build_datasets instead"
            )
    return None


def _lr_factor(value: Any, before: Any) -> str | None:
    """A finite real number, 0 or more (the rate is the peak times it)."""
    progress = before[0]
    said = f"lr_factor({progress:.4g}) returned {value!r}" if isinstance(progress, float) else f"returned {value!r}"
    number = _as_number(value)
    if number is None:
        return (
            f"returned a {type(value).__name__} ({str(value)[:40]!r}) for progress {progress:.4g}; it must return "
            "a number ≥ 0: the rate is the peak rate × lr_factor(progress)"
        )
    if not math.isfinite(number):
        return (
            f"must return a finite number ≥ 0 (the rate is the peak rate × lr_factor(progress)); {said}, which "
            "would make every weight NaN"
        )
    if number < 0:
        return (
            f"must return a number ≥ 0 (the rate is the peak rate × lr_factor(progress)); {said}: a negative rate "
            "climbs the loss instead of descending it. Clamp it, e.g. return max(0.0, factor)"
        )
    return None


def _as_number(value: Any) -> float | None:
    """`value` as a float when it is a real number (a 0-dim tensor or array counts); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) == () or (hasattr(value, "numel") and value.numel() == 1):
        try:
            item = value.item()
        except (AttributeError, TypeError, ValueError, RuntimeError):
            return None
        return float(item) if isinstance(item, numbers.Real) and not isinstance(item, bool) else None
    return None


def _shard_modules(value: Any, before: Any) -> str | None:
    """Distinct submodules of the model, none the model itself or inside another: the blocks
    --strategy fsdp shards one by one."""
    import torch

    model = before[0]
    what = "must return a list of the model's own submodules"
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, torch.nn.Module) for m in value):
        got = type(value).__name__ if not isinstance(value, (list, tuple)) else "a list holding non-modules"
        return f"{what}; it returned {got}"
    names = {id(module): name for name, module in model.named_modules() if name}
    strangers = [type(m).__name__ for m in value if id(m) not in names]
    if strangers:
        return (
            f"{what}; {len(strangers)} of them ({', '.join(sorted(set(strangers)))}) are not inside the model built "
            "by build_model (or are the model itself): return modules of `model`, e.g. list(model.layers)"
        )
    if len({id(m) for m in value}) != len(value):
        return f"{what}; it names a module twice"
    picked = [names[id(m)] for m in value]
    nested = [a for a in picked for b in picked if a != b and a.startswith(b + ".")]
    if nested:
        return f"{what}, none inside another; {nested[0]} is inside another one returned"
    return None


def _filled(value: Any, before: Any) -> str | None:
    """Nothing: materialize fills the model in place."""
    return (
        None
        if value is None
        else f"returned a {type(value).__name__}; it must fill the model it was given in place and return None"
    )


def _args_class(value: Any, before: Any) -> str | None:
    if value is None or (isinstance(value, type) and is_dataclass(value)):
        return None
    kind = value.__name__ if isinstance(value, type) else f"{value!r} (a {type(value).__name__})"
    return (
        f"is {kind}, not a dataclass; declare the pipeline's options as one, each field a --pipeline-arg:\n"
        "      @dataclass\n      class Args:\n          path: str\n          hidden: int = 128\n"
        "  or leave Args out for a pipeline without options"
    )


def _defaults(value: Any, before: Any) -> str | None:
    if value is None or isinstance(value, dict):
        return None
    return (
        f"is {type(value).__name__} ({str(value)[:40]}), not a dict of options; give the pipeline's recipe as "
        "default_config = {'epochs': 3, 'lr': 1e-3, ...} (the names of raytrain train's options, in snake_case)"
    )


HOOKS: dict[str, Hook] = {
    "build_model": Hook(_model),
    "build_datasets": Hook(_datasets, reads_data=True),
    "compute_loss": Hook(_loss),
    "build_optimizer": Hook(_optimizer),
    "transform_batch": Hook(_transformed, inputs=lambda batch, ctx: _batch_shape(batch)),
    "lr_factor": Hook(_lr_factor, convert=_as_number),
    "shard_modules": Hook(_shard_modules, convert=list),
    "materialize": Hook(_filled),
    "Args": Hook(_args_class),
    "default_config": Hook(_defaults),
}
