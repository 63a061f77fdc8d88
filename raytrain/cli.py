"""`raytrain` command line: train, tune, bench, report, export, data, doctor.

Exit status: 0 success; 2 what the user must fix (usage, configuration, data, pipeline code,
checkpoint, storage: one message naming what is wrong and the fix); 1 a run that failed or
diverged (the cause, then where the logs are); 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import yaml

from raytrain.config import ConfigError, DDPConfig, TrainConfig, flag_name

EXIT_FAILED, EXIT_USAGE = 1, 2

def _numbers(text: str) -> list[float | int]:
    """`30,60,80` -> [30, 60, 80] (epochs may be fractional: 0.5,1.5)."""
    try:
        values = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected comma-separated numbers, e.g. 30,60") from None
    return [int(v) if v.is_integer() else v for v in values]


# Flags that take a value, by config field; booleans are handled separately.
_VALUE_TYPES: dict[str, Callable[[str], Any]] = {
    "epochs": int,
    "workers": str,
    "global_batch_size": int,
    "batch_size_per_worker": int,
    "micro_batch_size": int,
    "lr": float,
    "lr_scaling": str,
    "reference_batch_size": int,
    "warmup_epochs": float,
    "schedule": str,
    "weight_decay": float,
    "precision": str,
    "seed": int,
    "max_failures": int,
    "checkpoint_every_steps": int,
    "num_checkpoints_to_keep": int,
    "log_every_steps": int,
    "storage": str,
    "name": str,
    "collective_timeout_s": float,
    "cpus_per_worker": float,
    "address": str,
    "mlflow_uri": str,
    "mlflow_experiment": str,
    "wandb_project": str,
    "progress": str,
    "progress_interval_s": float,
    "shuffle_window_rows": int,
    "data_partitions": int,
    "optimizer": str,
    "momentum": float,
    "grad_clip_norm": float,
    "lr_milestones": _numbers,
    "lr_gamma": float,
    "warmup_start_factor": float,
    "timing_warmup_steps": int,
}
_DDP_VALUE_TYPES = {"bucket_cap_mb": float}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run a command's handler; every error becomes one message and an exit status:
    2 for what the user must fix (configuration, data, pipeline code, checkpoint, storage),
    1 for a run that failed or diverged, 130/143 for SIGINT/SIGTERM. No traceback."""
    from raytrain.errors import UserFault
    from raytrain.interrupts import Interrupted
    from raytrain.rundir import storage_error
    from raytrain.trainer import RunFailed

    def say(message: str) -> None:
        print(f"raytrain {args.command}: {message}", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    try:
        return args.handler(args)
    except Interrupted as exc:
        say(str(exc))
        return exc.exit_status
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Terminated:
        say("terminated")
        return 143
    except RunFailed as exc:
        say(str(exc))
        return EXIT_FAILED
    except FloatingPointError as exc:  # raytrain.loop.TrainingDiverged: the run failed, status "diverged"
        say(str(exc))
        return EXIT_FAILED
    except (UserError, UserFault) as exc:
        say(str(exc))
        return EXIT_USAGE
    except OSError as exc:  # the file system said no somewhere this command writes or reads
        say(str(storage_error(exc, exc.filename or "a file", "use")))
        return EXIT_USAGE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(Exception):
    """SIGTERM outside a run (a run handles it itself: raytrain.interrupts)."""


def _terminate(signum, frame):
    raise Terminated()


class UserError(Exception):
    """Anything the user can fix: printed as one message, exit status 2."""


# -- parser ------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage in one line instead of the whole usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raytrain", description="Elastic, fault-tolerant distributed PyTorch training on Ray.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser("train", help="train a pipeline", description="Train PIPELINE (a built-in name or module:attr).")
    train.add_argument("pipeline", nargs="?", help="built-in name (digits) or module:attr; may come from --config")
    train.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (flags override it)")
    help_of = add_run_flags(train)
    train.add_argument("--resume", dest="resume", action="store_true", default=argparse.SUPPRESS, help=help_of["resume"])
    train.add_argument(
        "--pipeline-arg", dest="pipeline_args", action="append", type=_key_value, default=argparse.SUPPRESS, metavar="KEY=VALUE",
        help="an option of the pipeline itself, repeatable (e.g. the parquet pipeline's --pipeline-arg path=DIR)",
    )
    train.add_argument("--skip-nan-rows", dest="skip_nan_rows", action="store_true", default=argparse.SUPPRESS, help=help_of["skip_nan_rows"])
    train.set_defaults(handler=cmd_train)
    add_tune_parser(commands)

    export = commands.add_parser("export", help="write a plain state_dict from a run or checkpoint")
    export.add_argument("source", metavar="RUN_DIR|CKPT", help="a run directory, a checkpoint directory or a .pt file")
    export.add_argument("-o", "--output", required=True, metavar="F.pt", help="where to write the state_dict")
    export.add_argument(
        "--pipeline", metavar="PIPELINE",
        help="also check that the weights load into this pipeline's model with strict=True (imports the pipeline's code; "
        "without it, export reads only the weights)",
    )  # fmt: skip
    export.set_defaults(handler=cmd_export)

    data = commands.add_parser("data", help="write a pipeline's datasets as Parquet shards")
    data.add_argument("pipeline", help="built-in name (digits) or module:attr")
    data.add_argument("--out", required=True, metavar="DIR", help="directory to write DIR/<dataset>/*.parquet into")
    data.add_argument("--pipeline-arg", dest="pipeline_args", action="append", type=_key_value, default=[], metavar="KEY=VALUE")
    data.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    data.add_argument(
        "--shuffle-seed", type=int, default=0,
        help="rows are written in a random order drawn with this seed, so that a streamed run's window shuffle "
        "(--shuffle-window-rows) mixes rows from the whole dataset (default 0); -1 keeps the pipeline's order",
    )  # fmt: skip
    data.add_argument(
        "--row-group-rows", type=int, default=None, metavar="N",
        help="rows per Parquet row group, the unit a streamed run reads and deals to its workers "
        f"(default: the rows split in at least {DATA_UNITS} groups, at most {DATA_GROUP_ROWS:,} rows each)",
    )  # fmt: skip
    data.set_defaults(handler=cmd_data)

    doctor = commands.add_parser("doctor", help="check what the cluster has and whether a run will work")
    doctor.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    doctor.add_argument("--storage", help="storage path runs will use (default ~/raytrain_results)")
    doctor.set_defaults(handler=cmd_doctor)

    report = commands.add_parser("report", help="plots and a Markdown summary of a run", description="Write RUN_DIR/report.md and RUN_DIR/plots/*.png from the run files.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (STORAGE/NAME)")
    report.set_defaults(handler=cmd_report)

    from raytrain.bench import add_parser as add_bench_parser

    add_bench_parser(commands)
    return parser


def add_run_flags(parser, skip=()) -> dict[str, str]:
    """The train options every run command takes (value flags but `skip`, --gpu, -v, DDP
    flags), all defaulting to 'not given'; returns the field docs for further flags."""
    help_of = _field_docs()
    for name, kind in _VALUE_TYPES.items():
        if name not in skip:
            parser.add_argument(flag_name(name), dest=name, type=kind, default=argparse.SUPPRESS, help=help_of.get(name))
    parser.add_argument("--gpu", dest="gpu", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_of["gpu"])
    for name in ("nesterov", "decay_norm_and_bias"):
        parser.add_argument(flag_name(name), dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_of[name])
    parser.add_argument("-v", "--verbose", dest="verbose", action="store_true", default=argparse.SUPPRESS, help=help_of["verbose"])
    add_ddp_flags(parser)
    return help_of


def add_ddp_flags(parser: argparse.ArgumentParser) -> None:
    """`--ddp-<field>` for every DDPConfig field, stored as `ddp.<field>` for `merge`."""
    docs = _field_docs(DDPConfig)
    for f in dataclasses.fields(DDPConfig):
        flag = flag_name("ddp_" + f.name)
        if f.name in _DDP_VALUE_TYPES:
            parser.add_argument(flag, dest="ddp." + f.name, type=_DDP_VALUE_TYPES[f.name], default=argparse.SUPPRESS, help=docs.get(f.name))
        else:
            parser.add_argument(flag, dest="ddp." + f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=docs.get(f.name))


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"got {text!r}; expected KEY=VALUE, e.g. path=/data/train")
    return key.strip(), value.strip()


