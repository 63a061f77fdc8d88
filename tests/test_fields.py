"""The command line is derived from the dataclasses (`raytrain.fields`): every field is a flag
with its type, choices and docstring, a new field needs no change to the CLI, and a
pipeline's `Args` are converted by the same rules (pure, no Ray)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

import raytrain
from raytrain import fields
from raytrain.bench import BenchOptions
from raytrain.bench.predict import PredictOptions
from raytrain.cli.parser import add_flags, build_parser
from raytrain.config import DDPConfig, TrainConfig
from raytrain.errors import PipelineError
from raytrain.fields import flag_name
from raytrain.pipeline import parse_pipeline_args
from raytrain.tune.options import TuneOptions


def subcommand(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions}


EXAMPLES = {int: ("3", 3), float: ("0.25", 0.25), str: ("text", "text")}


@pytest.mark.parametrize("option", fields.options(TrainConfig), ids=lambda o: o.name.replace("gpu", "g-p-u"))
def test_every_train_config_field_is_a_train_flag_with_its_type_and_help(option):
    actions = actions_by_dest(subcommand("train"))
    if option.nested is not None:  # ddp: one flag per DDPConfig field
        for inner in fields.options(option.nested):
            action = actions[f"{option.name}.{inner.name}"]
            assert flag_name(f"{option.name}_{inner.name}") in action.option_strings
            assert action.help == f"{inner.help} (default: {inner.default_words()})"
        return
    action = actions[option.name]
    # --help says every default: the docstring, then the default (`default_text` where the value would not say it)
    assert option.help and action.help == f"{option.help} (default: {option.default_words()})", option.name
    assert action.default is argparse.SUPPRESS  # only what the user typed overrides the layers below
    if option.kinds == (bool,):
        assert action.nargs == 0
    elif option.metadata.get("parse") is None:
        text, value = EXAMPLES[str if str in option.kinds else option.kinds[0]]
        assert action.type(text) == value
        assert action.type.__name__ == option.type_name
    if option.choices:
        assert action.metavar == "{" + ",".join(option.choices) + "}"


def test_field_types_choices_and_docstrings_are_read_from_the_dataclass():
    workers = fields.option(TrainConfig, "workers")
    assert workers.kinds == (int, str) and not workers.optional and workers.words() == "an integer or a string"
    precision = fields.option(TrainConfig, "precision")
    assert precision.choices == ("fp32", "bf16", "fp16") and precision.kinds == (str,)
    assert fields.option(TrainConfig, "grad_clip_norm").optional
    assert fields.option(TrainConfig, "ddp").nested is DDPConfig
    assert fields.option(DDPConfig, "bucket_cap_mb").help.startswith("Gradient bucket size in MiB")
    assert fields.option(TrainConfig, "lr").accepts(2) and not fields.option(TrainConfig, "lr").accepts(True)


def test_command_line_values_keep_the_users_spelling_where_text_is_a_value():
    parsed = subcommand("train").parse_args(
        [
            "--workers",
            "2",
            "--lr-milestones",
            "3,6.5",
            "--lr",
            "1e-3",
            "--pipeline-arg",
            "path=/d",
            "--pipeline-arg",
            "k=v",
        ]
    )
    assert parsed.workers == "2" and parsed.lr_milestones == [3, 6.5] and parsed.lr == 1e-3
    assert parsed.pipeline_args == [("path", "/d"), ("k", "v")]
    given = vars(subcommand("train").parse_args(["--no-ddp-static-graph", "-v"]))
    assert {key: given[key] for key in given if key not in ("pipeline", "config", "handler")} == {
        "ddp.static_graph": False,
        "verbose": True,
    }


@dataclass(kw_only=True)
class WithANewKnob(TrainConfig):
    new_knob: float = 0.5
    """A knob added to the config."""
    mode: Literal["fast", "slow"] = "fast"
    """Fast or slow."""
    targets: list | None = field(default=None, metadata={"parse": lambda text: text.split("+"), "metavar": "A+B"})
    """Targets joined by +."""


def test_a_new_field_is_a_flag_without_touching_the_cli():
    parser = argparse.ArgumentParser()
    add_flags(parser, WithANewKnob)
    parsed = parser.parse_args(["--new-knob", "0.25", "--mode", "slow", "--targets", "a+b", "--epochs", "3"])
    assert (parsed.new_knob, parsed.mode, parsed.targets, parsed.epochs) == (0.25, "slow", ["a", "b"], 3)
    actions = actions_by_dest(parser)
    assert actions["new_knob"].help == "A knob added to the config. (default: 0.5)"
    assert actions["mode"].metavar == "{fast,slow}"
    assert actions["targets"].metavar == "A+B"


def test_tune_and_bench_options_are_flags_of_their_commands():
    tune = actions_by_dest(subcommand("tune"))
    for option in fields.options(TuneOptions):
        assert tune[option.name].help.startswith(option.help)
    assert "--grace-period" in tune["grace_period_epochs"].option_strings and tune["grace_period_epochs"].type("2") == 2
    assert "resume" not in tune and "lr" in tune  # lr is a swept axis there, a comma-separated list
    bench = actions_by_dest(subcommand("bench"))
    for option in (*fields.options(BenchOptions), *fields.options(PredictOptions)):
        assert option.name in bench and bench[option.name].help, option.name
    assert {"--warmup-steps", "--timing-warmup-steps"} <= set(bench["warmup_steps"].option_strings)
    assert "--from" in bench["source"].option_strings and "epochs" not in bench and "lr" in bench


@dataclass
class Knobs:
    path: str
    """Where the data is."""
    size: int = 4
    kind: Literal["mlp", "cnn"] = "mlp"
    scale: float | None = None
    fast: bool = False


class KnobsPipeline(raytrain.Pipeline):
    Args = Knobs


def test_pipeline_args_are_converted_by_the_same_rules():
    args = parse_pipeline_args(
        KnobsPipeline(), {"path": "/d", "size": "8", "kind": "cnn", "scale": "none", "fast": "yes"}
    )
    assert args == Knobs("/d", 8, "cnn", None, True)
    assert parse_pipeline_args(KnobsPipeline(), {"path": "/d", "scale": 2}).scale == 2.0  # a YAML number
    with pytest.raises(PipelineError) as failure:
        parse_pipeline_args(KnobsPipeline(), {"path": "/d", "scale": "big", "size": "1.5"})
    message = str(failure.value)
    assert "--pipeline-arg scale: got 'big'; expected a number or none" in message
    assert "--pipeline-arg size: got '1.5'; expected an integer" in message
    assert fields.option(Knobs, "path").help == "Where the data is." and fields.option(Knobs, "path").required
