"""`raytrain export`: a run's, a checkpoint's or a weights file's model as a plain state_dict.

It reads the weights only (no process group, no pipeline code); with `pipeline`, it also
builds that pipeline's model with the run's own options and checks that the weights load
with `strict=True`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import torch

from raytrain import hooks
from raytrain.errors import CheckpointError, PipelineError, UsageError, weights_mismatch
from raytrain.rundir.checkpoints import load_model_weights
from raytrain.rundir.faults import storage_errors
from raytrain.rundir.formats import save_torch
from raytrain.rundir.records import CONFIG, MODEL
from raytrain.rundir.storage import Store, is_uri

# Prefixes the wrappers of a model add to its keys: DDP's and torch.compile's.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def export_weights(
    source: str,
    output: str,
    pipeline: str | None = None,
    echo: Callable[[str], None] = print,
    pipeline_args: Any = None,
) -> "Path | Store":
    """Write the model of `source` (a run directory, a checkpoint directory or a .pt file; a
    path or a URI) to `output` (a path or a URI) as a plain state_dict; returns where (a Hugging
    Face save_pretrained directory: `raytrain.rundir.export_hf`). `pipeline_args` (KEY=VALUE
    pairs or a mapping) replace the run's own pipeline options for the check."""
    weights = plain_weights(source)
    checked = ""
    if pipeline:  # the run's own options (its config.yaml, for a run or one of its checkpoints) build the model
        pipe, _, _ = loaded_model(pipeline, Store.of(source), weights, pipeline_args)
        checked = f"; checked: loads into {pipe.name}'s model with strict=True"
    if is_uri(output):  # straight to an object store
        target = Store.of(output)
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        target.parent.write_bytes(target.name, buffer.getvalue())
        echo(f"Wrote {target}: {len(weights)} tensors, {len(buffer.getvalue()) / 2**20:.2f} MiB{checked}")
        return target
    path = Path(output).expanduser()
    if path.is_dir():
        raise UsageError(f"-o {path}: is a directory; give a file name, e.g. -o {path / MODEL}")
    with storage_errors(path, "write"):
        path.parent.mkdir(parents=True, exist_ok=True)
        save_torch(weights, path)  # whole or not at all; a refused write is an OSError with its errno
    size_mb = path.stat().st_size / 2**20
    echo(f"Wrote {path}: {len(weights)} tensors, {size_mb:.2f} MiB{checked}")
    echo(f"Load with: model.load_state_dict(torch.load({str(path)!r}, weights_only=True), strict=True)")
    return path


def plain_weights(source: str) -> dict:
    """The model of `source` as a state_dict without the wrappers' prefixes."""
    return {strip_wrappers(key): value for key, value in load_model_weights(source).items()}


def strip_wrappers(key: str) -> str:
    """`module.` (DDP) and `_orig_mod.` (torch.compile), in any order and nesting."""
    while key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def run_config(source: Store) -> dict[str, Any]:
    """The values of the run's config.yaml (the source is a run or one of its checkpoints), or {}."""
    import yaml

    for candidate in (source, source.parent, source.parent.parent):
        if candidate.is_file(CONFIG):
            return yaml.safe_load(candidate.read_text(CONFIG)) or {}
    return {}


def loaded_model(
    spec: str, source: Store, weights: dict, pipeline_args: Any = None
) -> tuple[Any, Any, "torch.nn.Module"]:
    """(pipeline, config, model): the pipeline's model built with the run's own options (its
    pipeline options replaced key by key by `pipeline_args`, export's --pipeline-arg), the
    weights loaded into it with strict=True."""
    from raytrain.config import TrainConfig, merge_layers
    from raytrain.pipeline import load_pipeline
    from raytrain.rules.resume import resolvable

    pipe = load_pipeline(spec)
    values = resolvable(run_config(source))  # what a hook replaced (the optimizer it built) is not an option
    values.pop("pipeline", None)
    values.pop("gpu", None)
    given = {"pipeline_args": pipeline_args} if pipeline_args else {}
    cfg = TrainConfig.from_dict(merge_layers(pipe.default_config, values, {"resume": False}, given))
    try:
        model = hooks.call(pipe, "build_model", cfg)
    except PipelineError as error:  # e.g. the model directory the run trained from has moved
        raise PipelineError(
            f"{source}: the run's pipeline options (its config.yaml) do not build its model here: {error}. "
            "raytrain export takes --pipeline-arg KEY=VALUE too, over the run's own (e.g. --pipeline-arg "
            "model=DIR where the model directory is now)"
        ) from None
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{source}: weights do not match {pipe.name}'s model ({weights_mismatch(exc)}); give the pipeline the run "
            "trained (and its --pipeline-arg options, read from the run's config.yaml)"
        ) from None
    return pipe, cfg, model
