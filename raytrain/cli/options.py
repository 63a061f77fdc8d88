"""A run's options, layered: the pipeline's defaults, then a --config YAML file, then the flags
given (each overriding only what it names; `raytrain.config.merge_layers`), and how a message
names each option: as the user wrote it, a flag or a key of their file."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from raytrain.config import TrainConfig
from raytrain.errors import UsageError
from raytrain.fields import flag_name


def read_run_options(
    args: argparse.Namespace, exclude: Iterable[str] = (), example: str = "digits"
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The pipeline (argument, else `pipeline:` in --config), the YAML values and the flags
    given (but `exclude`: a command's own options). Sets `args.spell`, which names an option
    in a ConfigError as the user wrote it: the flag, or the key in the --config file."""
    file_values, config_file = load_yaml(args.config) if args.config else ({}, None)
    spec = args.pipeline or file_values.pop("pipeline", None)
    file_values.pop("pipeline", None)
    resuming = getattr(args, "resume", False) or file_values.get("resume")
    if not spec and not resuming:
        raise UsageError(f"no pipeline: give one (raytrain {args.command} {example}) or set `pipeline:` in --config")
    ignored = {"command", "handler", "pipeline", "config", "spell", *exclude}
    flags = {key: value for key, value in vars(args).items() if key not in ignored}
    args.spell = spelling(flags, config_file, file_values, resuming=bool(resuming))
    return spec, file_values, flags


def load_yaml(path: str) -> tuple[dict[str, Any], str]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"--config: file {path} not found; give the path of a YAML file of options")
    try:
        values = yaml.load(file.read_text(), Loader=_ConfigLoader) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
    return {str(key): value for key, value in values.items()}, path


class _ConfigLoader(yaml.SafeLoader):
    """yaml.safe_load with YAML 1.2 numbers. YAML 1.1 reads `lr: 3e-4` as a string and
    `workers: 2:8` as the base-60 integer 128; here they are 0.0003 and "2:8"."""


_ConfigLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+|[-+]?[0-9][0-9_]*\.[0-9_]*"
        r"|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def spelling(
    flags: dict[str, Any], config_file: str | None, file_values: dict[str, Any] | None = None, resuming: bool = False
) -> Callable[[str], str]:
    """Name an option as the user wrote it: the flag, or the key in their YAML file. An unknown
    option in neither came from the layer below them (the pipeline's default_config, or a
    resumed run's config.yaml), and is named so: not as a flag the user never gave."""
    given = None if file_values is None else {key.replace("-", "_") for key in file_values}
    known = {field.name for field in dataclasses.fields(TrainConfig)}

    def spell(field: str) -> str:
        top = field.split(".")[0]
        if config_file and top not in flags and (given is None or top in given):
            return f"{field} (in {config_file})"
        if top in flags or top in known:
            return flag_name(field.replace(".", "_"))
        return f"{field} (in the run's config.yaml)" if resuming else f"{field} (in the pipeline's default_config)"

    return spell


def resumed_options(spec: str | None, file_values: dict[str, Any], flags: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A resumed run's pipeline and options (`raytrain.rules.resume.resumed_pipeline`, then
    `raytrain.config.merge_layers`): the run named by the flags or the file, in their storage."""
    from raytrain.config import DEFAULT_STORAGE, merge_layers
    from raytrain.config.checks import resume_problems
    from raytrain.errors import ConfigError
    from raytrain.rules import resume
    from raytrain.rundir import RunDir, Store

    name = flags.get("name") or file_values.get("name")
    problems = resume_problems(True, name)
    if problems:
        raise ConfigError(problems)
    storage = flags.get("storage") or file_values.get("storage") or DEFAULT_STORAGE
    stored = RunDir(Store.of(storage) / name).stored_run()
    return resume.resumed_pipeline(stored, spec), merge_layers(resume.resolvable(stored.config), file_values, flags)
