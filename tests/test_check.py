"""`raytrain check`, pure tier: the tolerance, the verdict and its table, the probes that name
a cause (on the pitfall pipelines of tests/check_pipelines.py, in this process), the
BatchNorm conversion of --sync-batchnorm, and bad usage refused before Ray starts."""

from __future__ import annotations

import math
import types

import pytest
import torch
from check_pipelines import (
    Clean,
    NoisyLoss,
    RankAware,
    StatefulLoss,
    SummedLoss,
    WithBatchNorm,
    WithDropout,
)

from pipelines.digits.pipeline import load_arrays
from raytrain.check import probes
from raytrain.check.driver import report_lines
from raytrain.check.verdict import (
    NO_CAUSE,
    TOLERANCE,
    Replicas,
    StepRecord,
    Verdict,
    compare,
    horizon_of,
    relative_difference,
    table_rows,
    tolerance_for,
)
from raytrain.check.worker import Outcome, replica_fingerprints
from raytrain.cli import main
from raytrain.config import TrainConfig
from raytrain.instruments.agreement import fingerprint, held_tensors
from raytrain.rules import agreement

# -- the verdict -----------------------------------------------------------------------------


def records(losses, norms=None):
    return [StepRecord(loss, norm) for loss, norm in zip(losses, norms or [1.0] * len(losses))]


def test_relative_difference_is_symmetric_and_names_a_lone_non_finite_value():
    assert relative_difference(2.0, 2.0) == 0.0
    assert relative_difference(1.0, 1.1) == pytest.approx(relative_difference(1.1, 1.0)) == pytest.approx(0.1 / 1.1)
    assert relative_difference(1.0, math.nan) == math.inf
    assert relative_difference(0.0, 1e-30) == 1.0


def test_runs_within_the_tolerance_are_equivalent_and_exit_0():
    reference = records([2.3, 2.2, 2.1])
    run = records([2.3 * (1 + 3e-7), 2.2, 2.1 * (1 - 2e-7)])
    verdict = Verdict(compare(reference, run, TOLERANCE["fp32"], workers=2))
    assert verdict.comparison.equivalent and verdict.exit_status == 0
    assert verdict.comparison.largest.step == 1
    assert verdict.lines()[0].startswith("Equivalent: 2 workers train like 1 over 3 steps")


def test_the_first_step_beyond_the_tolerance_is_where_the_runs_part_and_exit_1():
    reference = records([2.3, 2.2, 2.1, 2.0], norms=[1.0, 1.0, 1.0, 1.0])
    run = records([2.3, 2.2, 2.1, 2.0], norms=[1.0, 1.0 + 1e-4, 1.5, 1.0])  # the gradient norm parts first
    verdict = Verdict(compare(reference, run, TOLERANCE["fp32"], workers=4))
    assert verdict.comparison.first_difference == 2
    assert verdict.comparison.largest.step == 3
    assert verdict.exit_status == 1
    assert verdict.lines()[0].startswith("Differs from step 2: relative difference 1.0e-04 there")
    header, rows = table_rows(verdict.comparison)
    assert header[1:3] == ["loss 1 worker", "loss 4 workers"]
    assert [row[-1].strip() for row in rows] == ["", "<- differs", "<- differs", ""]


