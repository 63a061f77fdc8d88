"""The options of `--checkpoint-every auto` in the config tree: their defaults, their checks (exit 2
naming the fix) and how they layer with a fixed --checkpoint-every-steps (pure, no Ray)."""

from __future__ import annotations

import math

import pytest
from test_cli import assert_usage_error, cli

from raytrain.config import TrainConfig, merge_layers
from raytrain.errors import ConfigError
from raytrain.rules import goodput


def test_defaults():
    cfg = TrainConfig()
    assert cfg.checkpoint_every is None and cfg.checkpoint_every_steps == 0
    assert cfg.mtbf_hours == goodput.DEFAULT_NODE_MTBF_H  # Llama 3's, as docs/fault-tolerance.md cites
    assert (cfg.checkpoint_min_steps, cfg.checkpoint_max_steps) == (10, 100_000)
    assert TrainConfig(checkpoint_every="auto", mtbf_hours=500).mtbf_hours == 500


def test_fixed_interval_keeps_working():
    assert TrainConfig(checkpoint_every_steps=50).checkpoint_every_steps == 50


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"checkpoint_every": "auto", "checkpoint_every_steps": 50},
            "checkpoint_every: got auto together with --checkpoint-every-steps 50; give one",
        ),
        ({"checkpoint_every": "always"}, "checkpoint_every: got 'always'; choose one of auto"),
        ({"mtbf_hours": 0.0}, "mtbf_hours: got 0.0; must be a positive number of hours per node"),
        ({"mtbf_hours": math.inf}, "mtbf_hours: got inf; must be a positive number"),
        ({"mtbf_hours": "long"}, "mtbf_hours: got 'long' (str); expected a number"),
        ({"checkpoint_min_steps": 0}, "checkpoint_min_steps: got 0; must be a positive integer"),
        (
            {"checkpoint_min_steps": 100, "checkpoint_max_steps": 10},
            "checkpoint_max_steps: got 10, fewer than --checkpoint-min-steps 100",
        ),
    ],
)
def test_checks_name_the_fix(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**values)


def test_a_layer_naming_one_replaces_the_other():
    # a pipeline's (or a --config file's) fixed interval gives way to --checkpoint-every auto on the command line
    merged = merge_layers({"checkpoint_every_steps": 100}, {"checkpoint_every": "auto"})
    assert TrainConfig.from_dict(merged).checkpoint_every == "auto"
    merged = merge_layers({"checkpoint_every": "auto"}, {"checkpoint_every_steps": 20})
    cfg = TrainConfig.from_dict(merged)
    assert (cfg.checkpoint_every, cfg.checkpoint_every_steps) == (None, 20)


def test_both_flags_exit_2_naming_the_fix(capsys, tmp_path):
    code, out, err = cli(
        capsys,
        "train",
        "digits",
        "--checkpoint-every",
        "auto",
        "--checkpoint-every-steps",
        "50",
        "--storage",
        str(tmp_path),
    )
    assert_usage_error(code, out, err, "--checkpoint-every: got auto together with --checkpoint-every-steps 50")


def test_flag_choices(capsys, tmp_path):
    code, out, err = cli(capsys, "train", "digits", "--checkpoint-every", "often", "--storage", str(tmp_path))
    assert code == 2 and "auto" in err, err


def test_auto_with_per_step_replicas_is_refused_naming_the_fix():
    with pytest.raises(
        ConfigError, match="checkpoint_every: got auto with --fault-tolerance per-step.*--checkpoint-every-steps N"
    ):
        TrainConfig(checkpoint_every="auto", fault_tolerance="per-step")
