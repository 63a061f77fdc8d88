"""The parser of every command: a flag for each field of the typed options (`raytrain.fields`:
type, choices, docstring as help, default shown), defaulting to 'not given' so that only what
the user typed overrides the layers below (`raytrain.cli.options`)."""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable, Iterable

import raytrain.cli.commands as handlers
from raytrain import fields
from raytrain.config import TrainConfig
from raytrain.config.tree import SECTIONS
from raytrain.data.write import DATA_GROUP_ROWS, DATA_UNITS
from raytrain.errors import EXIT_USAGE
from raytrain.fields import flag_name


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage in one line instead of the whole usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raytrain", description="Elastic, fault-tolerant distributed PyTorch training on Ray.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a pipeline",
        description="Train PIPELINE (a built-in name or module:attr). `raytrain train PIPELINE --help` also lists "
        "the pipeline's own options (--pipeline-arg) and defaults.",
        add_help=False,
    )
    train.add_argument(
        "-h", "--help", action=PipelineHelp, help="show this help (with PIPELINE first: and the pipeline's options)"
    )
    train.add_argument("pipeline", nargs="?", help="built-in name (digits) or module:attr; may come from --config")
    train.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (flags override it)")
    add_run_flags(train)
    train.set_defaults(handler=handlers.cmd_train)
    add_tune_parser(commands)

    export = commands.add_parser("export", help="write a plain state_dict from a run or checkpoint")
    export.add_argument(
        "source",
        metavar="RUN_DIR|CKPT",
        help="a run directory, a checkpoint directory or a .pt file (a path or a URI: s3://..., gs://...)",
    )
    export.add_argument("-o", "--output", required=True, metavar="F.pt|DIR", help="where to write the state_dict")
    export.add_argument(
        "--format",
        choices=("torch", "hf"),
        default="torch",
        help="torch: a plain state_dict (default); hf: a Hugging Face save_pretrained directory (config, safetensors, "
        "the run's tokenizer), for a pipeline whose model is a transformers PreTrainedModel",
    )
    export.add_argument(
        "--pipeline",
        metavar="PIPELINE",
        help="also check that the weights load into this pipeline's model with strict=True (imports the pipeline's "
        "code; without it, export reads only the weights)",
    )
    # Over the run's own (config.yaml): where its model or tokenizer directory is now, when moved.
    add_flags(export, TrainConfig, only=("pipeline_args",))
    export.set_defaults(handler=handlers.cmd_export)

    data = commands.add_parser("data", help="write a pipeline's datasets as Parquet shards")
    data.add_argument("pipeline", help="built-in name (digits) or module:attr")
    data.add_argument("--out", required=True, metavar="DIR", help="directory to write DIR/<dataset>/*.parquet into")
    add_flags(data, TrainConfig, only=("pipeline_args", "address"))
    data.add_argument(
        "--shuffle-seed",
        type=int,
        default=0,
        help="rows are written in a random order drawn with this seed, so that a streamed run's window shuffle "
        "(--shuffle-window-rows) mixes rows from the whole dataset (default 0); -1 keeps the pipeline's order",
    )
    data.add_argument(
        "--row-group-rows",
        type=int,
        default=None,
        metavar="N",
        help="rows per Parquet row group, the unit a streamed run reads and deals to its workers "
        f"(default: the rows split in at least {DATA_UNITS} groups, at most {DATA_GROUP_ROWS:,} rows each)",
    )
    data.set_defaults(handler=handlers.cmd_data)

    doctor = commands.add_parser("doctor", help="check what the cluster has and whether a run will work")
    doctor.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    doctor.add_argument(
        "--storage", help="storage runs will use: a path (default ~/raytrain_results) or a URI (s3://BUCKET/PREFIX)"
    )
    doctor.set_defaults(handler=handlers.cmd_doctor)

    report = commands.add_parser(
        "report",
        help="plots and a Markdown summary of a run",
        description="Write RUN_DIR/report.md and RUN_DIR/plots/*.png from the run files.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (STORAGE/NAME; a path or a URI)")
    report.set_defaults(handler=handlers.cmd_report)

    add_bench_parser(commands)
    add_check_parser(commands)
    add_plan_parser(commands)
    add_head_parsers(commands)
    return parser


