"""`TrainConfig` in sections: every field in exactly one, every key still flat.

Pure tier: no Ray, no torch. The flat surface (keyword arguments, YAML keys, an earlier run's
config.yaml) reads as it did before the sections; the lists the checks and the resume rules
once kept by hand are written out literally below, and the fields' metadata must say the same.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from raytrain import fields
from raytrain.cli.options import resumed_options
from raytrain.config import TrainConfig, merge_layers
from raytrain.config.checks import across_sections
from raytrain.config.optimization import OptimizationSection
from raytrain.config.sections import ClusterSection, DataSection, StorageSection
from raytrain.config.tree import SECTIONS, exclusive_pairs
from raytrain.errors import ConfigError
from raytrain.rules import resume
from raytrain.rundir import RunDir, Store

# The lists that the fields' metadata replaced, as they were written.
OLD_EXCLUSIVE_PAIRS = (
    {"global_batch_size", "batch_size_per_worker"},
    {"epochs", "max_steps"},
    {"warmup_epochs", "warmup_steps"},
    {"checkpoint_every", "checkpoint_every_steps"},
)
OLD_ORDER_FIELDS = ("seed", "shuffle_window_rows", "data_partitions")
OLD_STATE_FIELDS = ("optimizer", "decay_norm_and_bias")
OLD_INVOCATION_FIELDS = ("resume", "address", "verbose", "progress", "progress_interval_s", "name", "storage")

# config.yaml as a run wrote it before the sections (the flat TrainConfig's field order, a
# pipeline's build_optimizer recorded in place of --optimizer and the options only it used).
OLD_CONFIG_YAML = """\
epochs: 5
max_steps: null
workers: '2:4'
gpu: false
global_batch_size: 256
batch_size_per_worker: null
micro_batch_size: null
lr: 0.003
lr_scaling: linear
reference_batch_size: null
warmup_epochs: 0.0
warmup_steps: 50
schedule: step
lr_milestones:
- 2
- 4
lr_gamma: 0.1
warmup_start_factor: null
optimizer: the pipeline's build_optimizer (AdamW, 2 groups)
grad_clip_norm: null
precision: bf16
strategy: ddp
fsdp_reshard_after_forward: true
activation_checkpointing: false
compile: false
seed: 0
max_failures: 3
fault_tolerance: restart
checkpoint_every_steps: 0
checkpoint_every: auto
mtbf_hours: 6335.0
checkpoint_min_steps: 10
checkpoint_max_steps: 100000
num_checkpoints_to_keep: 2
checkpoint_async: true
log_every_steps: 10
eval_every_steps: 100
eval_batches: null
storage: STORAGE
name: digits-old
resume: false
collective_timeout_s: 600.0
cpus_per_worker: 1.0
address: null
verbose: false
mlflow_uri: null
mlflow_experiment: raytrain
wandb_project: null
progress: auto
progress_interval_s: 10.0
skip_nan_rows: false
shuffle_window_rows: null
data_partitions: 24
sync_batchnorm: false
peak_tflops: null
time_phases: false
prefetch: auto
timing_warmup_steps: 3
ddp:
  bucket_cap_mb: 50
  gradient_as_bucket_view: true
  static_graph: false
  broadcast_buffers: true
  find_unused_parameters: false
pipeline_args:
  path: /data/x