def _field_docs(cls: type = TrainConfig) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), for --help."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs, body = {}, tree.body[0].body
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant):
            docs[node.target.id] = str(following.value.value).replace("%", "%%")
    return docs


# -- train -------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from raytrain.pipeline import load_pipeline
    from raytrain.trainer import fit

    spec, file_values, config_file, flags = read_run_options(args)
    try:
        if flags.get("resume") or file_values.get("resume"):
            spec, values = resume_values(spec, file_values, flags)
        else:
            values = merge(load_pipeline(spec).default_config, file_values, flags)
        cfg = TrainConfig.from_dict(values)
        check_pipeline_args(load_pipeline(spec), cfg)
        result = fit(spec, cfg, echo=lambda line: print(line, flush=True), progress=True)
    except ConfigError as exc:
        raise UserError(exc.render(spelling(flags, config_file))) from None
    print_summary(result)
    return 0


def resume_values(spec: str | None, file_values: dict[str, Any], flags: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A resumed run's options: its own config.yaml, then the --config file and flags given
    now, each overriding only what it names. The pipeline defaults to the run's."""
    from raytrain.config import DEFAULT_STORAGE
    from raytrain.resume import read_stored_run

    name = flags.get("name") or file_values.get("name")
    if not name:
        raise ConfigError([("resume", "needs the run to continue: add --name RUN (the directory under --storage)")])
    storage = flags.get("storage") or file_values.get("storage") or DEFAULT_STORAGE
    stored = read_stored_run(Path(storage).expanduser() / name)
    if not stored.config:
        raise ConfigError([("resume", f"there is no run {name!r} in {Path(storage).expanduser()} to resume; check --name and --storage")])
    spec = spec or stored.pipeline
    if not spec:
        raise UserError(f"run {name!r} does not say which pipeline it trains; give it: raytrain train PIPELINE --name {name} --resume")
    return spec, merge(stored.config, file_values, flags)


def check_pipeline_args(pipe, cfg: TrainConfig) -> None:
    """--pipeline-arg keys the pipeline does not declare are refused, listing those it does."""
    from raytrain.pipeline import parse_pipeline_args

    parse_pipeline_args(pipe, cfg.pipeline_args)


def read_run_options(args: argparse.Namespace) -> tuple[str, dict[str, Any], str | None, dict[str, Any]]:
    """The pipeline (argument, else `pipeline:` in --config), the YAML values, its path, the flags given."""
    file_values, config_file = load_yaml(args.config) if args.config else ({}, None)
    spec = args.pipeline or file_values.pop("pipeline", None)
    file_values.pop("pipeline", None)
    resuming = getattr(args, "resume", False) or file_values.get("resume")
    if not spec and not resuming:
        raise UserError(f"no pipeline: give one (raytrain {args.command} digits) or set `pipeline:` in --config")
    flags = {key: value for key, value in vars(args).items() if key not in ("command", "handler", "pipeline", "config")}
    return spec, file_values, config_file, flags


def load_yaml(path: str) -> tuple[dict[str, Any], str]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"--config: file {path} not found; give the path of a YAML file of options")
    try:
        values = yaml.load(file.read_text(), Loader=_ConfigLoader) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(values, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
    return {str(key): value for key, value in values.items()}, path


class _ConfigLoader(yaml.SafeLoader):
    """yaml.safe_load with YAML 1.2 numbers. YAML 1.1 reads `lr: 3e-4` as a string and
    `workers: 2:8` as the base-60 integer 128; here they are 0.0003 and "2:8"."""


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
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


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
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


def spelling(flags: dict[str, Any], config_file: str | None) -> Callable[[str], str]:
    """Name an option as the user wrote it: the flag, or the key in their YAML file."""

    def spell(field: str) -> str:
        if field in flags or not config_file:
            return flag_name(field.replace(".", "_"))
        return f"{field} (in {config_file})"

    return spell


def print_summary(result) -> None:
    s = result.summary
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in s["final_metrics"].items() if isinstance(v, (int, float)))
    steady = f", {s['steady_samples_per_s']:,.0f} samples/s steady" if s.get("steady_samples_per_s") else ""
    print(f"Done in {s['wall_time_s']:.1f} s: {s['epochs']} epochs, {s['steps']} steps{steady}; {metrics}")
    print(f"Run directory: {result.run_dir}")
    if result.model_path:
        print(f"Model: {result.model_path} (plain state_dict, loads with strict=True)")
    if (Path(result.run_dir) / "report.md").exists():
        print(f"Report: {Path(result.run_dir) / 'report.md'} (plots in plots/); TensorBoard: tensorboard --logdir {result.run_dir}")


