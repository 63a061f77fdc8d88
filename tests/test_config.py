"""Every check of `raytrain.config`: each error names the option, the value and the fix.

Pure tier: no Ray, no torch. Messages are matched with `re.escape` where they quote the
user's value, so a test fails when the message stops naming it.
"""

from __future__ import annotations

import math
import os
import re

import pytest

from raytrain.config import DDPConfig, TrainConfig, parse_workers
from raytrain.errors import ConfigError
from raytrain.fields import flag_name


def problems_of(**kwargs) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)
    return info.value.problems


# -- defaults ------------------------------------------------------------------------------


def test_defaults_resolve_to_32_per_worker():
    cfg = TrainConfig()
    assert cfg.batch_size_per_worker == 32
    assert cfg.global_batch_size is None
    assert cfg.reference_batch_size is None  # frozen later, from the run's max workers
    assert isinstance(cfg.ddp, DDPConfig)


def test_timing_warmup_defaults_to_three_steps_per_epoch():
    assert TrainConfig().timing_warmup_steps == 3
    assert TrainConfig.from_dict({"timing-warmup-steps": 0}).timing_warmup_steps == 0


def test_global_batch_leaves_per_worker_unset():
    cfg = TrainConfig(global_batch_size=64)
    assert cfg.global_batch_size == 64
    assert cfg.batch_size_per_worker is None


def test_default_storage_is_expanded_to_an_absolute_path():
    cfg = TrainConfig()
    assert os.path.isabs(cfg.storage)
    assert "~" not in cfg.storage
    assert cfg.storage == os.path.join(os.path.expanduser("~"), "raytrain_results")


def test_relative_storage_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert TrainConfig(storage="runs").storage == str(tmp_path / "runs")


def test_file_url_storage_becomes_its_path(tmp_path):
    assert TrainConfig(storage=f"file://{tmp_path}/runs").storage == str(tmp_path / "runs")


def test_normalization_is_idempotent():
    cfg = TrainConfig(storage="~/x")
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_worker_views():
    cfg = TrainConfig(workers="2:8")
    assert (cfg.min_workers, cfg.max_workers, cfg.elastic) == (2, 8, True)
    fixed = TrainConfig(workers=4)
    assert (fixed.min_workers, fixed.max_workers, fixed.elastic) == (4, 4, False)
    local = TrainConfig(workers=0)
    assert (local.min_workers, local.max_workers, local.elastic) == (0, 0, False)


def test_flag_name():
    assert flag_name("global_batch_size") == "--global-batch-size"
    assert flag_name("lr") == "--lr"


# -- parse_workers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (4, (4, 4)),
        ("4", (4, 4)),
        (" 3 ", (3, 3)),
        ("2:8", (2, 8)),
        ("5:5", (5, 5)),
        (0, (0, 0)),
        ("0", (0, 0)),
        ("1:1", (1, 1)),
    ],
)
def test_parse_workers_accepts(value, expected):
    assert parse_workers(value) == expected


@pytest.mark.parametrize(
    "value, fix",
    [
        ("3:2", "need 0 <= MIN <= MAX, e.g. 2:8"),
        ("abc", "give a worker count N or MIN:MAX, e.g. 2 or 2:8"),
        ("1:2:3", "give a worker count N or MIN:MAX"),
        ("", "give a worker count N or MIN:MAX"),
        ("2:", "give a worker count N or MIN:MAX"),
        (":4", "give a worker count N or MIN:MAX"),
        ("-1", "give a worker count N or MIN:MAX"),
        ("2.5", "give a worker count N or MIN:MAX"),
        (-1, "need 0 <= MIN <= MAX"),
        (True, "give a worker count N or MIN:MAX"),
        ("0:4", "an elastic run needs MIN >= 1, e.g. 1:4"),
    ],
)
def test_parse_workers_rejects_with_the_value_and_the_fix(value, fix):
    with pytest.raises(ValueError, match=re.escape(f"got {value!r}; {fix}")):
        parse_workers(value)