class PipelineHelp(argparse.Action):
    """--help that, after a PIPELINE, adds the pipeline's own options: its `Args` fields as
    `--pipeline-arg KEY=TYPE` with their docstrings and defaults, and its default_config."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        spec = getattr(namespace, "pipeline", None)
        if spec:
            add_pipeline_options(parser, spec)
        parser.print_help()
        parser.exit()


def add_pipeline_options(parser, spec: str) -> None:
    """A help section for pipeline `spec` (or one line saying why it cannot be loaded)."""
    from raytrain.errors import UserError
    from raytrain.pipeline import load_pipeline

    try:
        pipe = load_pipeline(spec)
    except UserError as exc:
        parser.epilog = f"(the options of pipeline {spec} cannot be shown: {exc})"
        return
    defaults = ", ".join(f"{flag_name(key)} {value}" for key, value in pipe.default_config.items())
    group = parser.add_argument_group(
        f"options of pipeline {pipe.name} (--pipeline-arg KEY=VALUE, repeatable; YAML: pipeline_args)",
        f"{pipe.name}'s own defaults, under --config and the flags: {defaults or 'none'}.",
    )
    if pipe.Args is None:
        group.description += f" {pipe.name} takes no --pipeline-arg."
        return
    for option in fields.options(pipe.Args):
        kind = "{" + ",".join(map(str, option.choices)) + "}" if option.choices else option.type_name.upper()
        text = option.help or ""
        default = option.default_words()
        text = f"{text} (default: {default})" if default is not None else f"{text} (required)"
        group.add_argument(f"--pipeline-arg {option.name}={kind}", action="store_const", const=None, help=text)


def add_run_flags(parser, skip: Iterable[str] = ()) -> None:
    """A flag for every TrainConfig field but `skip` (DDPConfig's as `--ddp-<field>`), all
    defaulting to 'not given' so that only what the user typed overrides the layers below.
    On a command's own parser, --help lists them under a heading per section of TrainConfig
    (`data options`, `fault tolerance options`, ...); within a group already, in one list."""
    if not isinstance(parser, argparse.ArgumentParser):
        add_flags(parser, TrainConfig, skip=skip)
        return
    for section in SECTIONS:
        title = re.sub(r"(?<!^)(?=[A-Z])", " ", section.__name__.removesuffix("Section")).lower()
        add_flags(parser.add_argument_group(f"{title} options"), section, skip=skip)


def add_flags(
    parser,
    cls: type,
    *,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
    prefix: str = "",
    spellings: dict[str, tuple[str, ...]] | None = None,
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
        names = spellings.get(option.name) or (option.flags if not prefix else (flag_name(dest),))
        common = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text(option)}
        if option.kinds == (bool,):
            action = "store_true" if option.metadata.get("switch") else argparse.BooleanOptionalAction
            parser.add_argument(*names, action=action, **common)
        else:
            metavar = option.metadata.get("metavar") or (
                "{" + ",".join(map(str, option.choices)) + "}" if option.choices else option.name.upper()
            )
            action = "append" if option.metadata.get("repeat") else "store"
            parser.add_argument(*names, action=action, type=_flag_type(option), metavar=metavar, **common)


def help_text(option: fields.Option) -> str | None:
    """A flag's help: the field's docstring and its default (`(default: 5)`)."""
    text = option.help or ""
    default = option.default_words()
    if default is not None and not option.nested:
        text = f"{text} (default: {default})".strip()
    return text.replace("%", "%%") or None


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


# Swept train options: comma-separated lists on the tune command line.
_TUNE_AXES = {
    "workers": ("N,N,...", "worker counts to compare, e.g. 1,2,4,8 (default: the config's)"),
    "lr_scaling": ("RULE,...", "LR scaling rules to compare (default: linear,sqrt,none)"),
    "warmup_epochs": ("EPOCHS,...", "warmup lengths to compare, e.g. 0,1,5 (default: the config's)"),
    "lr": ("LR,...", "base learning rates, as a grid, e.g. 1e-4,3e-4 (default: the config's)"),
}


# Options of the sweep itself (TuneOptions) spelled otherwise than their field.
_TUNE_SPELLINGS = {"grace_period_epochs": ("--grace-period",)}


def add_tune_parser(commands) -> None:
    from raytrain.tune.options import LrDraws, TuneOptions

    tune = commands.add_parser(
        "tune",
        help="sweep lr scaling rule × warmup × worker count (× lr)",
        description="Sweep PIPELINE on Ray Tune: every trial is a `raytrain train` run with the fixed options, "
        "compared on --metric with ASHA early stopping per worker count.",
    )
    tune.add_argument("pipeline", nargs="?", help="built-in name (digits) or module:attr; may come from --config")
    tune.add_argument(
        "--config", metavar="FILE.yaml", help="YAML file of train options fixed for all trials (flags override it)"
    )
    for name, (metavar, text) in _TUNE_AXES.items():
        tune.add_argument(flag_name(name), dest=name, metavar=metavar, default=argparse.SUPPRESS, help=text)
    add_flags(tune, LrDraws)
    add_flags(tune, TuneOptions, spellings=_TUNE_SPELLINGS)
    add_run_flags(tune, skip=(*_TUNE_AXES, "resume"))
    tune.set_defaults(handler=handlers.cmd_tune)


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
    predict.add_argument(
        "--predict", action="store_true", help="estimate the speedup with the cost model; runs nothing"
    )
    add_flags(predict, PredictOptions, skip=("link",))  # --link is BenchOptions' too
    train = bench.add_argument_group("train options (as for raytrain train)")
    # bench's own --warmup-steps is the timing warm-up; the learning-rate warmup in steps is YAML-only here
    add_run_flags(train, skip=(*BENCH_OWNED, "time_phases", "warmup_steps"))
    bench.set_defaults(handler=handlers.cmd_bench)


def add_check_parser(commands) -> None:
    """`raytrain check`: CheckOptions and the train options the check takes."""
    from raytrain.check.options import CHECK_SKIPPED, CheckOptions

    check = commands.add_parser(
        "check",
        help="do N workers train like 1? per-step loss and gradient norm side by side; names the pitfall",
        description="Train PIPELINE for --steps optimizer steps at 1 worker and at --workers N from the same initial "
        "weights over the same rows (the same global batch, seed and rate), compare every step's loss and gradient "
        "norm, and say whether they agree within the tolerance; when they do not, probe the pipeline for the cause "
        "and name it with its fix. Exit status 0 equivalent, 1 differs, 2 bad usage.",
    )
    check.add_argument("pipeline", nargs="?", help="built-in name (digits) or module:attr; may come from --config")
    check.add_argument("--config", metavar="FILE.yaml", help="YAML file of train options (flags override it)")
    add_flags(check, CheckOptions)
    train = check.add_argument_group("train options (as for raytrain train)")
    add_run_flags(train, skip=CHECK_SKIPPED)
    check.set_defaults(handler=handlers.cmd_check)


def add_plan_parser(commands) -> None:
    """`raytrain plan`: the goodput model on paper (PlanOptions)."""
    from raytrain.bench.plan import PlanOptions

    plan = commands.add_parser(
        "plan",
        help="goodput and the best checkpoint interval per fault-tolerance mode, up to 16,384 workers",
        description="Predict, for each fault-tolerance mode (restart, per-step, per-step with replica groups), the "
        "checkpoint interval that gives the most goodput and that goodput, at each worker count, from the costs of "
        "a step, a save and a recovery and the nodes' MTBF (docs/fault-tolerance.md); runs nothing. With --run, a "
        "run directory's measured figures replace the defaults.",
    )
    add_flags(plan, PlanOptions)
    plan.set_defaults(handler=handlers.cmd_plan)


def add_head_parsers(commands) -> None:
    """`raytrain up` / `raytrain down`: a local Ray head that later runs join."""
    up = commands.add_parser(
        "up",
        help="start a local Ray head that later runs join (faster start); prints how to use it",
        description="Start a loopback-dashboard local Ray head with raytrain's settings (`ray start --head`, its own "
        "temp dir and ports, metrics collection off) and record it in ~/.raytrain/head.json (RAYTRAIN_HEAD_FILE). "
        "While it runs, train, check, tune, bench and doctor without --address join it. `raytrain down` stops it.",
    )
    up.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        metavar="N",
        help="the head's logical CPUs (default: 2 per core + 2, what the largest embedded run gets)",
    )
    up.set_defaults(handler=handlers.cmd_up)
    down = commands.add_parser(
        "down",
        help="stop the local Ray head `raytrain up` started (only it: never `ray stop`)",
        description="Stop the head recorded by `raytrain up`, by its recorded process group and processes, and "
        "clear the record.",
    )
    down.set_defaults(handler=handlers.cmd_down)