def cmd_report(args: argparse.Namespace) -> int:
    from raytrain.report import write_report

    path = write_report(args.run_dir)
    plots = sorted((path.parent / "plots").glob("*.png"))
    print(f"Wrote {path} and {len(plots)} plot{'s' if len(plots) != 1 else ''}: {', '.join(p.name for p in plots) or 'none (no metrics yet)'}")
    return 0


# -- tune --------------------------------------------------------------------------------

# Swept train options: comma-separated lists on the tune command line.
_TUNE_AXES = {
    "workers": ("N,N,...", "worker counts to compare, e.g. 1,2,4,8 (default: the config's)"),
    "lr_scaling": ("RULE,...", "LR scaling rules to compare (default: linear,sqrt,none)"),
    "warmup_epochs": ("EPOCHS,...", "warmup lengths to compare, e.g. 0,1,5 (default: the config's)"),
    "lr": ("LR,...", "base learning rates, as a grid, e.g. 1e-4,3e-4 (default: the config's)"),
}
# Options of the sweep itself, not of a trial.
_TUNE_OPTIONS: dict[str, tuple[Callable[[str], Any], str, str]] = {
    "lr_range": (str, "LO:HI", "draw the base learning rate log-uniformly from [LO, HI] instead of --lr"),
    "samples": (int, "N", "with --lr-range: learning rates drawn per grid point (default 1)"),
    "metric": (str, "NAME", "metric that ranks trials and drives early stopping (default val_loss)"),
    "mode": (str, "min|max", "whether lower (min, default) or higher --metric is better"),
    "grace_period": (int, "EPOCHS", "ASHA stops no trial before this many epochs (default 1)"),
    "reduction_factor": (float, "F", "ASHA keeps about 1/F of the trials at each rung (default 2)"),
    "target": (float, "VALUE", "target --metric: trials.csv and the summary give each trial's time to reach it"),
    "max_concurrent_trials": (int, "N", "at most N trials at once (default and cap: as many as fit the cluster)"),
}


