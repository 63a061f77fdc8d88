"""`raytrain export RUN --format hf -o DIR`: the run's model as a Hugging Face `save_pretrained`
directory (config.json, model.safetensors, and the run's tokenizer when its pipeline has one),
which `AutoModelFor….from_pretrained(DIR)` loads with no missing or unexpected keys.

The model is the run's pipeline's own (its `build_model`, with the run's options from
config.yaml), the run's weights loaded into it with strict=True; so it works for any pipeline
whose model is a transformers `PreTrainedModel`, from a DDP or an FSDP run alike (both leave a
full state_dict). A pipeline's optional `tokenizer(cfg)` method names the tokenizer to save.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from raytrain.errors import UsageError
from raytrain.rundir.faults import storage_errors
from raytrain.rundir.storage import Store, is_uri

INSTALL = "pip install 'raytrain[hf]'"


def export_pretrained(
    source: str,
    output: str,
    pipeline: str | None = None,
    echo: Callable[[str], None] = print,
    pipeline_args: Any = None,
) -> "Path | Store":
    """Write the model of `source` (`raytrain.rundir.export.export_weights` takes the same) as a
    save_pretrained directory at `output`, a new or empty directory or object-store prefix."""
    from raytrain.rundir.export import loaded_model, plain_weights, run_config

    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError:
        raise UsageError(f"--format hf needs transformers and safetensors, not installed here: {INSTALL}") from None
    check_output(output)
    weights = plain_weights(source)
    store = Store.of(source)
    spec = pipeline or run_config(store).get("pipeline")
    if not spec:
        raise UsageError(
            f"--format hf: {source} has no config.yaml naming its pipeline (a weights file or a lone checkpoint); "
            "name it with --pipeline PIPELINE, or export the run directory"
        )
    pipe, cfg, model = loaded_model(spec, store, weights, pipeline_args)
    if not isinstance(model, transformers.PreTrainedModel):
        raise UsageError(
            f"--format hf: {pipe.name}'s model is a {type(model).__name__}, not a transformers PreTrainedModel; "
            "export it as a state_dict (leave --format out)"
        )
    tokenizer = pipe.tokenizer(cfg) if callable(getattr(pipe, "tokenizer", None)) else None
    if is_uri(output):  # written here, then each file copied to the object store
        with tempfile.TemporaryDirectory() as staging:
            names = save(model, tokenizer, Path(staging))
            target = Store.of(output)
            for name in names:
                target.write_bytes(name, (Path(staging) / name).read_bytes())
        echo(f"Wrote {target}: {describe_export(model, tokenizer, names)}")
        return target
    path = Path(output).expanduser()
    with storage_errors(path, "write"):
        names = save(model, tokenizer, path)
    echo(f"Wrote {path}: {describe_export(model, tokenizer, names)}")
    echo(f"Load with: AutoModel….from_pretrained({str(path)!r}) (e.g. AutoModelForCausalLM)")
    return path


def check_output(output: str) -> None:
    """UsageError when `output` holds files already: a save_pretrained directory mixed with
    other files (another model's shards, an older config) would not load as this model. The
    same rule for a local directory and for an object-store prefix."""
    path = None if is_uri(output) else Path(output).expanduser()
    if path is not None and path.is_file():
        raise UsageError(f"-o {path}: is a file; give a new or empty directory for --format hf")
    with storage_errors(output, "read"):
        held = Store.of(output).list(recursive=True) if path is None else [p.name for p in path.glob("*")]
    if held:
        held = sorted(held)
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise UsageError(
            f"-o {output}: holds files already ({shown}); give a new or empty "
            f"{'prefix' if path is None else 'directory'} for --format hf"
        )


def save(model: Any, tokenizer: Any, directory: Path) -> list[str]:
    """save_pretrained of the model (safetensors) and the tokenizer into `directory`; the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def describe_export(model: Any, tokenizer: Any, names: list[str]) -> str:
    params = sum(p.numel() for p in model.parameters())
    with_tokenizer = f", and its tokenizer ({type(tokenizer).__name__})" if tokenizer is not None else ""
    return f"{type(model).__name__}, {params:,} parameters, as {', '.join(names)}{with_tokenizer}"