def test_steps_from_the_horizon_on_are_shown_but_not_judged():
    reference = records([2.3, 2.2, 2.1, 2.0, 1.9])
    # The 1-worker run against itself, rows reordered: rounding until step 3, then it departs.
    reordered = records([2.3, 2.2 * (1 + 1e-7), 2.1, 2.0 * (1 + 1e-3), 1.9 * (1 + 1e-2)])
    horizon = horizon_of(reference, reordered, 1e-5)
    assert horizon == 4
    late = records([2.3, 2.2, 2.1, 2.0 * (1 + 5e-4), 1.9 * (1 - 3e-3)])
    verdict = Verdict(compare(reference, late, 1e-5, workers=2, horizon=horizon))
    assert verdict.comparison.equivalent and verdict.exit_status == 0
    assert verdict.lines()[0].startswith("Equivalent: 2 workers train like 1 over 3 steps")
    assert verdict.lines()[1].startswith("Steps 4–5 are shown, not judged: from step 4 the 1-worker run itself departs")
    _, rows = table_rows(verdict.comparison, reordered)
    assert [row[-1].strip() for row in rows] == ["", "", "", "not judged", "not judged"]
    assert rows[3][-2] == "1.0e-03"  # the 1-worker run against itself
    # A gap before the horizon is judged as ever.
    early = records([2.3, 2.2 * (1 + 1e-3), 2.1, 2.0, 1.9])
    assert compare(reference, early, 1e-5, workers=2, horizon=horizon).first_difference == 2


def test_step_1_is_always_judged_even_when_the_run_does_not_agree_with_itself():
    # Randomness in the loss: the 1-worker run differs from itself at step 1 already.
    reference, reordered = records([2.3, 2.2]), records([2.4, 2.1])
    assert horizon_of(reference, reordered, 1e-5) == 2
    assert compare(reference, records([2.35, 2.2]), 1e-5, workers=2, horizon=2).first_difference == 1


def test_without_a_cause_the_verdict_says_where_to_look():
    verdict = Verdict(compare(records([1.0, 1.0]), records([1.0, 1.1]), 1e-5, workers=2))
    assert verdict.lines()[-1].startswith("No probed cause found (BatchNorm, randomness")


def test_the_tolerance_follows_the_precision_unless_given():
    assert tolerance_for("fp32") == 1e-5
    assert tolerance_for("bf16") == tolerance_for("fp16") == 1e-2
    assert tolerance_for("bf16", 0.05) == 0.05


# -- the replicas' fingerprints --------------------------------------------------------------

A, B, C = 0x3F2A9C1E0B7D4C21, 0x1A2B3C4D5E6F7081, 0x0123456789ABCDEF


def test_replicas_that_agree_after_every_step_are_said_to_agree_with_their_fingerprint():
    reference = records([2.3, 2.2, 2.1])
    replicas = Replicas(2, 1, ((C, C), (B, B), (A, A)))
    verdict = Verdict(compare(reference, reference, 1e-5, workers=2), replicas=replicas)
    assert verdict.equivalent and verdict.exit_status == 0
    lines = verdict.lines()
    assert lines[0].startswith("Equivalent: 2 workers train like 1 over 3 steps")
    assert lines[1] == (
        "Replicas agree: the 2 workers' weights and optimizer state had the same fingerprint after every compared "
        "step (steps 1–3; after step 3: 3f2a9c1e0b7d4c21)."
    )
    header, rows = table_rows(verdict.comparison, replicas=replicas)
    assert header[-2] == "replica fingerprint"
    assert [row[-2] for row in rows] == ["01234567", "1a2b3c4d", "3f2a9c1e"]


def test_a_replica_that_differs_fails_the_check_naming_the_first_step_and_the_rank():
    reference = records([2.3, 2.2, 2.1])
    replicas = Replicas(4, 1, ((C, C, C, C), (B, B, B, B), (A, A, B, A)))  # rank 2 parts after step 3
    verdict = Verdict(compare(reference, reference, 1e-5, workers=4), replicas=replicas)
    assert verdict.comparison.equivalent and not verdict.equivalent and verdict.exit_status == 1
    lines = verdict.lines()
    assert lines[0].startswith(
        "Not equivalent: the 4 workers' replicas differ from step 3, though their loss and gradient norm agree "
        "with 1 worker's over 3 steps"
    )
    assert lines[1] == (
        "Replicas differ from step 3: rank 2 (1a2b3c4d5e6f7081) differs from the other replicas' 3f2a9c1e0b7d4c21 "
        "(after 1 of the 3 steps)."
    )
    assert lines[2].startswith(
        "Cause: the replicas' weights or optimizer state differ. After step 3 the weights and optimizer state of "
        "rank 2 no longer have the other replicas' fingerprint."
    )
    assert lines[3].startswith("  Fix: look for a change to the weights or the optimizer state that depends on")
    assert "rank 2 may be faulty" in lines[3]
    assert NO_CAUSE not in lines  # the replicas are the cause named
    _, rows = table_rows(verdict.comparison, replicas=replicas)
    assert [row[-2] for row in rows] == ["01234567", "1a2b3c4d", "rank 2 differs"]


