"""Pure tier: every pipeline hook under one rule (`raytrain.hooks`) — an exception or a wrong
return is the pipeline's error, named with the hook and the user's code, never retried (a
UserError), and the CLI answers it with exit status 2 and one message."""

from __future__ import annotations

import ast
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from one_rank import step_runner, take_a_step
from torch import nn

import raytrain
from raytrain import hooks
from raytrain.cli import main
from raytrain.config import TrainConfig
from raytrain.data.table import Table
from raytrain.errors import PipelineCodeError, PipelineError, find_user_error
from raytrain.pipeline import Pipeline, parse_pipeline_args
from raytrain.worker.step import Batch, StepRunner

PACKAGE = Path(raytrain.__file__).resolve().parent


# -- the rule holds by construction -----------------------------------------------------------------


def pipeline_hooks() -> set[str]:
    """What a user's Pipeline may define: its methods (but `args`, a helper) and `Args`."""
    methods = {
        name
        for name, value in vars(Pipeline).items()
        if not name.startswith("_") and inspect.isfunction(value) and name != "args"
    }
    return methods | {"Args", "default_config"}


def test_every_hook_of_pipeline_has_its_return_check():
    assert pipeline_hooks() <= set(hooks.HOOKS), f"add {pipeline_hooks() - set(hooks.HOOKS)} to raytrain.hooks.HOOKS"


def test_raytrain_calls_a_pipelines_hooks_only_through_the_rule():
    """No `pipeline.<hook>(...)` call outside raytrain/hooks.py: a hook called directly would
    escape the rule (its exception retried, its return unchecked). The torchrun template bench
    measures against (raytrain/baselines/) is the user's plain script and calls it as one."""
    direct = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "baselines" or (path.name == "hooks.py" and path.parent == PACKAGE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in hooks.HOOKS:
                owner = ast.unparse(node.func.value)
                if owner.split(".")[-1] in ("pipeline", "pipe") and path.name != "pipeline.py":
                    direct.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)[:60]}")
    assert not direct, direct


# -- lr_factor ----------------------------------------------------------------------------------------


def factor_pipeline(returns=None, raises: Exception | None = None) -> Pipeline:
    class OwnSchedule(Pipeline):
        def lr_factor(self, progress):
            if raises is not None:
                raise raises
            return returns

    return OwnSchedule()


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, "returned a NoneType ('None') for progress 0.5; it must return a number ≥ 0"),
        ("0.5", "returned a str ('0.5')"),
        (True, "returned a bool"),
        (-0.1, "lr_factor(0.5) returned -0.1: a negative rate climbs the loss instead of descending it"),
        (float("nan"), "must return a finite number ≥ 0 (the rate is the peak rate × lr_factor(progress)); "),
        (math.inf, "returned inf"),
        (torch.tensor([0.5, 0.5]), "returned a Tensor"),
    ],
)
def test_a_wrong_lr_factor_is_refused_naming_the_hook_the_value_and_the_users_code(value, expected):
    with pytest.raises(PipelineCodeError) as failure:
        hooks.call(factor_pipeline(value), "lr_factor", 0.5)
    message = str(failure.value)
    assert message.startswith("pipeline OwnSchedule: lr_factor ") and expected in message, message
    assert "test_hooks.py:" in message and "in lr_factor" in message
    assert find_user_error(failure.value) is failure.value  # a UserError: never retried, exit 2


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, np.float32(0.25), torch.tensor(0.25)])
def test_a_number_from_lr_factor_is_taken_as_a_float(value):
    taken = hooks.call(factor_pipeline(value), "lr_factor", 0.5)
    assert isinstance(taken, float) and taken == pytest.approx(float(value))


def test_an_exception_from_lr_factor_names_it_and_where():
    with pytest.raises(PipelineCodeError, match=r"lr_factor raised ZeroDivisionError: boom") as failure:
        hooks.call(factor_pipeline(raises=ZeroDivisionError("boom")), "lr_factor", 0.5)
    assert "test_hooks.py" in str(failure.value) and "in lr_factor" in str(failure.value)