def add_tune_parser(commands) -> None:
    tune = commands.add_parser(
        "tune",
        help="sweep lr scaling rule × warmup × worker count (× lr)",
        description="Sweep PIPELINE on Ray Tune: every trial is a `raytrain train` run with the fixed options, "
        "compared on --metric with ASHA early stopping per worker count.",
    )
    tune.add_argument("pipeline", nargs="?", help="built-in name (digits) or module:attr; may come from --config")
    tune.add_argument("--config", metavar="FILE.yaml", help="YAML file of train options fixed for all trials (flags override it)")
    for name, (metavar, text) in _TUNE_AXES.items():
        tune.add_argument(flag_name(name), dest=name, metavar=metavar, default=argparse.SUPPRESS, help=text)
    for name, (kind, metavar, text) in _TUNE_OPTIONS.items():
        tune.add_argument(flag_name(name), dest=name, type=kind, metavar=metavar, default=argparse.SUPPRESS, help=text)
    tune.add_argument("--no-early-stop", dest="early_stop", action="store_false", default=argparse.SUPPRESS, help="run every trial to the end (no ASHA)")
    add_run_flags(tune, skip=_TUNE_AXES)
    tune.set_defaults(handler=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from raytrain.pipeline import load_pipeline
    from raytrain.tune import TuneOptions, parse_search_space, tune

    spec, file_values, config_file, flags = read_run_options(args)
    fixed = dict(flags)
    sweep = {name: fixed.pop(name) for name in _TUNE_OPTIONS if name in fixed}
    # An axis comes from its flag, else from the YAML file (a list, or one value).
    axes = {name: fixed.pop(name, None) for name in _TUNE_AXES}
    for name in _TUNE_AXES:
        in_file = file_values.pop(name, None)
        if axes[name] is None and not (name == "lr" and "lr_range" in sweep):
            axes[name] = in_file
    try:
        space = parse_search_space(**axes, lr_range=sweep.pop("lr_range", None), samples=sweep.pop("samples", None))
        options = TuneOptions(
            **{("grace_period_epochs" if key == "grace_period" else key): value for key, value in sweep.items()},
            **({"early_stop": fixed.pop("early_stop")} if "early_stop" in fixed else {}),
        )
        pipe = load_pipeline(spec)
        cfg = TrainConfig.from_dict(merge(pipe.default_config, file_values, fixed))
        check_pipeline_args(pipe, cfg)
        result = tune(spec, cfg, space, options, echo=lambda line: print(line, flush=True))
    except ConfigError as exc:
        raise UserError(exc.render(spelling(flags, config_file))) from None
    return 0 if result.best is not None else EXIT_FAILED


# -- export ------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from raytrain.checkpoint import load_model_weights
    from raytrain.rundir import storage_errors

    weights = load_model_weights(args.source)
    weights = {_strip_wrappers(key): value for key, value in weights.items()}
    checked = check_against_pipeline(args.pipeline, Path(args.source), weights) if args.pipeline else ""
    output = Path(args.output).expanduser()
    if output.is_dir():
        raise UserError(f"-o {output}: is a directory; give a file name, e.g. -o {output / 'model.pt'}")
    with storage_errors(output, "write"):
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.with_name(f".{output.name}.tmp")
        torch.save(weights, tmp)
        tmp.replace(output)
    size_mb = output.stat().st_size / 2**20
    print(f"Wrote {output}: {len(weights)} tensors, {size_mb:.2f} MiB{checked}")
    print(f"Load with: model.load_state_dict(torch.load({str(output)!r}, weights_only=True), strict=True)")
    return 0


def _strip_wrappers(key: str) -> str:
    """`module.` (DDP) and `_orig_mod.` (torch.compile), in any order and nesting."""
    while key.startswith(("module.", "_orig_mod.")):
        key = key.split(".", 1)[1]
    return key


def check_against_pipeline(spec: str, source: Path, weights: dict) -> str:
    """With --pipeline: load the weights into that pipeline's model with strict=True (the
    run's own options, from its config.yaml when the source is a run, build the model)."""
    from raytrain.pipeline import load_pipeline

    pipe = load_pipeline(spec)
    run_dir = source if source.is_dir() else source.parent
    values: dict[str, Any] = {}
    for candidate in (run_dir, run_dir.parent):
        if (candidate / "config.yaml").is_file():
            values = yaml.safe_load((candidate / "config.yaml").read_text()) or {}
            break
    values.pop("pipeline", None)
    values.pop("gpu", None)
    cfg = TrainConfig.from_dict(merge(pipe.default_config, values, {"resume": False}))
    from raytrain.errors import pipeline_code

    with pipeline_code(pipe, "build_model"):
        model = pipe.build_model(cfg)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{source}: weights do not match {pipe.name}'s model: {str(exc).splitlines()[0]}") from None
    return f"; checked: loads into {pipe.name}'s model with strict=True"


# -- data --------------------------------------------------------------------------------


# `raytrain data` writes at least this many row groups (the units a streamed run deals to its
# partitions and workers: a few per partition), of at most DATA_GROUP_ROWS rows each, and
# DATA_GROUPS_PER_FILE row groups per file.
DATA_UNITS, DATA_GROUP_ROWS, DATA_GROUPS_PER_FILE = 96, 8192, 16


def parquet_layout(rows: int, group_rows: int | None = None) -> tuple[int, int]:
    """(rows per row group, files) for writing `rows` rows."""
    group_rows = group_rows or max(1, min(DATA_GROUP_ROWS, -(-rows // DATA_UNITS)))
    return group_rows, max(1, -(-rows // (group_rows * DATA_GROUPS_PER_FILE)))


def cmd_data(args: argparse.Namespace) -> int:
    from raytrain.pipeline import load_pipeline
    from raytrain.trainer import build_datasets, ray_session

    out = Path(args.out).expanduser().absolute()
    if args.row_group_rows is not None and args.row_group_rows < 1:
        raise UserError(f"--row-group-rows: got {args.row_group_rows}; must be a positive row count, e.g. 8192")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out: {out} is not empty; choose a new directory so no data is overwritten")
    try:
        pipe = load_pipeline(args.pipeline)
        cfg = TrainConfig.from_dict(merge(pipe.default_config, {"pipeline_args": args.pipeline_args, "workers": 1}))
        with ray_session(dataclasses.replace(cfg, address=args.address)):
            for name, ds in build_datasets(pipe, cfg).items():
                rows = ds.count()
                group_rows, num_files = parquet_layout(rows, args.row_group_rows)
                if args.shuffle_seed >= 0:
                    ds = ds.random_shuffle(seed=args.shuffle_seed)
                ds.repartition(num_files).write_parquet(str(out / name), row_group_size=group_rows)
                files = sorted((out / name).glob("*.parquet"))
                print(
                    f"{name}: {rows:,} rows in {len(files)} Parquet file(s) of row groups of up to {group_rows:,} rows "
                    f"under {out / name}", flush=True,
                )  # fmt: skip
    except ConfigError as exc:
        raise UserError(exc.render(lambda name: flag_name(name))) from None
    return 0


# -- doctor ------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from raytrain.doctor import run_doctor

    return run_doctor(address=args.address, storage=args.storage, echo=print)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