def test_two_replicas_that_differ_are_both_named_beside_a_loss_that_differs():
    replicas = Replicas(2, 1, ((A, A), (A, B)))
    verdict = Verdict(compare(records([1.0, 1.0]), records([1.0, 1.1]), 1e-5, workers=2), replicas=replicas)
    lines = verdict.lines()
    assert lines[0].startswith("Differs from step 2")
    assert lines[1].startswith(
        "Replicas differ from step 2: rank 0 (3f2a9c1e0b7d4c21), rank 1 (1a2b3c4d5e6f7081) differ, and with two "
        "replicas there is no majority to say which is wrong"
    )
    assert "no longer have a common fingerprint (ranks 0, 1)" in lines[2]
    assert "ranks 0, 1 may be faulty" in lines[-1]
    assert table_rows(verdict.comparison, replicas=replicas)[1][1][-2] == "ranks 0, 1 differ"


def test_one_sharded_copy_has_no_replicas_to_compare():
    replicas = Replicas(2, 2)  # --strategy fsdp: nothing fingerprinted
    verdict = Verdict(compare(records([1.0]), records([1.0]), 1e-5, workers=2), replicas=replicas)
    assert verdict.equivalent
    assert verdict.lines()[1] == (
        "Replicas: one sharded copy: no replicas to compare (each of the 2 workers holds a distinct shard of the "
        "weights and optimizer state)."
    )
    header, _ = table_rows(verdict.comparison, replicas=replicas)
    assert "replica fingerprint" not in header


def test_the_report_shows_the_replicas_in_the_table_and_the_verdict():
    reference = records([2.3, 2.2])
    outcome = Outcome(reference, reference, reference, replicas=Replicas(2, 1, ((B, B), (A, A))))
    verdict = Verdict(compare(reference, reference, 1e-5, workers=2), replicas=outcome.replicas)
    lines = report_lines(outcome, verdict)
    assert lines[2].startswith("replica fingerprint: the first 8 hex digits")
    assert lines[3].split()[-2:] == ["replica", "fingerprint"]
    assert lines[4].split()[-1] == "1a2b3c4d" and lines[5].split()[-1] == "3f2a9c1e"
    assert lines[-1].startswith("Replicas agree: the 2 workers' weights and optimizer state")