# -- the step runner goes through the rule ---------------------------------------------------------------


class Regression(Pipeline):
    def build_model(self, cfg):
        return nn.Linear(4, 1)

    def compute_loss(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def runner_for(pipeline: Pipeline) -> tuple[StepRunner, Table]:
    table = Table({"x": np.ones((8, 4), dtype=np.float32), "y": np.zeros((8, 1), dtype=np.float32)})
    return step_runner(pipeline), table


def test_a_negative_lr_factor_stops_the_step_instead_of_climbing_the_loss():
    class Ascent(Regression):
        def lr_factor(self, progress):
            return -1.0

    runner, table = runner_for(Ascent())
    before = [p.detach().clone() for p in runner.model.parameters()]
    with pytest.raises(PipelineCodeError, match=r"lr_factor must return a number ≥ 0"):
        take_a_step(runner, table)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.model.parameters()))  # nothing applied


class HalfBatch(Regression):
    def transform_batch(self, batch, ctx):
        return {key: value[: len(value) // 2] for key, value in batch.items()}


class DropsColumn(Regression):
    def transform_batch(self, batch, ctx):
        return {"x": batch["x"]}


class AddsColumn(Regression):
    def transform_batch(self, batch, ctx):
        return {**batch, "lam": torch.ones(len(batch["x"]))}


class InPlace(Regression):
    def transform_batch(self, batch, ctx):
        batch["x"] = batch["x"] * 2  # and forgets `return batch`


class Augments(Regression):
    def transform_batch(self, batch, ctx):
        batch["x"] = batch["x"] + torch.randn_like(batch["x"])
        return batch


@pytest.mark.parametrize(
    "pipeline, expected",
    [
        (HalfBatch(), "returned 4 row(s) in column 'x' for a batch of 8; it must return every row it was given"),
        (DropsColumn(), "returned the columns ['x'] for a batch of ['x', 'y'] (missing ['y'])"),
        (AddsColumn(), "(added ['lam']); it must return the columns it was given"),
        (InPlace(), "must return the batch (a dict of tensors); it returned a NoneType: end it with `return batch`"),
    ],
)
def test_transform_batch_must_give_back_every_row_and_column(pipeline, expected):
    runner, table = runner_for(pipeline)
    with pytest.raises(PipelineCodeError) as failure:
        take_a_step(runner, table)
    message = str(failure.value)
    assert message.startswith(f"pipeline {pipeline.name}: transform_batch ") and expected in message, message
    assert "test_hooks.py:" in message and "in transform_batch" in message


def test_an_augmentation_that_keeps_rows_and_columns_trains():
    runner, table = runner_for(Augments())
    take_a_step(runner, table)
    assert runner.window.snapshot() is not None


def test_batch_shape_is_taken_before_the_hook_can_change_it():
    class Shrinks(Regression):
        def transform_batch(self, batch, ctx):
            for key in list(batch):
                batch[key] = batch[key][:1]
            return batch

    with pytest.raises(PipelineCodeError, match="returned 1 row"):
        hooks.call(Shrinks(), "transform_batch", Batch({"x": torch.zeros(3, 2)}), None)


# -- build_optimizer ---------------------------------------------------------------------------------------


def optimizer_of(build) -> type[Pipeline]:
    class Own(Regression):
        def build_optimizer(self, model, cfg):
            return build(model, cfg)

    return Own


def two_layers(cfg=None):
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def test_an_optimizer_over_tensors_that_are_not_the_models_is_refused():
    stray = nn.Parameter(torch.zeros(3))
    own = optimizer_of(lambda model, cfg: torch.optim.SGD([stray], lr=cfg.lr))()
    with pytest.raises(PipelineCodeError) as failure:
        hooks.call(own, "build_optimizer", two_layers(), TrainConfig())
    message = str(failure.value)
    assert "build_optimizer returned an optimizer over 1 tensor(s) that are not the model's parameters" in message
    assert "(shapes (3,))" in message and "model.parameters()" in message and "in build_optimizer" in message


def test_an_optimizer_over_none_of_the_trainable_parameters_is_refused():
    def frozen_only(model, cfg):
        model[0].weight.requires_grad_(False)
        return torch.optim.SGD([model[0].weight], lr=cfg.lr)

    with pytest.raises(PipelineCodeError, match="over none of the model's trainable parameters, so nothing would"):
        hooks.call(optimizer_of(frozen_only)(), "build_optimizer", two_layers(), TrainConfig())


def test_an_optimizer_that_leaves_some_parameters_out_is_allowed_and_said():
    head_only = optimizer_of(lambda model, cfg: torch.optim.SGD(model[1].parameters(), lr=cfg.lr))()
    model = two_layers()
    optimizer = hooks.call(head_only, "build_optimizer", model, TrainConfig())
    note = hooks.optimizer_note(model, optimizer)
    assert note.startswith(
        "build_optimizer leaves 2 of the model's 4 trainable parameter tensors out (0.weight, 0.bias)"
    )
    assert "requires_grad=False" in note
    every = hooks.call(Regression(), "build_optimizer", model, TrainConfig())  # the default: all of them
    assert hooks.optimizer_note(model, every) is None


def test_a_non_optimizer_is_refused():
    with pytest.raises(PipelineCodeError, match="build_optimizer returned a list, not a torch.optim.Optimizer"):
        hooks.call(optimizer_of(lambda model, cfg: [])(), "build_optimizer", two_layers(), TrainConfig())


# -- shard_modules, build_model ---------------------------------------------------------------------------


def test_shard_modules_must_name_submodules_of_the_model():
    model = two_layers()

    class Shards(Pipeline):
        def __init__(self, blocks):
            self.blocks = blocks

        def shard_modules(self, model):
            return self.blocks

    assert hooks.call(Shards((model[0], model[1])), "shard_modules", model) == [model[0], model[1]]
    with pytest.raises(PipelineCodeError, match=r"1 of them \(Linear\) are not inside the model built by build_model"):
        hooks.call(Shards([nn.Linear(1, 1)]), "shard_modules", model)
    with pytest.raises(PipelineCodeError, match="must return a list of the model's own submodules; it returned gen"):
        hooks.call(Shards(m for m in model), "shard_modules", model)


def test_build_model_must_return_a_module():
    class NotAModel(Pipeline):
        def build_model(self, cfg):
            return "resnet"

    with pytest.raises(PipelineCodeError, match="build_model returned a str, not a torch.nn.Module"):
        hooks.call(NotAModel(), "build_model", TrainConfig())

    class NoParameters(Pipeline):
        def build_model(self, cfg):
            return nn.ReLU()

    with pytest.raises(PipelineCodeError, match="returned a ReLU without parameters: there is nothing to train"):
        hooks.call(NoParameters(), "build_model", TrainConfig())


# -- Args -----------------------------------------------------------------------------------------------------


class DictArgs(Regression):
    Args = dict


@dataclass
class Knobs:
    size: int = 1

    def __post_init__(self):
        if self.size > 10:
            {}["limits"][self.size]  # the pipeline's own bug, not a bad value


class BuggyArgs(Regression):
    Args = Knobs


def test_args_that_are_not_a_dataclass_are_the_pipelines_error():
    with pytest.raises(PipelineCodeError) as failure:
        parse_pipeline_args(DictArgs(), {})
    message = str(failure.value)
    assert message.startswith("pipeline DictArgs: Args is dict, not a dataclass; declare the pipeline's options")
    assert "@dataclass" in message and "test_hooks.py:" in message and "in class DictArgs" in message


def test_an_exception_from_args_is_the_pipelines_error_naming_args():
    with pytest.raises(PipelineCodeError, match=r"pipeline BuggyArgs: Args raised KeyError: 'limits'"):
        parse_pipeline_args(BuggyArgs(), {"size": "11"})
    assert parse_pipeline_args(BuggyArgs(), {"size": "3"}) == Knobs(3)


def test_the_cli_answers_args_dict_with_exit_2_and_one_message_before_ray(capsys, tmp_path):
    import ray

    ray_before = ray.is_initialized()  # the suite's shared Ray may be up already
    code = main(["train", "test_hooks:DictArgs", "--storage", str(tmp_path), "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("raytrain train: pipeline DictArgs: Args is dict, not a dataclass"), err
    assert "Traceback" not in err and ray.is_initialized() == ray_before and not list(tmp_path.iterdir())


# -- loading the pipeline: its module, its class, its attributes ------------------------------------------


@pytest.mark.parametrize(
    "source, spec, error, expected",
    [
        (
            "class P(raytrain.Pipeline)\n    pass\n",
            "m1:P",
            PipelineCodeError,
            "pipeline 'm1:P': importing module 'm1' raised SyntaxError: expected ':' (m1.py, line 2)",
        ),
        (
            "raise RuntimeError('no /data/conf.json')\n",
            "m2:P",
            PipelineCodeError,
            "pipeline 'm2:P': importing module 'm2' raised RuntimeError: no /data/conf.json\n  at ",
        ),
        (
            "import torchvisionx\n",
            "m3:P",
            PipelineError,
            "pipeline 'm3:P': module 'm3' imports 'torchvisionx', which is not installed here: install it",
        ),
        (
            "class P(raytrain.Pipeline):\n    def __init__(self, path):\n        pass\n",
            "m4:P",
            PipelineError,
            "pipeline 'm4:P': P() raised TypeError: P.__init__() missing 1 required positional argument: 'path'; "
            "raytrain builds a pipeline class without arguments",
        ),
        (
            "class P(raytrain.Pipeline):\n    def __init__(self):\n        raise ValueError('no GPU')\n",
            "m5:P",
            PipelineCodeError,
            "pipeline 'm5:P': P() raised ValueError: no GPU\n  at ",
        ),
        (
            "class P(raytrain.Pipeline):\n    default_config = ['epochs', 3]\n",
            "m6:P",
            PipelineCodeError,
            "pipeline P: default_config is list (['epochs', 3]), not a dict of options",
        ),
    ],
)
def test_a_pipeline_that_cannot_be_loaded_is_named_with_the_line_and_the_fix(
    tmp_path, monkeypatch, source, spec, error, expected
):
    module = spec.split(":")[0]
    (tmp_path / f"{module}.py").write_text("import raytrain\n" + source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(error) as failure:
        raytrain.pipeline.load_pipeline(spec)
    assert str(failure.value).startswith(expected), str(failure.value)


def test_a_reader_error_inside_build_datasets_is_the_datas_naming_the_file(tmp_path):
    import pyarrow.parquet as pq

    from raytrain.errors import DataError

    truncated = tmp_path / "part-2.parquet"
    truncated.write_bytes(b"PAR1" + b"\\0" * 40)

    def footer(path):  # as Ray Data reads footers, in a helper whose frame keeps `path`
        return pq.read_schema(path)

    class Reads(Pipeline):
        def build_datasets(self, cfg):
            return {"train": footer(str(truncated))}

    class Opens(Pipeline):
        def build_datasets(self, cfg):
            return {"train": open(tmp_path / "gone.npz", "rb")}

    with pytest.raises(DataError) as failure:
        hooks.call(Reads(), "build_datasets", TrainConfig())
    assert str(failure.value).startswith(f"pipeline Reads: build_datasets cannot read its data (file {truncated}): ")
    assert "truncated, damaged or not in the format read" in str(failure.value)
    with pytest.raises(DataError, match=rf"build_datasets cannot read its data \(file {tmp_path}/gone.npz\)"):
        hooks.call(Opens(), "build_datasets", TrainConfig())

    class Buggy(Pipeline):
        def build_datasets(self, cfg):
            return {"train": 1 / 0}  # the code's own bug stays the code's

    with pytest.raises(PipelineCodeError, match="build_datasets raised ZeroDivisionError"):
        hooks.call(Buggy(), "build_datasets", TrainConfig())
