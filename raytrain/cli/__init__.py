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
from typing import Any, Callable, Iterable

import yaml

from raytrain import fields
from raytrain.config import ConfigError, TrainConfig, flag_name
from raytrain.observe.render import plural

EXIT_FAILED, EXIT_USAGE = 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run a command's handler; every error becomes one message and an exit status, here
    and nowhere else: 2 for what the user must fix (configuration, data, pipeline code,
    checkpoint, storage), 1 for a run that failed or diverged, 130/143 for SIGINT/SIGTERM.
    No traceback. A ConfigError names each option as the user wrote it (`args.spell`, set
    by `read_run_options`; else as a flag)."""
    from raytrain.bench import BenchError
    from raytrain.errors import UserFault
    from raytrain.driver.interrupts import Interrupted
    from raytrain.rundir import storage_error
    from raytrain.driver.run import RunFailed

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
    except (RunFailed, BenchError) as exc:
        say(str(exc))
        return EXIT_FAILED
    except FloatingPointError as exc:  # raytrain.worker.loop.TrainingDiverged: the run failed, status "diverged"
        say(str(exc))
        return EXIT_FAILED
    except ConfigError as exc:
        say(exc.render(getattr(args, "spell", None) or _as_flag))
        return EXIT_USAGE
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
    """SIGTERM outside a run (a run handles it itself: raytrain.driver.interrupts)."""


def _terminate(signum, frame):
    raise Terminated()


class UserError(Exception):
    """Anything the user can fix: printed as one message, exit status 2."""


def _as_flag(field: str) -> str:
    """`ddp.bucket_cap_mb` -> `--ddp-bucket-cap-mb`."""
    return flag_name(field.replace(".", "_"))


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
    add_run_flags(train)
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
    add_flags(data, TrainConfig, only=("pipeline_args", "address"))
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

    add_bench_parser(commands)
    return parser


def add_run_flags(parser, skip: Iterable[str] = ()) -> None:
    """A flag for every TrainConfig field but `skip` (DDPConfig's as `--ddp-<field>`), all
    defaulting to 'not given' so that only what the user typed overrides the layers below."""
    add_flags(parser, TrainConfig, skip=skip)


def add_flags(
    parser, cls: type, *, skip: Iterable[str] = (), only: Iterable[str] | None = None, prefix: str = "", spellings: dict[str, tuple[str, ...]] | None = None
) -> None:
    """A flag for each field of the dataclass `cls`, from its type, docstring and metadata
    (`raytrain.fields`): booleans as `--x/--no-x` (a `switch`: `--x` only), a nested dataclass
    as `--<field>-<its field>` stored as `<field>.<its field>`, every other field as a value
    converted to its type. Each defaults to 'not given' (argparse.SUPPRESS)."""
    skip, only, spellings = set(skip), None if only is None else set(only), spellings or {}
    for option in fields.options(cls):
        if option.name in skip or (only is not None and option.name not in only):
            continue
        if option.nested is not None:
            add_flags(parser, option.nested, prefix=f"{prefix}{option.name}.")
            continue
        dest = prefix + option.name
        names = spellings.get(option.name) or (option.flags if not prefix else (_as_flag(dest),))
        common = {"dest": dest, "default": argparse.SUPPRESS, "help": (option.help or "").replace("%", "%%") or None}
        if option.kinds == (bool,):
            action = "store_true" if option.metadata.get("switch") else argparse.BooleanOptionalAction
            parser.add_argument(*names, action=action, **common)
        else:
            metavar = option.metadata.get("metavar") or ("{" + ",".join(map(str, option.choices)) + "}" if option.choices else option.name.upper())
            action = "append" if option.metadata.get("repeat") else "store"
            parser.add_argument(*names, action=action, type=_flag_type(option), metavar=metavar, **common)


def _flag_type(option: fields.Option) -> Callable[[str], Any]:
    """The field's text -> value for argparse. A field's own parser explains what went wrong
    (`argument --lr-milestones: got '3,x'; expected ...`); a plain type lets argparse say
    `invalid int value: 'abc'`."""

    def convert(text: str) -> Any:
        try:
            return option.from_text(text)
        except ValueError as exc:
            if option.metadata.get("parse") is not None:
                raise argparse.ArgumentTypeError(str(exc)) from None
            raise

    convert.__name__ = option.type_name
    return convert


# -- train -------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from raytrain.pipeline import load_pipeline
    from raytrain.driver.run import fit

    spec, file_values, flags = read_run_options(args)
    if flags.get("resume") or file_values.get("resume"):
        spec, values = resume_values(spec, file_values, flags)
    else:
        values = merge(load_pipeline(spec).default_config, file_values, flags)
    cfg = TrainConfig.from_dict(values)
    check_pipeline_args(load_pipeline(spec), cfg)
    result = fit(spec, cfg, echo=lambda line: print(line, flush=True), progress=True)
    print_summary(result)
    return 0


def resume_values(spec: str | None, file_values: dict[str, Any], flags: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A resumed run's options: its own config.yaml, then the --config file and flags given
    now, each overriding only what it names. The pipeline defaults to the run's."""
    from raytrain.config import DEFAULT_STORAGE
    from raytrain.rules.resume import read_stored_run

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


def read_run_options(args: argparse.Namespace, exclude: Iterable[str] = (), example: str = "digits") -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The pipeline (argument, else `pipeline:` in --config), the YAML values and the flags
    given (but `exclude`: a command's own options). Sets `args.spell`, which names an option
    in a ConfigError as the user wrote it: the flag, or the key in the --config file."""
    file_values, config_file = load_yaml(args.config) if args.config else ({}, None)
    spec = args.pipeline or file_values.pop("pipeline", None)
    file_values.pop("pipeline", None)
    resuming = getattr(args, "resume", False) or file_values.get("resume")
    if not spec and not resuming:
        raise UserError(f"no pipeline: give one (raytrain {args.command} {example}) or set `pipeline:` in --config")
    ignored = {"command", "handler", "pipeline", "config", "spell", *exclude}
    flags = {key: value for key, value in vars(args).items() if key not in ignored}
    args.spell = spelling(flags, config_file)
    return spec, file_values, flags


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
    from raytrain.observe.report import write_report

    path = write_report(args.run_dir)
    plots = sorted((path.parent / "plots").glob("*.png"))
    print(f"Wrote {path} and {plural(len(plots), 'plot')}: {', '.join(p.name for p in plots) or 'none (no metrics yet)'}")
    return 0


# -- tune --------------------------------------------------------------------------------

# Swept train options: comma-separated lists on the tune command line.
_TUNE_AXES = {
    "workers": ("N,N,...", "worker counts to compare, e.g. 1,2,4,8 (default: the config's)"),
    "lr_scaling": ("RULE,...", "LR scaling rules to compare (default: linear,sqrt,none)"),
    "warmup_epochs": ("EPOCHS,...", "warmup lengths to compare, e.g. 0,1,5 (default: the config's)"),
    "lr": ("LR,...", "base learning rates, as a grid, e.g. 1e-4,3e-4 (default: the config's)"),
}


@dataclasses.dataclass(kw_only=True)
class LrDraws:
    """How `raytrain tune` draws learning rates instead of taking --lr's grid."""

    lr_range: str | None = dataclasses.field(default=None, metadata={"metavar": "LO:HI"})
    """Draw the base learning rate log-uniformly from [LO, HI] instead of --lr."""
    samples: int | None = dataclasses.field(default=None, metadata={"metavar": "N"})
    """With --lr-range: learning rates drawn per grid point (default 1)."""


# Options of the sweep itself (TuneOptions) spelled otherwise than their field.
_TUNE_SPELLINGS = {"grace_period_epochs": ("--grace-period",)}


def add_tune_parser(commands) -> None:
    from raytrain.tune import TuneOptions

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
    add_flags(tune, LrDraws)
    add_flags(tune, TuneOptions, spellings=_TUNE_SPELLINGS)
    add_run_flags(tune, skip=(*_TUNE_AXES, "resume"))
    tune.set_defaults(handler=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from raytrain.pipeline import load_pipeline
    from raytrain.tune import TuneOptions, parse_search_space, tune

    spec, file_values, flags = read_run_options(args)
    fixed = dict(flags)
    draws = {option.name: fixed.pop(option.name) for option in fields.options(LrDraws) if option.name in fixed}
    options = {option.name: fixed.pop(option.name) for option in fields.options(TuneOptions) if option.name in fixed}
    # An axis comes from its flag, else from the YAML file (a list, or one value).
    axes = {name: fixed.pop(name, None) for name in _TUNE_AXES}
    for name in _TUNE_AXES:
        in_file = file_values.pop(name, None)
        if axes[name] is None and not (name == "lr" and "lr_range" in draws):
            axes[name] = in_file
    space = parse_search_space(**axes, **draws)
    sweep = TuneOptions(**options)
    pipe = load_pipeline(spec)
    cfg = TrainConfig.from_dict(merge(pipe.default_config, file_values, fixed))
    check_pipeline_args(pipe, cfg)
    result = tune(spec, cfg, space, sweep, echo=lambda line: print(line, flush=True))
    return 0 if result.best is not None else EXIT_FAILED


# -- bench -------------------------------------------------------------------------------


def add_bench_parser(commands) -> None:
    """`raytrain bench`: BenchOptions, the cost model's PredictOptions (with --predict), and
    every train option but those bench decides itself."""
    from raytrain.bench import BENCH_OWNED, BenchOptions
    from raytrain.bench.predict import PredictOptions

    bench = commands.add_parser(
        "bench",
        help="scaling study: throughput, speedup and efficiency per worker count",
        description="Run PIPELINE at each worker count and report throughput, speedup, efficiency and the "
        "step-time split; with --predict, run nothing and estimate the speedup with the cost model.",
    )
    bench.add_argument("pipeline", nargs="?", help="built-in name (digits) or module:attr; may come from --config")
    bench.add_argument("--config", metavar="FILE.yaml", help="YAML file of train options (flags override it)")
    # Text, read by bench.worker_counts: a bad list is a configuration error naming --workers.
    bench.add_argument("--workers", default="1,2", metavar="N,N,...", help=fields.option(BenchOptions, "workers").help)
    add_flags(bench, BenchOptions, skip=("workers",))
    predict = bench.add_argument_group("cost model (--predict)")
    predict.add_argument("--predict", action="store_true", help="estimate the speedup with the cost model; runs nothing")
    add_flags(predict, PredictOptions, skip=("link",))  # --link is BenchOptions' too
    train = bench.add_argument_group("train options (as for raytrain train)")
    add_run_flags(train, skip=(*BENCH_OWNED, "time_phases"))
    bench.set_defaults(handler=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from raytrain.bench import BenchOptions, bench_config, run_bench, worker_counts
    from raytrain.pipeline import load_pipeline
    from raytrain.bench.predict import PredictOptions, predict_speedups

    given = vars(args)
    own = {option.name for option in (*fields.options(BenchOptions), *fields.options(PredictOptions))}
    if args.predict:
        predict_speedups(PredictOptions(**{option.name: given[option.name] for option in fields.options(PredictOptions) if option.name in given}))
        return 0
    values = {option.name: given[option.name] for option in fields.options(BenchOptions) if option.name in given}
    values["workers"] = worker_counts(args.workers)
    values["baselines"] = [name for names in values.get("baselines", []) for name in names]
    opts = BenchOptions(**values)
    spec, file_values, flags = read_run_options(args, exclude={*own, "predict"}, example="digits --workers 1,2")
    args.spell = None  # bench names every option as a flag
    values = merge(load_pipeline(spec).default_config, file_values, flags)
    bench_config(values, opts, workers=max(opts.workers), epochs=1, storage=Path(opts.storage), name="check")  # validate before starting
    run_bench(spec, values, opts, echo=lambda line: print(line, flush=True))
    return 0


# -- export ------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from raytrain.rundir.checkpoints import load_model_weights
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
    from raytrain.driver.run import build_datasets, ray_session

    out = Path(args.out).expanduser().absolute()
    if args.row_group_rows is not None and args.row_group_rows < 1:
        raise UserError(f"--row-group-rows: got {args.row_group_rows}; must be a positive row count, e.g. 8192")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out: {out} is not empty; choose a new directory so no data is overwritten")
    pipe = load_pipeline(args.pipeline)
    cfg = TrainConfig.from_dict(merge(pipe.default_config, {"pipeline_args": getattr(args, "pipeline_args", []), "workers": 1}))
    with ray_session(dataclasses.replace(cfg, address=getattr(args, "address", None))):
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
    return 0


# -- doctor ------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from raytrain.doctor import run_doctor

    return run_doctor(address=args.address, storage=args.storage, echo=print)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