def test_the_fingerprints_of_every_rank_travel_in_one_sum(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    mine = fingerprint(held_tensors(model, optimizer))

    class TwoRanks:  # rank 0 of 2; rank 1 holds the same but one bit
        world_rank, world_size = 0, 2

        def all_reduce_sum(self, values):
            other = agreement.to_slots(mine ^ 1, 1, 2) + agreement.to_slots(0, 1, 2)  # its host slots after
            return [a + b for a, b in zip(values, other, strict=True)]

    runner = types.SimpleNamespace(runtime=TwoRanks(), model=model, optimizer=optimizer)
    prints = replica_fingerprints(runner)
    assert prints == (mine % (1 << 64), (mine ^ 1) % (1 << 64))
    assert agreement.odd_ranks(list(prints), 1) == [0, 1]


# -- the probes, on one batch of digits in this process -------------------------------------


@pytest.fixture(scope="module")
def digits_batch():
    images, labels = load_arrays()
    return {"image": torch.from_numpy(images[:64]), "label": torch.from_numpy(labels[:64])}


def subject(pipeline, batch):
    torch.manual_seed(0)
    model = pipeline.build_model(TrainConfig(workers=2, global_batch_size=64))
    model.train()
    probes.dropout_to_eval(model)
    return probes.Subject(pipeline, model, batch)


def causes_of(pipeline, batch, workers=2):
    return [cause.name for cause in probes.find_causes(subject(pipeline, batch), workers)]


def test_a_pipeline_free_of_per_rank_behaviour_shows_no_cause(digits_batch):
    assert causes_of(Clean(), digits_batch) == []
    assert causes_of(WithDropout(), digits_batch) == []  # dropout is put in evaluation mode, and said


@pytest.mark.parametrize(
    "pipeline, workers, cause",
    [
        (WithBatchNorm(), 2, "BatchNorm layers normalize each worker's share with its own statistics"),
        (SummedLoss(), 2, "a loss that scales with the per-rank batch"),
        (SummedLoss(), 4, "a loss that scales with the per-rank batch"),
        (NoisyLoss(), 2, "randomness in compute_loss or the model"),
        (StatefulLoss(), 2, "state carried across calls in the pipeline object"),
        (RankAware(), 2, "compute_loss depends on the rank or the world size"),
    ],
)
def test_each_pitfall_is_named_alone(digits_batch, pipeline, workers, cause):
    assert causes_of(pipeline, digits_batch, workers) == [cause]


def test_each_cause_says_what_showed_it_and_the_fix(digits_batch):
    [batchnorm] = probes.find_causes(subject(WithBatchNorm(), digits_batch), 2)
    assert "1 BatchNorm layer(s) (norm)" in batchnorm.evidence and "the gap closes" in batchnorm.evidence
    assert batchnorm.fix.startswith("--sync-batchnorm")
    [summed] = probes.find_causes(subject(SummedLoss(), digits_batch), 2)
    assert "2.00 × the mean of the losses over its 2 shares" in summed.evidence
    assert "reduction='mean'" in summed.fix
    [stateful] = probes.find_causes(subject(StatefulLoss(), digits_batch), 2)
    assert "(attributes it changed: running)" in stateful.evidence


def test_with_sync_batchnorm_the_batchnorm_layers_are_no_suspect(digits_batch):
    assert probes.find_causes(subject(WithBatchNorm(), digits_batch), 2, batchnorm_synced=True) == []
    [summed] = probes.find_causes(subject(SummedLoss(), digits_batch), 2, batchnorm_synced=True)
    assert summed.name == "a loss that scales with the per-rank batch"


def test_a_probe_leaves_the_pipeline_and_the_generators_as_they_were(digits_batch):
    pipeline = StatefulLoss()
    state = torch.get_rng_state()
    probes.find_causes(subject(pipeline, digits_batch), 2)
    assert not hasattr(pipeline, "running")
    assert torch.equal(torch.get_rng_state(), state)


def test_augmentation_row_by_row_gives_each_row_the_same_draws_however_the_rows_are_split():
    from types import SimpleNamespace

    import numpy as np

    from raytrain.check.worker import RowByRow
    from raytrain.data.table import Table
    from raytrain.rules.steps import Step

    def transform(batch, key):  # noise drawn from the key, as StepRunner.transform seeds transform_batch
        noise = torch.randn(batch["x"].shape, generator=torch.Generator().manual_seed(hash(tuple(key)) % 2**31))
        return {**batch, "x": batch["x"] + noise}

    runner = SimpleNamespace(cfg=SimpleNamespace(seed=3), row_transform=transform)
    table = Table({"x": np.arange(40, dtype=np.float32).reshape(10, 4)})
    step = Step(index=0, start=0, end=10)

    def shares(world):
        epochs = [RowByRow(table.epoch(3, 0, 0, rank, world), runner, epoch=0) for rank in range(world)]
        return torch.cat([data.batch(data.rows(step), torch.device("cpu"))[0]["x"] for data in epochs])

    one, two = shares(1), shares(2)
    torch.testing.assert_close(one, two, rtol=0, atol=0)
    assert not torch.equal(
        one, torch.from_numpy(table.columns["x"])[torch.from_numpy(table.epoch(3, 0, 0, 0, 1).order)]
    )


def test_the_check_runner_leaves_each_share_as_the_rows_transform_made_it():
    # The step runner applies transform_batch to each rank's share; the check's runner must not,
    # or an augmenting pipeline's rows are transformed twice, per rank, and 2 workers differ from 1.
    from raytrain.check.worker import CheckRunner
    from raytrain.worker.step import StepRunner

    batch = {"x": torch.ones(2, 3)}
    assert CheckRunner.transform(None, batch, [3, 0, 0, 1, 0]) is batch
    assert CheckRunner.row_transform is StepRunner.transform


def test_dropout_layers_are_put_in_evaluation_mode_and_counted():
    model = WithDropout().build_model(None)
    model.train()
    assert probes.dropout_to_eval(model) == 1
    assert not model.head[3].training and model.conv.training


# -- --sync-batchnorm ------------------------------------------------------------------------


def test_sync_batchnorm_on_cpu_keeps_the_weights_names_so_exports_load_into_the_plain_model():
    from raytrain.parallel.batchnorm import GlobalBatchNorm, sync_batchnorm_layers

    plain = WithBatchNorm().build_model(None)
    converted = sync_batchnorm_layers(WithBatchNorm().build_model(None), torch.device("cpu"))
    assert isinstance(converted.norm, GlobalBatchNorm)
    assert probes.batchnorm_layers(converted) == []  # synced: no longer a per-rank suspect
    plain.load_state_dict(converted.state_dict(), strict=True)
    x = torch.randn(16, 1, 8, 8)
    torch.testing.assert_close(converted(x), plain(x))  # outside a process group: plain BatchNorm


def test_sync_batchnorm_is_refused_with_per_step_replicas():
    from raytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="sync_batchnorm.*per-step replicas"):
        TrainConfig(sync_batchnorm=True, fault_tolerance="per-step")