def test_bad_workers_is_a_config_error_naming_the_option():
    with pytest.raises(ConfigError, match=re.escape("workers: got '3:2'; need 0 <= MIN <= MAX, e.g. 2:8")):
        TrainConfig(workers="3:2")
    with pytest.raises(
        ConfigError, match=re.escape("workers: got 'abc'; give a worker count N or MIN:MAX, e.g. 2 or 2:8")
    ):
        TrainConfig(workers="abc")


# -- single-value checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, example",
    [
        ("epochs", 5),
        ("global_batch_size", 256),
        ("batch_size_per_worker", 32),
        ("micro_batch_size", 16),
        ("reference_batch_size", 32),
        ("log_every_steps", 10),
        ("num_checkpoints_to_keep", 2),
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_positive_integers(name, example, value):
    extra = {"warmup_epochs": 0} if name == "epochs" else {}
    expected = f"{name}: got {value}; must be a positive integer, e.g. {flag_name(name)} {example}"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(**{name: value}, **extra)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"lr": 0.0}, "lr: got 0.0; must be a positive number, e.g. --lr 1e-3"),
        ({"lr": -1e-3}, "lr: got -0.001; must be a positive number, e.g. --lr 1e-3"),
        ({"lr": math.inf}, "lr: got inf; must be a positive number"),
        ({"lr": math.nan}, "lr: got nan; must be a positive number"),
        ({"lr_scaling": "cubic"}, "lr_scaling: got 'cubic'; choose one of linear, sqrt, none"),
        ({"lr_scaling": "sqr"}, "lr_scaling: got 'sqr'; choose one of linear, sqrt, none (did you mean 'sqrt'?)"),
        (
            {"schedule": "steps"},
            "schedule: got 'steps'; choose one of cosine, constant, linear, step, onecycle (did you mean 'step'?)",
        ),
        (
            {"schedule": "cosin"},
            "schedule: got 'cosin'; choose one of cosine, constant, linear, step, onecycle (did you mean 'cosine'?)",
        ),
        ({"precision": "fp8"}, "precision: got 'fp8'; choose one of fp32, bf16, fp16"),
        ({"precision": "bf61"}, "precision: got 'bf61'; choose one of fp32, bf16, fp16 (did you mean 'bf16'?)"),
        ({"warmup_epochs": -0.5}, "warmup_epochs: got -0.5; must be 0 or more, e.g. --warmup-epochs 1"),
        ({"warmup_epochs": math.nan}, "warmup_epochs: got nan; must be 0 or more"),
        ({"weight_decay": -0.1}, "weight_decay: got -0.1; must be 0 or more"),
        ({"weight_decay": math.nan}, "weight_decay: got nan; must be 0 or more"),
        ({"seed": -1}, "seed: got -1; must be 0 or more"),
        ({"max_failures": -2}, "max_failures: got -2; must be 0 or more (-1 retries forever)"),
        (
            {"checkpoint_every_steps": -1},
            "checkpoint_every_steps: got -1; must be 0 (epoch ends only) or a positive step count",
        ),
        (
            {"shuffle_window_rows": -5},
            "shuffle_window_rows: got -5; must be 0 (hold the data in memory) or a row count",
        ),
        ({"shuffle_window_rows": "big"}, "shuffle_window_rows: got 'big' (str); expected an integer"),
        ({"timing_warmup_steps": -1}, "timing_warmup_steps: got -1; must be 0 or more, e.g. --timing-warmup-steps 3"),
        (
            {"collective_timeout_s": 0.0},
            "collective_timeout_s: got 0.0; must be a positive number of seconds, e.g. 600",
        ),
        ({"collective_timeout_s": math.inf}, "collective_timeout_s: got inf; must be a positive number of seconds"),
        ({"cpus_per_worker": 0.0}, "cpus_per_worker: got 0.0; must be a positive number of CPUs, e.g. 1"),
        ({"cpus_per_worker": math.inf}, "cpus_per_worker: got inf; must be a positive number of CPUs"),
        ({"storage": ""}, "storage: is empty; give a directory, e.g. --storage ~/raytrain_results"),
        (
            {"storage": "s3:///runs"},
            "storage: got 's3:///runs'; give a directory or an object store's URI with its bucket, e.g. s3://",
        ),
        ({"storage": "gs://"}, "storage: got 'gs://'; give a directory or an object store's URI"),
        ({"ddp": {"bucket_cap_mb": 0}}, "ddp.bucket_cap_mb: got 0; must be a positive size in MiB, e.g. 25"),
        ({"ddp": {"bucket_cap_mb": -5.0}}, "ddp.bucket_cap_mb: got -5.0; must be a positive size in MiB, e.g. 25"),
        ({"ddp": {"bucket_cap_mb": math.nan}}, "ddp.bucket_cap_mb: got nan; must be a positive size in MiB"),
        ({"ddp": DDPConfig(bucket_cap_mb=0)}, "ddp.bucket_cap_mb: got 0; must be a positive size in MiB"),
    ],
)
def test_value_checks_name_option_value_and_fix(kwargs, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("name", ["bad name", "../up", ".hidden", "a/b", "-dash", "semi;colon"])
def test_bad_run_name(name):
    expected = f"name: got {name!r}; use letters, digits, '.', '_' and '-' only, e.g. --name digits-lr3e-3"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(name=name)


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_run_name_is_refused_with_the_fix(name):
    expected = f"name: got {name!r}; a name cannot be empty: give one, e.g. --name digits-lr3e-3, or leave --name out"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(name=name)


@pytest.mark.parametrize("name", ["digits", "digits-lr3e-3", "run_1.v2", "A", "none", "null", "None"])
def test_good_run_name(name):
    assert TrainConfig(name=name).name == name


def test_edge_values_that_are_allowed():
    cfg = TrainConfig(
        workers=0,
        warmup_epochs=0,
        weight_decay=0,
        max_failures=-1,
        checkpoint_every_steps=0,
        seed=0,
        lr=1,
        ddp={"bucket_cap_mb": 1},
        timing_warmup_steps=0,
        shuffle_window_rows=0,
    )
    assert cfg.lr == 1 and cfg.ddp.bucket_cap_mb == 1 and cfg.timing_warmup_steps == 0


# -- types ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"epochs": "5"}, "epochs: got '5' (str); expected an integer"),
        ({"epochs": 2.0}, "epochs: got 2.0 (float); expected an integer"),
        ({"epochs": True}, "epochs: got True (bool); expected an integer"),
        ({"lr": "fast"}, "lr: got 'fast' (str); expected a number"),
        ({"lr": False}, "lr: got False (bool); expected a number"),
        ({"workers": 2.5}, "workers: got 2.5 (float); expected an integer or a string"),
        ({"workers": [2, 8]}, "workers: got [2, 8] (list); expected an integer or a string"),
        ({"gpu": "yes"}, "gpu: got 'yes' (str); expected true or false"),
        ({"resume": 1}, "resume: got 1 (int); expected true or false"),
        ({"time_phases": "yes"}, "time_phases: got 'yes' (str); expected true or false"),
        ({"timing_warmup_steps": 2.5}, "timing_warmup_steps: got 2.5 (float); expected an integer"),
        ({"name": 5}, "name: got 5 (int); expected a string"),
        ({"global_batch_size": "64"}, "global_batch_size: got '64' (str); expected an integer"),
        ({"storage": None}, "storage: got None (NoneType); expected a string"),
        ({"ddp": {"bucket_cap_mb": "big"}}, "ddp.bucket_cap_mb: got 'big' (str); expected a number"),
        ({"ddp": {"static_graph": "no"}}, "ddp.static_graph: got 'no' (str); expected true or false"),
    ],
)
def test_type_checks(kwargs, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(**kwargs)


def test_ints_are_accepted_where_numbers_are_expected():
    cfg = TrainConfig(lr=1, warmup_epochs=0, collective_timeout_s=30)
    assert cfg.lr == 1 and cfg.collective_timeout_s == 30


@pytest.mark.parametrize("value", [5, None, "ddp", [1]])
def test_ddp_must_be_a_mapping(value):
    with pytest.raises(
        ConfigError, match=re.escape(f"ddp: got {value!r} ({type(value).__name__}); expected a mapping of DDP flags")
    ):
        TrainConfig(ddp=value)


def test_ddp_mapping_becomes_ddp_config():
    cfg = TrainConfig(ddp={"bucket_cap_mb": 50, "static_graph": True})
    assert cfg.ddp == DDPConfig(bucket_cap_mb=50, static_graph=True)


# -- cross-field checks ----------------------------------------------------------------------


def test_both_batch_knobs():
    with pytest.raises(
        ConfigError, match=r"global_batch_size: got 64 together with --batch-size-per-worker 32; set exactly one"
    ) as info:
        TrainConfig(global_batch_size=64, batch_size_per_worker=32)
    assert "--global-batch-size keeps the optimizer's batch fixed" in str(info.value)
    assert "--batch-size-per-worker lets it grow with the workers" in str(info.value)


@pytest.mark.parametrize("workers, max_workers", [(8, 8), ("2:8", 8)])
def test_global_batch_smaller_than_max_workers(workers, max_workers):
    expected = (
        f"global_batch_size: got 4, fewer samples per step than the {max_workers} workers asked for; "
        f"raise it to at least {max_workers} or use fewer --workers"
    )
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(global_batch_size=4, workers=workers)


def test_global_batch_equal_to_workers_is_fine():
    assert TrainConfig(global_batch_size=8, workers="1:8").global_batch_size == 8
    assert TrainConfig(global_batch_size=1, workers=0).global_batch_size == 1


def test_warmup_longer_than_the_run():
    expected = "warmup_epochs: got 3.0, longer than the 2 epochs of the run; lower it or raise --epochs"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(epochs=2, warmup_epochs=3.0)
    assert TrainConfig(epochs=2, warmup_epochs=2.0).warmup_epochs == 2.0


def test_bad_epochs_is_not_also_blamed_on_warmup():
    problems = problems_of(epochs=0)
    assert [name for name, _ in problems] == ["epochs"]


def test_bad_global_batch_is_not_also_blamed_on_the_workers():
    problems = problems_of(global_batch_size=0, workers=4)
    assert problems == [("global_batch_size", "got 0; must be a positive integer, e.g. --global-batch-size 256")]


def test_resume_without_name():
    expected = "resume: needs the run to continue: add --name RUN (the directory under --storage)"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(resume=True)
    assert TrainConfig(resume=True, name="digits-1").resume


# -- every problem at once -------------------------------------------------------------------------


def test_several_value_problems_in_one_error():
    with pytest.raises(ConfigError) as info:
        TrainConfig(epochs=0, lr=0.0, precision="fp8", workers="3:2", resume=True, storage="s3://")
    names = [name for name, _ in info.value.problems]
    # in the order --help lists them: by section (optimization, strategy, storage, cluster)
    assert names == ["epochs", "lr", "precision", "storage", "resume", "workers"]
    text = str(info.value)
    assert text.startswith("Invalid configuration (6 problems):\n")
    for name in names:
        assert f"\n  {name}: got" in text or f"\n  {name}: needs" in text


def test_several_type_problems_in_one_error():
    with pytest.raises(ConfigError) as info:
        TrainConfig(epochs="5", lr="fast", ddp={"bucket_cap_mb": "big"})
    assert [name for name, _ in info.value.problems] == ["epochs", "lr", "ddp.bucket_cap_mb"]
    assert "(3 problems)" in str(info.value)


def test_single_problem_is_one_line():
    with pytest.raises(ConfigError) as info:
        TrainConfig(lr=0.0)
    assert str(info.value) == "Invalid configuration: lr: got 0.0; must be a positive number, e.g. --lr 1e-3"
    assert isinstance(info.value, ValueError)


def test_render_spells_options_the_users_way():
    error = ConfigError(
        [
            ("lr", "got 0.0; must be positive"),
            ("ddp.bucket_cap_mb", "got 0; must be positive"),
            ("", "a general problem"),
        ]
    )
    text = error.render(lambda name: flag_name(name.replace(".", "_")))
    assert "--lr: got 0.0" in text
    assert "--ddp-bucket-cap-mb: got 0" in text
    assert "\n  a general problem" in text


# -- from_dict ---------------------------------------------------------------------------------


def test_from_dict_unknown_key_with_suggestion():
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "lr_scale: unknown option (did you mean 'lr_scaling'?); known: skip_nan_rows, shuffle_window_rows, "
            "data_partitions"
        ),
    ):
        TrainConfig.from_dict({"lr_scale": "sqrt"})


