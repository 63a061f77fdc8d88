"""Pure tier: the user's recipe — optimizers and parameter groups, schedules keyed to samples,
warmup's start, gradient clipping under fp16, transform_batch's seeding, torch samples as
columns, and errors that name what the batch has."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from one_rank import step_runner, take_a_step
from torch import nn

import raytrain
from raytrain.config import TrainConfig
from raytrain.data.table import Table
from raytrain.data.torch_dataset import TorchSamples, sample_columns
from raytrain.errors import ConfigError, DataError
from raytrain.pipeline import default_optimizer
from raytrain.rules.batch import resolve_batch_plan
from raytrain.rules.schedule import LRSchedule, run_schedule
from raytrain.worker import optim
from raytrain.worker.step import Batch

N = 1000  # rows per epoch in the schedule tests


def schedule(kind: str, **kw) -> LRSchedule:
    cfg = TrainConfig(
        epochs=10,
        batch_size_per_worker=10,
        reference_batch_size=10,
        schedule=kind,
        lr=0.1,
        warmup_epochs=kw.pop("warmup", 1.0),
        **kw,
    )
    return run_schedule(cfg, resolve_batch_plan(4, batch_size_per_worker=10), N)  # global 40, reference 10: peak 0.4


@pytest.mark.parametrize(
    "kind, at_samples, expected",
    [
        ("cosine", [0, 500, 1000, 5500, 10000], [0.1, 0.25, 0.4, 0.2, 0.0]),
        ("constant", [1000, 9999], [0.4, 0.4]),
        ("linear", [1000, 5500, 10000], [0.4, 0.2, 0.0]),
        ("onecycle", [0, 500, 1000, 10000], [0.1, 0.25, 0.4, 0.4e-4]),
    ],
)
def test_schedules_at_given_sample_counts(kind, at_samples, expected):
    s = schedule(kind)
    assert [s.lr(n) for n in at_samples] == pytest.approx(expected, abs=1e-9)


def test_step_schedule_decays_at_milestones_in_epochs():
    s = schedule("step", lr_milestones=[3, 6.5], lr_gamma=0.1)
    assert [s.lr(n) for n in (999, 1000, 2999, 3000, 6499, 6500, 9999)] == pytest.approx(
        [0.3997, 0.4, 0.4, 0.04, 0.04, 0.004, 0.004], abs=1e-4
    )


def test_warmup_start_factor_starts_near_zero_instead_of_the_unscaled_rate():
    assert schedule("cosine").lr(0) == pytest.approx(0.1)  # Goyal: from lr, the single-worker rate
    s = schedule("cosine", warmup_start_factor=0.01)
    assert s.lr(0) == pytest.approx(0.004) and s.lr(1000) == pytest.approx(0.4)


def test_onecycle_without_warmup_rises_over_the_first_30_percent():
    s = schedule("onecycle", warmup=0)
    assert s.lr(3000) == pytest.approx(0.4) and s.lr(1500) < 0.4 and s.lr(10000) == pytest.approx(0.4e-4)


def test_a_pipelines_lr_factor_replaces_the_schedule_after_warmup():
    s = schedule("cosine")
    assert s.lr(5500, factor=lambda p: 1 - p / 2) == pytest.approx(0.4 * 0.75)
    assert s.lr(500, factor=lambda p: 0.0) == pytest.approx(0.25)  # warmup stays the rules'


def test_milestones_are_checked():
    with pytest.raises(ConfigError, match="--schedule step needs the epochs"):
        TrainConfig(schedule="step")
    with pytest.raises(ConfigError, match="milestones apply to --schedule step only"):
        TrainConfig(lr_milestones=[3])
    with pytest.raises(ConfigError, match="positive and increasing"):
        TrainConfig(schedule="step", lr_milestones=[5, 3])
    with pytest.raises(ConfigError, match="choose one of adamw, sgd, lamb"):
        TrainConfig(optimizer="adam")
    with pytest.raises(ConfigError, match="applies to --optimizer sgd"):
        TrainConfig(nesterov=True)


class TwoRates(raytrain.Pipeline):
    def build_optimizer(self, model, cfg):
        return torch.optim.SGD(
            [{"params": model[0].parameters(), "lr": cfg.lr * 0.1}, {"params": model[1].parameters()}],
            lr=cfg.lr,
            momentum=0.9,
        )


def test_parameter_groups_keep_their_relative_rates_through_scaling_and_warmup():
    cfg = TrainConfig(lr=0.1, batch_size_per_worker=10, reference_batch_size=10, warmup_epochs=1, epochs=4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = TwoRates().build_optimizer(model, cfg)
    multipliers = optim.rate_multipliers(optimizer, cfg.lr)
    assert multipliers == pytest.approx([0.1, 1.0])
    s = run_schedule(cfg, resolve_batch_plan(4, batch_size_per_worker=10), N)  # peak 0.4
    for samples in (0, 250, 1000, 3000):
        optim.set_rates(optimizer, s.lr(samples), multipliers)
        rates = [g["lr"] for g in optimizer.param_groups]
        assert rates[1] == pytest.approx(s.lr(samples)) and rates[0] == pytest.approx(0.1 * rates[1])


def test_default_optimizers_and_no_decay_on_norms_and_biases():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    sgd = default_optimizer(
        model, TrainConfig(optimizer="sgd", momentum=0.8, nesterov=True, weight_decay=5e-4, decay_norm_and_bias=False)
    )
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.8
    decays = sorted((g["weight_decay"], sum(p.numel() for p in g["params"])) for g in sgd.param_groups)
    assert decays == [(0.0, 4 + 4 + 4 + 2), (5e-4, 16 + 8)]  # biases and the norm's weight/bias: no decay
    assert isinstance(default_optimizer(model, TrainConfig()), torch.optim.AdamW)
    lamb = default_optimizer(model, TrainConfig(optimizer="lamb"))
    assert type(lamb).__name__ == "Lamb" and type(lamb).__module__.startswith("pytorch_optimizer")


def one_step(precision: str, clip: float | None) -> float:
    """The norm of one SGD update (lr 1, no momentum, no decay) of a model whose gradient norm is 0.18."""

    class Big(raytrain.Pipeline):
        def build_model(self, cfg):
            return nn.Linear(4, 1)

        def compute_loss(self, model, batch):
            return model(batch["x"]).float().sum() * 0.01

    options = dict(optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=1.0, schedule="constant")
    runner = step_runner(Big(), precision=precision, grad_clip_norm=clip, **options)
    model = runner.model
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    take_a_step(runner, Table({"x": np.ones((8, 4), dtype=np.float32)}))
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return float((after - before).norm())


def test_gradient_clipping_applies_to_the_unscaled_gradients_under_fp16():
    assert one_step("fp32", None) == pytest.approx(0.01 * 8 * math.sqrt(5), rel=1e-4)
    assert one_step("fp32", 0.01) == pytest.approx(0.01, rel=1e-4)
    # Under fp16 the gradients are scaled by 65,536 until the scaler unscales them: clipping
    # before that would leave an update of 0.01 / 65,536.
    assert one_step("fp16", 0.01) == pytest.approx(0.01, rel=1e-2)


def test_torch_samples_become_named_columns():
    assert list(sample_columns((torch.zeros(3), 4), "train", 0)) == ["0", "1"]
    assert sorted(sample_columns({"image": np.zeros((2, 2)), "label": 1}, "train", 0)) == ["image", "label"]
    assert list(sample_columns(torch.ones(5), "train", 0)) == ["0"]
    with pytest.raises(DataError, match=r"sample 7, field '1' is a str \('cat'\).*tensors, numpy arrays or numbers"):
        sample_columns((torch.zeros(2), "cat"), "train", 7)


class Ragged(torch.utils.data.Dataset):
    """Sample 217 has a wider image; sample 250 an extra field."""

    def __len__(self):
        return 300

    def __getitem__(self, index):
        if index == 250:
            return torch.zeros(4), torch.zeros(1), torch.zeros(1)
        return torch.zeros(5 if index == 217 else 4), torch.zeros(1)


def test_a_torch_sample_of_another_shape_or_fields_is_refused_naming_its_index():
    read = TorchSamples(Ragged(), "train", {"0": (4,), "1": (1,)})
    assert read({"id": np.arange(200, 210)})["0"].shape == (10, 4)
    with pytest.raises(DataError, match=r"sample 217, field '0' has shape \(5,\) where sample 0's has \(4,\);"):
        read({"id": np.arange(210, 230)})
    with pytest.raises(DataError, match=r"sample 250 has the fields \['0', '1', '2'\] where sample 0 has \['0', '1'\]"):
        read({"id": np.arange(240, 260)})


def test_a_missing_batch_key_lists_the_keys_the_batch_has():
    batch = Batch({"0": torch.zeros(2), "1": torch.zeros(2)})
    with pytest.raises(KeyError, match=r"'image': the batch has no such column; it has '0', '1'"):
        batch["image"]


def test_the_tuple_column_from_ray_from_torch_is_explained():
    from raytrain.data.checks import check_columns

    items = np.empty(2, dtype=object)
    items[0], items[1] = (np.zeros(2), 1), (np.ones(2), 0)
    with pytest.raises(
        DataError, match=r"holds tuples .*from_torch gives one 'item' column.*Return the torch Dataset itself"
    ):
        check_columns({"item": items}, "train", "block 0")
