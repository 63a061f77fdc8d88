"""`raytrain tune`: pure tests of the search space, trial configs, sizing and ranking; CPU Ray
tests of real sweeps (`ray` mark, the shared 4-CPU Ray, which offers the `trial_driver`
resource the trial drivers run on).

The acceptance sweep of the issue (digits, --workers 1,2 × 3 rules × 2 warmups, 12 trials) is
too slow for CI on a 2-core machine; docs/tune.md records it. Here a 4-trial grid covers the
same path end to end.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from raytrain.cli import main
from raytrain.config import TrainConfig
from raytrain.errors import ConfigError
from raytrain.tune import tune
from raytrain.tune.options import SearchSpace, TuneOptions, parse_search_space
from raytrain.tune.resources import embedded_cpus, max_concurrent_trials, trial_cpus, trial_driver_resources
from raytrain.tune.results import (
    SUBSTITUTED,
    TrialRun,
    best_config,
    best_per_worker_count,
    closing_table,
    mark_stopped,
    plot_trials,
    ranked_trials,
    sweep_rows,
    tied_rules,
    write_csv,
)
from raytrain.tune.space import (
    check_trials,
    grace_period,
    grid_points,
    plan_sweep,
    resolved_run,
    sweep_base_config,
    trial_config,
    trial_name,
)
from raytrain.tune.trials import trial_error


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def held_placement_groups() -> list[str]:
    return [pg for pg, info in ray.util.placement_group_table().items() if info.get("state") != "REMOVED"]


# -- search space ------------------------------------------------------------------------------


def test_axes_parse_from_comma_lists():
    space = parse_search_space(workers="1,2,4", lr_scaling="linear,sqrt", warmup_epochs="0,1,5", lr="1e-4, 3e-4")
    assert space.workers == [1, 2, 4]
    assert space.lr_scaling == ["linear", "sqrt"]
    assert space.warmup_epochs == [0.0, 1.0, 5.0]
    assert space.lr == [1e-4, 3e-4]
    assert space.lr_range is None and space.samples == 1


def test_axes_from_yaml_lists_and_duplicates_dropped_in_order():
    space = parse_search_space(workers=[2, 1, 2], warmup_epochs=1, lr=[3e-4])
    assert space.workers == [2, 1] and space.warmup_epochs == [1.0] and space.lr == [3e-4]


def test_lr_scaling_defaults_to_all_three_rules():
    assert parse_search_space().lr_scaling == ["linear", "sqrt", "none"]


def test_lr_range_with_samples():
    space = parse_search_space(lr_range="1e-4:1e-2", samples=3)
    assert space.lr_range == (1e-4, 1e-2) and space.samples == 3 and space.lr is None


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"workers": "1,x"}, r"workers: got 'x' in '1,x'; give a comma-separated list of whole numbers"),
        ({"workers": "0,2"}, r"workers: got 0; each worker count must be a whole number of at least 1"),
        ({"workers": "1.5"}, r"workers: got '1.5' in '1.5'"),
        ({"workers": "2:8"}, r"workers: got '2:8'; a sweep compares fixed worker counts, not elastic MIN:MAX ranges"),
        ({"workers": "1,,2"}, r"workers: has an empty item in '1,,2'"),
        ({"lr_scaling": "linear,cubic"}, r"lr_scaling: got 'cubic'; choose from linear, sqrt, none"),
        ({"warmup_epochs": "0,-1"}, r"warmup_epochs: got -1.0; each warmup must be 0 or more epochs"),
        ({"lr": "1e-3,0"}, r"lr: got 0.0; each learning rate must be a positive number"),
        ({"lr": "1e-3", "lr_range": "1e-4:1e-2"}, r"lr_range: cannot be combined with --lr"),
        ({"lr_range": "1e-2:1e-4"}, r"lr_range: got 0.01:0.0001; need 0 < LO < HI"),
        ({"lr_range": "1e-4"}, r"lr_range: got '1e-4'; give LO:HI"),
        ({"samples": 4}, r"samples: got 4 without --lr-range; a grid has nothing to draw"),
        ({"lr_range": "1e-4:1e-2", "samples": 0}, r"samples: got 0; must be a whole number of at least 1"),
    ],
)
def test_bad_axes_name_the_option_value_and_fix(kwargs, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_search_space(**kwargs)


def test_every_problem_of_every_axis_in_one_error():
    with pytest.raises(ConfigError) as caught:
        parse_search_space(workers="0", lr_scaling="cubic", lr="-1")
    assert [field for field, _ in caught.value.problems] == ["workers", "lr_scaling", "lr"]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"mode": "maximum"}, r"mode: got 'maximum'; choose min"),
        ({"grace_period_epochs": 0}, r"grace_period: got 0; must be at least 1 epoch"),
        ({"reduction_factor": 1.0}, r"reduction_factor: got 1.0; must be more than 1"),
        ({"max_concurrent_trials": 0}, r"max_concurrent_trials: got 0; must be at least 1"),
        ({"target": float("nan")}, r"target: got nan"),
    ],
)
def test_bad_tune_options(kwargs, expected):
    with pytest.raises(ConfigError, match=expected):
        TuneOptions(**kwargs)


# -- trials ------------------------------------------------------------------------------------


def test_grid_is_the_product_in_a_fixed_order():
    cfg = TrainConfig(epochs=2, lr=1e-3)
    points = grid_points(parse_search_space(workers="1,2", lr_scaling="linear,sqrt,none", warmup_epochs="0,1"), cfg)
    assert len(points) == 12
    assert points[0] == {"workers": 1, "lr_scaling": "linear", "warmup_epochs": 0.0, "lr": 1e-3}
    assert points[1] == {"workers": 1, "lr_scaling": "linear", "warmup_epochs": 1.0, "lr": 1e-3}
    assert points[-1] == {"workers": 2, "lr_scaling": "none", "warmup_epochs": 1.0, "lr": 1e-3}
    assert len({tuple(p.values()) for p in points}) == 12


def test_unswept_axes_take_the_config_value_and_a_range_leaves_lr_to_tune():
    cfg = TrainConfig(workers=4, warmup_epochs=2, lr=5e-4, epochs=3)
    assert grid_points(SearchSpace(lr_scaling=["sqrt"]), cfg) == [
        {"workers": 4, "lr_scaling": "sqrt", "warmup_epochs": 2.0, "lr": 5e-4}
    ]
    ranged = grid_points(SearchSpace(lr_scaling=["sqrt"], lr_range=(1e-4, 1e-2), samples=2), cfg)
    assert ranged == [{"workers": 4, "lr_scaling": "sqrt", "warmup_epochs": 2.0}]


def test_every_trial_shares_seed_epochs_data_and_reference_batch():
    space = SearchSpace(workers=[1, 2, 4])
    base = sweep_base_config(TrainConfig(epochs=2, global_batch_size=256, seed=7), space, "digits")
    assert base.reference_batch_size == 64  # frozen once, at the largest worker count
    assert base.name.startswith("digits-tune-")
    configs = [TrainConfig.from_dict({**base.to_dict(), **point}) for point in grid_points(space, base)]
    assert {(c.seed, c.epochs, c.global_batch_size, c.reference_batch_size) for c in configs} == {(7, 2, 256, 64)}
    per_worker = sweep_base_config(TrainConfig(batch_size_per_worker=32), space, "digits")
    assert per_worker.reference_batch_size == 32


def test_a_sweep_needs_fixed_worker_counts_and_cannot_resume():
    with pytest.raises(ConfigError, match=r"workers: got '2:8'; a sweep compares fixed worker counts"):
        sweep_base_config(TrainConfig(workers="2:8"), SearchSpace(), "digits")
    with pytest.raises(ConfigError, match=r"resume: a sweep cannot resume"):
        sweep_base_config(TrainConfig(name="x", resume=True), SearchSpace(workers=[1]), "digits")


def test_trial_configs_are_checked_before_anything_starts():
    space = SearchSpace(workers=[1, 2], warmup_epochs=[0, 5])
    base = sweep_base_config(TrainConfig(epochs=2), space, "digits")
    with pytest.raises(ConfigError, match=r"warmup_epochs: got 5.0, longer than the 2 epochs of the run") as caught:
        check_trials(base, space, TuneOptions())
    assert len(caught.value.problems) == 1  # the same problem of 2 worker counts, said once
    with pytest.raises(ConfigError, match=r"grace_period: got 3 epochs, longer than the 2 epochs of each trial"):
        check_trials(base, SearchSpace(workers=[1]), TuneOptions(grace_period_epochs=3))
    check_trials(base, SearchSpace(workers=[1]), TuneOptions(grace_period_epochs=3, early_stop=False))
    steps_only = sweep_base_config(TrainConfig(max_steps=300), SearchSpace(workers=[1]), "digits")
    with pytest.raises(ConfigError, match=r"max_steps: got 300 without --epochs: a sweep compares its trials at epoch"):
        check_trials(steps_only, SearchSpace(workers=[1]), TuneOptions())


@pytest.mark.parametrize(
    "warmups, epochs, given, expected",
    [
        ([0.0], 5, None, 1),
        ([0.0, 1.0], 5, None, 2),  # judged one epoch after the longest warmup
        ([0.5], 5, None, 2),
        ([0.0, 5.0], 3, None, 3),  # at most the run: then nothing is stopped before its end
        ([0.0, 5.0], 8, 1, 1),  # as given
    ],
)
def test_grace_period_waits_for_the_longest_warmup(warmups, epochs, given, expected):
    points = [{"workers": 1, "lr_scaling": "linear", "warmup_epochs": w, "lr": 1e-3} for w in warmups]
    assert grace_period(TuneOptions(grace_period_epochs=given), points, epochs) == expected


def test_trial_names_are_valid_run_names():
    name = trial_name(3, {"workers": 2, "lr_scaling": "sqrt", "warmup_epochs": 1.0, "lr": 3e-4})
    assert name == "03-w2-sqrt-wu1-lr3.0e-4"
    TrainConfig(name=name)


# -- equivalent points: one run --------------------------------------------------------------


def _plan(cfg: TrainConfig, **axes):
    space = parse_search_space(**axes)
    base = sweep_base_config(cfg, space, "digits")
    points = grid_points(space, base)
    return base, points, plan_sweep(base, points)


def test_at_the_reference_batch_the_three_rules_are_one_run():
    # 1 worker × 32 per worker = the reference batch: lr × f(1) is lr for every rule.
    base, points, runs = _plan(
        TrainConfig(epochs=2, batch_size_per_worker=32, lr=1e-3), workers="1,2", warmup_epochs="0,1"
    )
    assert len(points) == 12 and len(runs) == 8  # 2 shared runs at 1 worker, 6 distinct at 2
    one = [run for run in runs if run.point["workers"] == 1]
    assert [run.rule_names for run in one] == ["linear=sqrt=none", "linear=sqrt=none"]
    assert [[p["warmup_epochs"] for p in run.points] for run in one] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert [run.name for run in one] == ["00-w1-linear-wu0-lr1.0e-3", "01-w1-linear-wu1-lr1.0e-3"]
    assert all(not run.shared and len(run.points) == 1 for run in runs if run.point["workers"] == 2)
    assert [run.index for run in runs] == list(range(8))  # Tune's trial numbers
    assert sorted(p["lr_scaling"] for run in runs for p in run.points) == sorted(p["lr_scaling"] for p in points)


def test_at_two_workers_linear_and_sqrt_differ():
    base, _, _ = _plan(TrainConfig(epochs=2, batch_size_per_worker=32, lr=1e-3), workers="1,2")
    two = {
        rule: trial_config(base, {"workers": 2, "lr_scaling": rule, "warmup_epochs": 0.0, "lr": 1e-3})
        for rule in ("linear", "sqrt", "none")
    }
    assert len({resolved_run(c) for c in two.values()}) == 3  # peaks 2e-3, 1.4e-3, 1e-3
    one = {
        rule: trial_config(base, {"workers": 1, "lr_scaling": rule, "warmup_epochs": 0.0, "lr": 1e-3})
        for rule in ("linear", "sqrt", "none")
    }
    assert len({resolved_run(c) for c in one.values()}) == 1


def test_equivalence_is_by_the_resolved_rate_not_the_worker_count():
    # A fixed global batch of 64 frozen against a reference of 32 (the per-worker batch at 2):
    # the ratio is 2 at every count, so no rule coincides, not even at 1 worker.
    _, points, runs = _plan(TrainConfig(epochs=2, global_batch_size=64, lr=1e-3), workers="1,2")
    assert len(runs) == len(points) == 6
    # A reference equal to the global batch: ratio 1 at every count, one run per count.
    _, points, runs = _plan(
        TrainConfig(epochs=2, global_batch_size=64, reference_batch_size=64, lr=1e-3), workers="1,2"
    )
    assert [(run.point["workers"], run.rule_names) for run in runs] == [
        (1, "linear=sqrt=none"),
        (2, "linear=sqrt=none"),
    ]


def test_different_base_rates_warmups_or_drawn_rates_never_share():
    _, _, runs = _plan(
        TrainConfig(epochs=2, batch_size_per_worker=32), workers="1", lr="1e-3,3e-3", warmup_epochs="0,1"
    )
    assert len(runs) == 4 and all(run.rule_names == "linear=sqrt=none" for run in runs)
    _, points, runs = _plan(
        TrainConfig(epochs=2, batch_size_per_worker=32), workers="1", lr_range="1e-4:1e-2", samples=2
    )
    assert len(runs) == len(points) == 3  # Tune draws each trial's rate: nothing to share


# -- resources -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "workers, cpus_per_worker, cpus, requested, expected",
    [
        ([1, 2], 1.0, 4, None, 2),  # sized by the largest trial
        ([1], 1.0, 4, None, 4),
        ([1, 2, 4, 8], 1.0, 16, None, 2),
        ([1, 2], 1.0, 4, 1, 1),  # a lower request is kept
        ([1, 2], 1.0, 4, 8, 2),  # a higher one is capped: more would wait for CPUs
        ([8], 0.5, 4, None, 1),
        ([2], 1.0, 3, None, 1),
    ],
)
def test_max_concurrent_trials_fit_the_cpus(workers, cpus_per_worker, cpus, requested, expected):
    assert (
        max_concurrent_trials(workers, cpus_per_worker=cpus_per_worker, cluster_cpus=cpus, requested=requested)
        == expected
    )


def test_a_trial_that_can_never_fit_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"workers: got 8 in 1,8: a trial of 8 workers × 1 CPU needs 8 CPUs, but the cluster has 4; drop worker "
        r"counts above 4",
    ):
        max_concurrent_trials([1, 8], cpus_per_worker=1.0, cluster_cpus=4)
    with pytest.raises(
        ConfigError, match=r"needs 4 CPUs, but the cluster has 3; drop worker counts above 1 .*lower --cpus-per-worker"
    ):
        max_concurrent_trials([2], cpus_per_worker=2.0, cluster_cpus=3)


def test_gpu_trials_are_sized_by_gpus():
    assert max_concurrent_trials([1, 2], cpus_per_worker=1.0, cluster_cpus=64, use_gpu=True, cluster_gpus=8) == 4
    with pytest.raises(ConfigError, match=r"a trial of 8 GPU workers needs 8 GPUs, but the cluster has 4"):
        max_concurrent_trials([8], cpus_per_worker=1.0, cluster_cpus=64, use_gpu=True, cluster_gpus=4)


@pytest.mark.parametrize(
    "trial_cpus, cores, expected",
    [(2, 2, 4), (1, 2, 3), (8, 2, 4), (2, 16, 16), (64, 16, 32), (1, 1, 2)],
)
def test_embedded_ray_oversubscribes_a_small_machine_at_most_twice(trial_cpus, cores, expected):
    assert embedded_cpus(trial_cpus, cores) == expected


def test_a_trial_needs_its_workers_cpus():
    assert trial_cpus(2, 1.0) == 2.0 and trial_cpus(8, 0.5) == 4.0
    assert max_concurrent_trials([1, 2], cpus_per_worker=0.5, cluster_cpus=4) == 4


def test_trial_drivers_take_no_cpu():
    assert trial_driver_resources({"CPU": 4, "trial_driver": 1000}) == {"CPU": 0, "trial_driver": 1}
    fallback = trial_driver_resources({"CPU": 4, "memory": 8e9})
    assert fallback["CPU"] == 0 and fallback["memory"] > 0


# -- ranking and outputs -----------------------------------------------------------------------


def _row(workers, rule, warmup, final, status="finished", to_target=None):
    return {
        "workers": workers,
        "lr_scaling": rule,
        "warmup_epochs": warmup,
        "lr": 1e-3,
        "final_val_loss": final,
        "status": status,
        "epochs_to_target": to_target,
    }


def test_best_per_worker_count_by_final_metric_among_finished_trials():
    rows = [
        _row(1, "linear", 0, 0.30),
        _row(1, "sqrt", 1, 0.20),
        _row(1, "none", 0, 0.10, status="stopped"),
        _row(2, "linear", 1, 0.25),
        _row(2, "none", 0, 0.35),
        _row(4, "sqrt", 0, 0.5, status="failed"),
    ]
    best = best_per_worker_count(rows, TuneOptions())
    assert [(k, v["lr_scaling"]) for k, v in best.items()] == [(1, "sqrt"), (2, "linear")]
    assert [r["final_val_loss"] for r in ranked_trials(rows, TuneOptions(mode="max"))] == [0.35, 0.30, 0.25, 0.20]


def test_with_a_target_the_fewest_epochs_to_reach_it_wins():
    rows = [_row(2, "linear", 0, 0.10, to_target=3), _row(2, "sqrt", 1, 0.15, to_target=2), _row(2, "none", 0, 0.05)]
    assert best_per_worker_count(rows, TuneOptions(target=0.2))[2]["lr_scaling"] == "sqrt"
    assert best_per_worker_count(rows, TuneOptions())[2]["lr_scaling"] == "none"


def test_rules_that_coincide_are_shown_together():
    # Which rules coincide comes from the sweep's plan (the rows' `same_run`), not from equal metrics.
    shared = {"same_run": "linear=sqrt=none"}
    rows = [
        {**_row(1, "linear", 1, 0.2), **shared},
        {**_row(1, "sqrt", 1, 0.2), **shared},
        {**_row(1, "none", 1, 0.2), **shared},
        _row(1, "none", 0, 0.2),
        _row(2, "sqrt", 1, 0.2),
    ]
    assert tied_rules(rows[0]) == "linear=sqrt=none"
    assert tied_rules(rows[4]) == "sqrt"
    assert tied_rules(rows[1]) == "sqrt=linear=none"  # the row's own rule first


@pytest.mark.parametrize("written_by_fit", [False, True])
def test_a_stopped_trials_summary_says_so(tmp_path, written_by_fit):
    row = {
        "epoch": 1,
        "step": 45,
        "samples_seen": 1438,
        "world_size": 1,
        "loss": 2.0,
        "val_loss": 2.5,
        "epoch_end": True,
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    if written_by_fit:  # fit saw its controller die
        (tmp_path / "summary.json").write_text(
            json.dumps({"status": "failed", "epochs": 1, "error": "The actor died unexpectedly"})
        )
    mark_stopped(tmp_path, 1, started=100.0, ended=160.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stopped_by"] == "ASHA" and summary["stopped_after_epoch"] == 1
    assert "error" not in summary and summary["epochs"] == 1


def _epoch(epoch, val_loss, time_s):
    return {
        "epoch": epoch,
        "step": 45 * epoch,
        "samples_seen": 1438 * epoch,
        "world_size": 1,
        "global_batch_size": 32,
        "lr": 1e-3,
        "loss": 1.0,
        "val_loss": val_loss,
        "val_accuracy": 0.9,
        "time_s": time_s,
        "time_total_s": 99.0,
    }


def _run_dir(sweep_dir: Path, name: str, plan_time: float = 1000.0, rows=()) -> Path:
    run_dir = sweep_dir / "trials" / name
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(
        json.dumps({"kind": "plan", "message": "global 32 = 1 worker", "time": plan_time}) + "\n"
    )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({**r, "epoch_end": True}) + "\n" for r in rows))
    return run_dir


def test_results_come_from_what_tune_received_and_shared_runs_give_every_rule_a_row(tmp_path):
    base, points, runs = _plan(
        TrainConfig(epochs=2, batch_size_per_worker=32, lr=1e-3), workers="1,2", lr_scaling="linear,sqrt"
    )
    assert [run.name for run in runs] == [
        "00-w1-linear-wu1-lr1.0e-3",
        "01-w2-linear-wu1-lr1.0e-3",
        "02-w2-sqrt-wu1-lr1.0e-3",
    ]
    shared_dir = _run_dir(
        tmp_path, runs[0].name, rows=[_epoch(1, 9.0, 0), _epoch(2, 9.0, 0)]
    )  # not read: Tune has the rows
    _run_dir(tmp_path, runs[1].name)
    _run_dir(tmp_path, runs[2].name, rows=[_epoch(1, 0.8, 1003.0)])
    # The stopped trial's epoch 1 reached the target at its report; the shared run redid epoch 2 after a restart.
    trials = [
        TrialRun(
            name=runs[0].name,
            point=runs[0].point,
            status="finished",
            started=990.0,
            ended=1030.0,
            reported=[_epoch(1, 0.5, 1004.0), _epoch(2, 0.6, 1006.0), _epoch(2, 0.3, 1007.5)],
        ),
        TrialRun(
            name=runs[1].name, point=runs[1].point, status="failed", error="The run failed: rank 0 raised OSError"
        ),
        TrialRun(
            name=runs[2].name,
            point=runs[2].point,
            status="stopped",
            started=990.0,
            ended=1010.0,
            reported=[{**_epoch(1, float(sys.float_info.max), 1003.0), SUBSTITUTED: "val_loss"}],
        ),
    ]
    rows, curves = sweep_rows(trials, runs, points, TuneOptions(target=0.4), tmp_path, 2)
    assert [(r["workers"], r["lr_scaling"], r["trial"]) for r in rows] == [
        (1, "linear", runs[0].name),
        (1, "sqrt", runs[0].name),
        (2, "linear", runs[1].name),
        (2, "sqrt", runs[2].name),
    ]  # one row per grid point, in grid order
    linear, sqrt, failed, stopped = rows
    assert linear["same_run"] == sqrt["same_run"] == "linear=sqrt" and failed["same_run"] == ""
    assert {k: v for k, v in linear.items() if k != "lr_scaling"} == {
        k: v for k, v in sqrt.items() if k != "lr_scaling"
    }
    assert linear["final_val_loss"] == 0.3 and linear["best_val_loss"] == 0.3 and linear["best_epoch"] == 2
    assert linear["epochs_to_target"] == 2 and linear["time_to_target_s"] == 7.5  # from the plan event at 1000.0
    assert linear["wall_time_s"] == 40.0 and "time_total_s" not in linear
    assert failed["status"] == "failed" and failed["error"].startswith("The run failed") and failed["epochs"] == 0
    assert (
        stopped["final_val_loss"] is None and stopped["epochs"] == 1
    )  # the stand-in Tune got for a NaN is not a result
    assert curves[runs[0].name] == [(1, 0.5), (2, 0.3)] and curves[runs[2].name] == []
    summary = json.loads((tmp_path / "trials" / runs[2].name / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stopped_after_epoch"] == 1
    assert not (shared_dir / "summary.json").exists()

    table = "\n".join(
        closing_table(rows, best_per_worker_count(rows, TuneOptions()), linear, TuneOptions(), 60.0, tmp_path, None)
    )
    assert "linear=sqrt" in table and "4 trials (3 runs" in table


def test_a_trial_that_reported_nothing_is_read_from_its_run_directory(tmp_path):
    base, points, runs = _plan(
        TrainConfig(epochs=2, batch_size_per_worker=32, lr=1e-3), workers="2", lr_scaling="linear"
    )
    _run_dir(tmp_path, runs[0].name, rows=[_epoch(1, 0.7, 1002.0)])
    trial = TrialRun(name=runs[0].name, point=runs[0].point, status="failed", error="boom")
    rows, curves = sweep_rows([trial], runs, points, TuneOptions(), tmp_path, 2)
    assert rows[0]["final_val_loss"] == 0.7 and rows[0]["epochs"] == 1 and curves[runs[0].name] == [(1, 0.7)]


def test_a_failed_trials_error_is_its_exceptions_first_line():
    from raytrain.errors import RunFailed

    class Wrapped(Exception):  # as Ray wraps a trial's exception
        def __init__(self, cause):
            super().__init__(f"ray.exceptions.RayTaskError: Traceback ...\n{cause!r}")
            self.cause = cause

    class Trial:
        error_file = "/tmp/tune/00/error.txt"

        def __init__(self, error):
            self.error = error

        def get_pickled_error(self):
            return self.error

    failed = RunFailed("The run failed: rank 1 raised ValueError: bad shape in model.py:12\n  more\nRun files: /x")
    assert trial_error(Trial(Wrapped(failed))) == "The run failed: rank 1 raised ValueError: bad shape in model.py:12"
    assert (
        trial_error(Trial(Wrapped(FloatingPointError("The training loss became NaN\nat step 3"))))
        == "FloatingPointError: The training loss became NaN"
    )
    assert trial_error(Trial(None)) == "failed (Tune's error file: /tmp/tune/00/error.txt)"


def test_trials_csv_leads_with_the_swept_values_then_the_metrics(tmp_path):
    failed = {
        "trial": "00",
        "workers": 1,
        "lr_scaling": "none",
        "warmup_epochs": 0.0,
        "lr": 0.1,
        "final_val_loss": None,
        "best_val_loss": None,
        "status": "failed",
        "best_epoch": None,
        "error": "boom",
    }
    done = {
        **failed,
        "trial": "01",
        "final_val_accuracy": 0.9,
        "final_val_loss": 0.2,
        "best_val_accuracy": 0.9,
        "best_val_loss": 0.2,
        "status": "finished",
        "best_epoch": 2,
        "error": "",
    }
    write_csv(tmp_path / "t.csv", [failed, done])
    rows = read_csv(tmp_path / "t.csv")
    assert list(rows[0]) == [
        "trial",
        "workers",
        "lr_scaling",
        "warmup_epochs",
        "lr",
        "final_val_accuracy",
        "final_val_loss",
        "best_val_accuracy",
        "best_val_loss",
        "status",
        "best_epoch",
        "error",
    ]
    assert rows[0]["final_val_loss"] == "" and rows[1]["final_val_loss"] == "0.2"


def test_plot_has_a_panel_per_worker_count(tmp_path):
    rows = []
    for i, (workers, status, losses) in enumerate(
        [(1, "finished", [0.5, 0.3]), (2, "stopped", [0.9]), (2, "failed", [])]
    ):
        run_dir = tmp_path / f"t{i}"
        run_dir.mkdir()
        lines = [
            json.dumps({"epoch": e + 1, "step": 10 * (e + 1), "val_loss": v, "epoch_end": True})
            for e, v in enumerate(losses)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
        rows.append(
            {
                **_row(workers, "linear", 0.0, losses[-1] if losses else None, status=status),
                "epochs": len(losses),
                "run_dir": str(run_dir),
            }
        )
    plot_trials(tmp_path / "trials.png", rows, 2, TuneOptions(target=0.4))
    assert (tmp_path / "trials.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_best_config_trains_without_name_or_resume():
    base = TrainConfig(epochs=2, name="sweep", storage="/tmp/x", reference_batch_size=32)
    values = best_config("digits", base, {"workers": 2, "lr_scaling": "sqrt", "warmup_epochs": 1.0, "lr": 3e-4})
    assert list(values)[0] == "pipeline" and values["pipeline"] == "digits"
    assert "name" not in values and "resume" not in values
    assert (values["workers"], values["lr_scaling"], values["warmup_epochs"], values["lr"]) == (2, "sqrt", 1.0, 3e-4)
    assert values["reference_batch_size"] == 32
    TrainConfig.from_dict({k: v for k, v in values.items() if k != "pipeline"})


# -- command line, no Ray ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--workers", "1,x"], "--workers: got 'x' in '1,x'"),
        (["--lr-scaling", "cubic"], "--lr-scaling: got 'cubic'; choose from linear, sqrt, none"),
        (["--lr", "1e-3", "--lr-range", "1e-4:1e-2"], "--lr-range: cannot be combined with --lr"),
        (["--warmup-epochs", "0,9", "--epochs", "2"], "--warmup-epochs: got 9.0, longer than the 2 epochs"),
        (["--mode", "best"], "--mode: got 'best'; choose min"),
        (["--resume", "--name", "x"], "unrecognized arguments: --resume"),
        (["--workers", "1,1000"], "needs 1000 CPUs"),
    ],
)
def test_tune_usage_errors_exit_2_with_one_message(capsys, tmp_path, args, expected):
    code, out, err = cli(capsys, "tune", "digits", "--storage", str(tmp_path), *args)
    assert code == 2, (out, err)
    assert expected in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_tune_help_lists_the_axes(capsys):
    code, out, _ = cli(capsys, "tune", "--help")
    assert code == 0
    for flag in (
        "--workers",
        "--lr-scaling",
        "--warmup-epochs",
        "--lr-range",
        "--samples",
        "--metric",
        "--mode",
        "--no-early-stop",
        "--grace-period",
        "--target",
        "--max-concurrent-trials",
        "--epochs",
        "--seed",
    ):
        assert flag in out, flag


# -- CPU Ray: real sweeps ----------------------------------------------------------------------


@pytest.mark.ray
def test_sweep_writes_trials_csv_best_yaml_and_plot_and_best_yaml_trains(ray_session, capsys, tmp_path):
    held_before = set(held_placement_groups())
    started = time.time()
    code, out, err = cli(
        capsys,
        "tune",
        "digits",
        "--workers",
        "1,2",
        "--lr-scaling",
        "linear,none",
        "--warmup-epochs",
        "0",
        "--epochs",
        "2",
        "--target",
        "0.5",
        "--storage",
        str(tmp_path),
        "--name",
        "sweep",
    )
    sweep_seconds = time.time() - started
    assert code == 0, err
    sweep = tmp_path / "sweep"
    rows = read_csv(sweep / "trials.csv")
    assert len(rows) == 4
    assert list(rows[0])[:5] == ["trial", "workers", "lr_scaling", "warmup_epochs", "lr"]
    for key in (
        "final_val_loss",
        "best_val_loss",
        "final_val_accuracy",
        "best_val_accuracy",
        "status",
        "time_to_target_s",
        "epochs_to_target",
        "wall_time_s",
    ):
        assert key in rows[0], key
    assert {(r["workers"], r["lr_scaling"]) for r in rows} == {
        ("1", "linear"),
        ("1", "none"),
        ("2", "linear"),
        ("2", "none"),
    }
    assert all(r["status"] in ("finished", "stopped") for r in rows), rows
    finished = [r for r in rows if r["status"] == "finished"]
    assert {r["workers"] for r in finished} == {"1", "2"}  # ASHA never stops the first trial of a count
    assert all(r["epochs"] == "2" and float(r["final_val_loss"]) < 1.0 for r in finished)

    # Fair comparison: every trial ran with the same seed, epochs, batch rule and reference batch.
    configs = [yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text()) for r in rows]
    assert len({(c["seed"], c["epochs"], c["batch_size_per_worker"], c["reference_batch_size"]) for c in configs}) == 1

    assert (sweep / "trials.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = yaml.safe_load((sweep / "best.yaml").read_text())
    assert best["pipeline"] == "digits" and "name" not in best and "resume" not in best
    assert "Best per worker count" in out and "train it: raytrain train --config" in out
    table = out[out.index("Best per worker count") :].splitlines()
    assert any(line.split()[:1] == ["1"] for line in table) and any(line.split()[:1] == ["2"] for line in table)
    assert set(held_placement_groups()) <= held_before  # no trial left its workers' placement group behind
    print(f"\n4-trial sweep: {sweep_seconds:.0f} s")

    code, out, err = cli(capsys, "train", "--config", str(sweep / "best.yaml"), "--epochs", "1", "--name", "from-best")
    assert code == 0, err
    summary = json.loads((tmp_path / "from-best" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["world_sizes"] == [int(best["workers"])]


@pytest.mark.ray
def test_asha_stops_a_diverging_trial_early(ray_session, make_config):
    held_before = set(held_placement_groups())
    from rt_test_pipelines import SlowDigitsPipeline

    # One trial at a time, the good lr first: the bad one meets a recorded result at epoch 1.
    # ASHA's stop reaches a trial a moment after its report; a pause per step (≈ 2 s an
    # epoch) keeps the bad trial from finishing its 4 epochs (a last epoch is never stopped)
    # in that moment on a quiet machine.
    result = tune(
        SlowDigitsPipeline(step_sleep_s=0.04),
        make_config(epochs=4, name="asha"),
        SearchSpace(workers=[1], lr_scaling=["none"], warmup_epochs=[0], lr=[1e-3, 10.0]),
        TuneOptions(max_concurrent_trials=1),
    )
    good, bad = sorted(result.trials, key=lambda r: r["lr"])
    assert good["status"] == "finished" and good["epochs"] == 4
    assert bad["status"] == "stopped" and bad["epochs"] < good["epochs"]
    # It really ended: its run trained fewer epochs, and says why.
    trained = [json.loads(line) for line in (Path(bad["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert max(r["epoch"] for r in trained if r.get("epoch_end")) < 4
    summary = json.loads((Path(bad["run_dir"]) / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stopped_by"] == "ASHA"
    # Nothing is held after the sweep. Train's own cleaner usually frees the stopped trial's
    # worker group; on a loaded machine it can take longer than the sweep waits
    # (PG_CLEANUP_WAIT_S), and then the sweep removes that one group itself (and says so).
    assert result.leaked_placement_groups <= 1 and set(held_placement_groups()) <= held_before
    assert result.best["lr"] == 1e-3


@pytest.mark.ray
def test_a_worker_count_that_cannot_fit_fails_fast(ray_session, capsys, tmp_path):
    started = time.time()
    code, out, err = cli(capsys, "tune", "digits", "--workers", "1,8", "--storage", str(tmp_path), "--name", "big")
    assert code == 2
    assert err.strip() == (
        "raytrain tune: Invalid configuration: --workers: got 8 in 1,8: a trial of 8 workers × 1 CPU needs 8 CPUs, "
        "but the cluster has 4; drop worker counts above 4 from --workers, lower --cpus-per-worker, or run on a "
        "bigger cluster (--address)"
    )
    assert time.time() - started < 30
    assert not (tmp_path / "big").exists()


def test_trials_csv_gives_each_trials_goodput(tmp_path):
    from raytrain.tune.results import trial_results

    run_dir = tmp_path / "trial"
    run_dir.mkdir()
    rows = [{"epoch": 1, "val_loss": 0.5, "time_s": 1.0}]
    assert trial_results(rows, run_dir, TuneOptions())["goodput"] is None  # no summary.json
    summary = {"status": "finished", "goodput": {"goodput": 0.731, "wall_s": 10.0}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert trial_results(rows, run_dir, TuneOptions())["goodput"] == 0.731