def test_from_dict_unknown_key_without_close_match_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"zzz: unknown option; known: .*\blr\b.*\bddp\b"):
        TrainConfig.from_dict({"zzz": 1})


def test_from_dict_reports_every_unknown_key():
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"epoch": 3, "learnin_rate": 0.1, "lr": 1e-3})
    assert [name for name, _ in info.value.problems] == ["epoch", "learnin_rate"]
    assert "did you mean 'epochs'?" in str(info.value)


def test_from_dict_unknown_ddp_key_with_suggestion():
    with pytest.raises(ConfigError, match=re.escape("ddp.bucket_cap: unknown option (did you mean 'bucket_cap_mb'?)")):
        TrainConfig.from_dict({"ddp": {"bucket_cap": 10}})


def test_from_dict_accepts_dashes_and_non_string_keys_are_errors():
    assert TrainConfig.from_dict({"global-batch-size": 64}).global_batch_size == 64
    with pytest.raises(ConfigError, match=re.escape("1: unknown option")):
        TrainConfig.from_dict({1: 2})


def test_from_dict_round_trip():
    cfg = TrainConfig(workers="2:4", global_batch_size=64, lr_scaling="sqrt", ddp={"static_graph": True}, name="x")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_an_unknown_option_from_the_pipelines_defaults_is_not_blamed_on_a_flag_or_the_file():
    """A typo in a pipeline's default_config: the user gave no --epocs and their file has no
    epocs; the message says where it is."""
    from raytrain.cli.options import spelling

    spell = spelling({"lr": 0.1}, "ok.yaml", {"epochs": 1})
    assert spell("epocs") == "epocs (in the pipeline's default_config)"
    assert spell("epochs") == "epochs (in ok.yaml)"
    assert spell("lr") == "--lr"
    assert spelling({}, None, {})("epocs") == "epocs (in the pipeline's default_config)"
    assert spelling({}, None, {}, resuming=True)("epocs") == "epocs (in the run's config.yaml)"
    assert spelling({}, None, {})("warmup_epochs") == "--warmup-epochs"  # a built-in default: the flag fixes it
    assert spelling({}, "f.yaml")("epochs") == "epochs (in f.yaml)"  # the file's keys not told: as before


def test_a_yaml_word_read_as_a_boolean_or_number_for_a_text_option_says_to_quote_it():
    """`name: no` and `name: 2024` in a YAML file: YAML 1.1 made them False and 2024; the
    message names the trap and the fix."""
    for value in (False, 2024, 83):
        with pytest.raises(ConfigError) as info:
            TrainConfig.from_dict({"name": value})
        text = str(info.value)
        assert f"name: got {value!r}" in text and "expected a string" in text
        assert 'quote it, e.g. name: "..."' in text
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"epochs": "many"})
    assert "quote it" not in str(info.value)