pipeline: digits
"""
# What only the pipeline's build_optimizer used: left out of config.yaml, defaults on a resume.
OPTIMIZER_DEFAULTS = {"optimizer": "adamw", "momentum": 0.9, "nesterov": False, "weight_decay": 0.01}


def names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# -- the sections --------------------------------------------------------------------------


def test_every_field_belongs_to_exactly_one_section():
    for name in names(TrainConfig):
        owners = [section.__name__ for section in SECTIONS if name in names(section)]
        assert len(owners) == 1, f"{name} is in {owners}"
    assert sorted(sum((names(section) for section in SECTIONS), [])) == sorted(names(TrainConfig))
    assert set(TrainConfig.__bases__) == set(SECTIONS)


def test_fields_are_listed_section_by_section():
    """--help, the checks' messages and config.yaml follow the sections' order."""
    assert names(TrainConfig) == [name for section in SECTIONS for name in names(section)]
    assert names(TrainConfig)[:2] == ["skip_nan_rows", "shuffle_window_rows"]


def test_every_field_keeps_its_help():
    docs = fields.field_docs(TrainConfig)
    assert sorted(docs) == sorted(names(TrainConfig))
    assert docs["lr"].startswith("Learning rate tuned for `reference_batch_size`")


# -- the flat surface ----------------------------------------------------------------------

FLAT = {
    "workers": "2:4",
    "global_batch_size": 256,
    "lr": 3e-3,
    "schedule": "step",
    "lr_milestones": [2, 4],
    "warmup_steps": 50,
    "precision": "bf16",
    "checkpoint_every": "auto",
    "shuffle_window_rows": 4096,
    "eval_every_steps": 100,
    "name": "flat-run",
    "ddp": {"bucket_cap_mb": 50},
    "pipeline_args": {"path": "/data/x"},
}


def test_flat_construction_reads_every_field_by_its_own_name():
    cfg = TrainConfig(**FLAT)
    for key, value in FLAT.items():
        got = getattr(cfg, key)
        assert (dataclasses.asdict(got) if key == "ddp" else got) == (
            {**dataclasses.asdict(type(cfg.ddp)()), **value} if key == "ddp" else value
        )
    assert all(isinstance(cfg, section) for section in SECTIONS)
    assert (cfg.min_workers, cfg.max_workers, cfg.elastic) == (2, 4, True)
    # defaults that depend on other sections' knobs are still filled in
    assert (cfg.epochs, cfg.batch_size_per_worker, cfg.warmup_epochs) == (5, None, 0.0)


def test_yaml_round_trip_is_unchanged():
    cfg = TrainConfig(**FLAT)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    again = TrainConfig.from_dict(yaml.safe_load(text))
    assert again == cfg
    assert list(yaml.safe_load(text)) == names(TrainConfig)


def test_an_earlier_runs_config_yaml_loads_as_it_did(tmp_path):
    run = tmp_path / "digits-old"
    run.mkdir()
    (run / "config.yaml").write_text(OLD_CONFIG_YAML.replace("STORAGE", str(tmp_path)))
    spec, values = resumed_options(None, {}, {"name": "digits-old", "storage": str(tmp_path), "resume": True})
    cfg = TrainConfig.from_dict(values)

    recorded = yaml.safe_load(OLD_CONFIG_YAML.replace("STORAGE", str(tmp_path)))
    expected = {key: value for key, value in recorded.items() if key not in ("pipeline", "optimizer")}
    # gpu is what the run found, decided again by a resume (raytrain.rundir.RunDir.stored_run)
    expected.update(OPTIMIZER_DEFAULTS, decay_norm_and_bias=True, resume=True, gpu=None)
    # fields added since: their defaults
    expected.update(
        replica_group_size=1,
        tf32=True,
        straggler_factor=1.5,
        straggler_steps=20,
        replica_check_steps=None,
        evict_stragglers=False,
        straggler_evict_steps=200,
    )
    assert spec == "digits"
    assert cfg.to_dict() == expected
    # resumed with the options it ran with: nothing to report, nothing refused
    stored = RunDir(Store.of(str(tmp_path)) / "digits-old").stored_run()
    assert resume.changes(stored, cfg.to_dict(), "digits", ["build_optimizer"]) == ([], [])


# -- metadata in place of lists ------------------------------------------------------------


def test_instead_of_marks_the_old_exclusive_pairs():
    assert sorted(map(sorted, exclusive_pairs())) == sorted(map(sorted, OLD_EXCLUSIVE_PAIRS))
    for pair in OLD_EXCLUSIVE_PAIRS:
        for given in pair:
            (other,) = pair - {given}
            below, above = {other: 1, "lr": 0.1}, {given: 2}
            assert merge_layers(below, above) == {"lr": 0.1, given: 2}
            assert merge_layers(below, {**above, other: 3}) == {"lr": 0.1, given: 2, other: 3}


def test_on_resume_marks_the_old_resume_lists():
    assert sorted(resume.ORDER_FIELDS) == sorted(OLD_ORDER_FIELDS)
    assert sorted(resume.STATE_FIELDS) == sorted(OLD_STATE_FIELDS)
    assert sorted(resume.INVOCATION_FIELDS) == sorted(OLD_INVOCATION_FIELDS)
    marks = {option.metadata.get("on_resume") for option in fields.options(TrainConfig)}
    assert marks == {None, "order", "state", "invocation"}


# -- each section checks its own fields ----------------------------------------------------


def _all_wrong() -> TrainConfig:
    """A valid config whose every number is then set to -5 and its name emptied (past
    __post_init__, which would refuse them)."""
    cfg = TrainConfig()
    for option in fields.options(TrainConfig):
        if bool not in option.kinds and (int in option.kinds or float in option.kinds):
            setattr(cfg, option.name, -5)
    cfg.ddp.bucket_cap_mb = -5
    cfg.name = ""
    return cfg


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.__name__)
def test_a_section_names_only_its_own_fields(section):
    problems = list(section.own_problems(_all_wrong()))
    own = set(names(section))
    assert problems, f"{section.__name__} found nothing wrong with every number at -5"
    assert {name.split(".")[0] for name, _ in problems} <= own
    assert set(problems) <= set(_all_wrong().own_problems())  # the whole config's: every section's


def test_rules_across_sections_read_two_sections():
    cfg = TrainConfig(workers=8, global_batch_size=8, batch_size_per_worker=None)
    cfg.global_batch_size = 4  # fewer samples than workers: optimization against cluster
    assert [name for name, _ in across_sections(cfg)] == ["global_batch_size"]
    assert list(across_sections(TrainConfig())) == []


def test_a_section_can_be_checked_on_its_own():
    """A function that needs one section may take it: its fields and checks are its own."""
    optimization = OptimizationSection(lr=-1.0, epochs=2)
    optimization.fill_defaults()
    assert [name for name, _ in optimization.own_problems()] == ["lr"]
    assert list(DataSection(data_partitions=0).own_problems())[0][0] == "data_partitions"
    assert ClusterSection(workers="2:8").max_workers == 8
    storage = StorageSection(storage="~/x")
    storage.settle_storage()
    assert storage.storage.endswith("/x") and not storage.storage.startswith("~")


def test_problems_still_come_all_at_once_in_field_order():
    with pytest.raises(ConfigError) as info:
        TrainConfig(data_partitions=0, lr=math.inf, workers="x", max_failures=-2)
    assert [name for name, _ in info.value.problems] == ["data_partitions", "lr", "max_failures", "workers"]


def test_straggler_evict_steps_without_evict_stragglers_is_refused_with_both_flags_and_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"straggler_evict_steps: got 50 without --evict-stragglers, so nothing would be evicted: add "
        r"--evict-stragglers \(with --workers MIN:MAX\) .* or leave --straggler-evict-steps at its default 200",
    ):
        TrainConfig(straggler_evict_steps=50)
    TrainConfig(straggler_evict_steps=200)  # the default, given or not: nothing changes
    assert TrainConfig(workers="2:4", evict_stragglers=True, straggler_evict_steps=50).straggler_evict_steps == 50