# -- bad usage: exit 2 before anything starts ------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "1"], "--workers: got '1'; raytrain check compares N workers with 1: give N ≥ 2"),
        (["--workers", "2:4"], "--workers: got '2:4'; raytrain check compares N workers with 1"),
        (["--workers", "2", "--steps", "0"], "--steps: got 0; must be a positive number of steps"),
        (["--workers", "2", "--tolerance", "-1"], "--tolerance: got -1.0; must be a positive fraction"),
    ],
)
def test_bad_usage_is_refused_with_exit_2_and_one_line(capsys, argv, message):
    assert main(["check", "digits", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_flag_the_check_does_not_take_is_bad_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "digits", "--workers", "2", "--resume"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --resume" in capsys.readouterr().err


@pytest.mark.slow
def test_sync_batchnorm_over_gloo_takes_the_step_one_process_takes_over_the_whole_batch(tmp_path):
    import syncbn_ranks
    from ranks import run_ranks

    out = tmp_path / "ranks.pt"
    run_ranks("syncbn_ranks.py", out)
    ranks = torch.load(out, weights_only=True)
    model = syncbn_ranks.model()
    x, y = syncbn_ranks.batch()
    torch.testing.assert_close(ranks["out"], syncbn_ranks.step(model, x, y), rtol=1e-5, atol=1e-6)
    for name, parameter in model.named_parameters():  # DDP's average of the ranks' gradients
        torch.testing.assert_close(ranks["grads"][name], parameter.grad, rtol=1e-4, atol=1e-6)
    for name, value in model.state_dict().items():  # running statistics over the whole batch
        torch.testing.assert_close(ranks["state"][name], value, rtol=1e-5, atol=1e-6)
