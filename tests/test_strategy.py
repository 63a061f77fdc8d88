"""--strategy, --activation-checkpointing and --compile, and the training state's checkpoints, in
one process (pure tier): the blocks, their checks, and what a checkpoint holds and gives back."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import raytrain
from pipelines.charlm.model import CharGPT
from raytrain import fields
from raytrain.config import TrainConfig
from raytrain.errors import CheckpointError, ConfigError, PipelineCodeError
from raytrain.parallel import holding, strategy
from raytrain.pipeline import default_blocks
from raytrain.rules import resume
from raytrain.rules.position import Position
from raytrain.rundir import checkpoints
from raytrain.worker.state import TrainingState

# -- the blocks ---------------------------------------------------------------------------------


class Tower(nn.Module):
    """A stem, a ModuleList of blocks each holding a Sequential of its own, and a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class Blocks(raytrain.Pipeline):
    def __init__(self, choose=None):
        self.choose = choose

    def shard_modules(self, model):
        return self.choose(model) if self.choose else super().shard_modules(model)


def test_the_default_blocks_are_the_children_of_the_outermost_lists_of_blocks():
    tower = Tower()
    assert default_blocks(tower) == list(tower.layers)  # not the Sequentials inside each block
    gpt = CharGPT(layers=3)
    assert default_blocks(gpt) == list(gpt.blocks)
    assert default_blocks(nn.Linear(2, 2)) == []  # no blocks: the root alone is sharded


def test_the_pipelines_blocks_are_named_in_model_order():
    tower = Tower()
    picked = strategy.blocks_of(Blocks(lambda m: [m.layers[2], m.layers[0]]), tower)
    assert [name for name, _ in picked] == ["layers.0", "layers.2"]


@pytest.mark.parametrize(
    "choose, message",
    [
        (lambda m: m.layers, "it returned ModuleList"),
        (lambda m: [m.layers[0], "head"], "it returned a list holding non-modules"),
        (lambda m: [nn.Linear(8, 8)], "not inside the model built by build_model"),
        (lambda m: [m], "not inside the model built by build_model \\(or are the model itself\\)"),
        (lambda m: [m.layers[0], m.layers[0]], "it names a module twice"),
        (lambda m: [m.layers[0], m.layers[0][0]], "none inside another; layers.0.0 is inside another"),
    ],
)
def test_shard_modules_that_are_not_the_models_own_blocks_are_the_pipelines_error(choose, message):
    with pytest.raises(PipelineCodeError, match=message):
        strategy.blocks_of(Blocks(choose), Tower())


class Ends(nn.Module):
    """An embedding whose weight is also the output layer's (tied), and the model's body between."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, body):
        return self.head(body(self.embed(tokens)))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.ends = Ends()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, tokens):
        return self.ends(tokens, self.body)

    def body(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


UNITS = {  # shard_modules' choice -> the tied parameter's units it gives, by name
    "the embedding and the head apart": (
        ["ends.embed", "ends.head"],
        [("block ends.embed", "ends.embed.weight"), ("block ends.head", "ends.head.weight")],
    ),
    "the embedding alone": (
        ["ends.embed"],
        [("block ends.embed", "ends.embed.weight"), ("the root", "ends.head.weight")],
    ),
    "the blocks": (["blocks.0", "blocks.1"], None),
    "the module holding both": (["ends", "blocks.0"], None),
    "nothing": ([], None),
}


@pytest.mark.parametrize("case", UNITS)
def test_tied_parameters_split_over_fsdp_units_are_found_before_sharding(case):
    chosen, split = UNITS[case]
    model = Tied()
    modules = dict(model.named_modules())
    picked = strategy.blocks_of(Blocks(lambda m: [modules[name] for name in chosen]), model)
    assert strategy.split_parameters(model, picked) == ([split] if split else [])
    if split is None:
        strategy.check_shard_units(Blocks(), model, picked)
        return
    with pytest.raises(PipelineCodeError) as failure:
        strategy.check_shard_units(Blocks(), model, picked)
    message = str(failure.value)
    assert message.startswith("pipeline Blocks: shard_modules puts one parameter in two FSDP units")
    assert " and ".join(f"{name} ({unit})" for unit, name in split) in message
    assert "leave the modules that share it out of shard_modules" in message and "untie them" in message
    assert "test_strategy.py" in message and "in shard_modules" in message  # where the user's hook is


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize("case", UNITS)
def test_the_tied_parameters_found_are_the_ones_fsdp_refuses(one_rank_group, case):
    from torch.distributed.fsdp import fully_shard

    model = Tied()
    modules = dict(model.named_modules())
    picked = strategy.blocks_of(Blocks(lambda m: [modules[name] for name in UNITS[case][0]]), model)
    found = strategy.split_parameters(model, picked)
    for _, block in picked:
        fully_shard(block)
    fully_shard(model)
    try:  # FSDP2 checks at the first forward, which is compute_loss's
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        refused = False
    except ValueError as exc:
        refused = "is shared with a parameter already managed by another FSDP group" in str(exc)
    if found and not refused and torch_version() < (2, 13):
        pytest.skip(f"torch {torch.__version__}'s FSDP2 does not check for shared parameters (raytrain refuses them)")
    assert bool(found) == refused


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def test_every_precision_has_one_compute_dtype():
    choices = fields.option(TrainConfig, "precision").choices
    assert {p: holding.compute_dtype(p) for p in choices} == {
        "fp32": None,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_strategy_owns_its_precision_policy(precision):
    cpu, dtype = torch.device("cpu"), holding.compute_dtype(precision)
    ddp, fsdp = holding.Ddp(precision), holding.Fsdp(precision)
    with ddp.autocast("cpu"):  # ddp: torch.autocast, but for fp32
        assert torch.is_autocast_enabled("cpu") == (dtype is not None)
        assert dtype is None or torch.get_autocast_dtype("cpu") == dtype
    with fsdp.autocast("cpu"):  # fsdp: FSDP2's policy casts, not autocast
        assert not torch.is_autocast_enabled("cpu")
    policy = fsdp.mp_policy()
    if dtype is None:
        assert policy is None
    else:
        assert (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32)
    # fp16's scaler: under fsdp ShardedGradScaler, whose overflow check spans every shard
    for held, plain in ((ddp, True), (fsdp, precision != "fp16")):
        scaler = held.grad_scaler(cpu)
        assert scaler.is_enabled() == (precision == "fp16")
        assert (type(scaler) is torch.amp.GradScaler) == plain, (held, type(scaler))


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_fsdp_computes_in_the_precisions_dtype(one_rank_group, precision, dtype):
    cfg = TrainConfig(strategy="fsdp", workers=2, precision=precision)
    model = strategy.shard(Tower(), [], cfg)
    assert model(torch.ones(2, 4)).dtype == dtype


FREED_BLOCKS = """
import json, sys
import psutil, torch
from raytrain.parallel.strategy import fix_mmap_threshold

applied = fix_mmap_threshold()
rss_mib = lambda: psutil.Process().memory_info().rss / 2**20
first = torch.empty(8 * 2**20, dtype=torch.uint8).fill_(1)  # a gathered block, freed: glibc adapts
del first
before = rss_mib()
blocks, small = [], []
for _ in range(64):  # 64 MiB of 1 MiB blocks, small live tensors between them (fragmentation)
    blocks.append(torch.empty(2**20, dtype=torch.uint8).fill_(1))
    small.append(torch.ones(64))
del blocks
print(json.dumps({"applied": applied, "kept_mib": rss_mib() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_cpu_fsdp_worker_gives_freed_blocks_back_to_the_os_unless_the_user_set_the_threshold():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", FREED_BLOCKS], env=env, capture_output=True, text=True, timeout=120)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["applied"] and found["kept_mib"] < 16, found  # without it: all 64 MiB stay
    users = {**env, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    done = subprocess.run([sys.executable, "-c", FREED_BLOCKS], env=users, capture_output=True, text=True, timeout=120)
    assert not json.loads(done.stdout.strip().splitlines()[-1])["applied"]


def test_an_exception_in_shard_modules_names_the_hook():
    def broken(model):
        raise AttributeError("'Tower' object has no attribute 'blocks'")

    with pytest.raises(PipelineCodeError, match="shard_modules raised AttributeError"):
        strategy.blocks_of(Blocks(broken), Tower())


def test_a_model_without_parameters_is_refused_with_the_fix():
    with pytest.raises(PipelineCodeError, match="without parameters: there is nothing to train"):
        strategy.check_model(Blocks(), nn.ReLU())
    with pytest.raises(PipelineCodeError, match="returned a dict, not a torch.nn.Module"):
        strategy.check_model(Blocks(), {})


def test_compile_without_a_compiler_is_a_configuration_error(monkeypatch):
    monkeypatch.setattr(strategy.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="compile: needs a C\\+\\+ compiler on CPU workers"):
        strategy.check_compiler("cpu")


def test_compile_on_a_gpu_without_a_c_compiler_for_triton_is_a_configuration_error(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(
        strategy.importlib.util, "find_spec", lambda name: object() if name == "triton" else found(name)
    )
    monkeypatch.setattr(strategy.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="compile: needs a C compiler on GPU workers .* set CC, or drop --compile"):
        strategy.check_compiler("cuda")
    monkeypatch.setattr(strategy.shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    strategy.check_compiler("cuda")  # gcc will do


@pytest.mark.parametrize(
    "values, message",
    [
        ({"strategy": "fsdp", "workers": 0}, "got fsdp with --workers 0: local mode runs the loop in this process"),
        (
            {"strategy": "fsdp", "workers": 2, "fault_tolerance": "per-step"},
            "replica groups of one worker, which have nothing to shard within; give --replica-group-size K",
        ),
        (
            {"strategy": "fsdp", "workers": 6, "fault_tolerance": "per-step", "replica_group_size": 4},
            "got 4 with --workers 6, which is not a whole number of groups; give --workers 4 or 8",
        ),
        (
            {"strategy": "fsdp", "workers": "3:4", "fault_tolerance": "per-step", "replica_group_size": 2},
            "got 2 with --workers 3:4, which is not a whole number of groups; give --workers 2:4, or a "
            "--replica-group-size that divides both 3 and 4",
        ),
        (
            {"strategy": "ddp", "workers": 4, "fault_tolerance": "per-step", "replica_group_size": 2},
            "a replica group of several workers shards one copy of the model; add --strategy fsdp",
        ),
        (
            {"strategy": "fsdp", "workers": 4, "replica_group_size": 2},
            "replica groups are per-step fault tolerance's; add --fault-tolerance per-step",
        ),
        ({"strategy": "zero3"}, "strategy: got 'zero3'; choose one of ddp, fsdp"),
    ],
)
def test_strategy_options_that_cannot_work_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**values)


def test_the_plan_line_says_what_was_sharded_and_held():
    fsdp = holding.Fsdp("bf16")
    prepared = strategy.Prepared(nn.Linear(1, 1), fsdp, ("blocks.0", "blocks.1"), 1_100_000, 2_200_000, True, True)
    assert prepared.describe() == (
        "fsdp over 2 blocks (blocks.0–blocks.1) and the root, 1.1M of 2.2M parameters on this rank; "
        "activation checkpointing on 2 blocks (blocks.0–blocks.1); to compile per block"
    )
    assert strategy.Prepared(nn.Linear(1, 1), holding.Ddp(), (), 10, 10).describe() == ""


def test_activation_checkpointing_keeps_the_names_and_the_gradients():
    torch.manual_seed(0)
    plain, checkpointed = CharGPT(layers=2, width=32, heads=2), CharGPT(layers=2, width=32, heads=2)
    checkpointed.load_state_dict(plain.state_dict())
    for block in checkpointed.blocks:
        strategy.checkpoint_activations(block)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    tokens = torch.randint(0, 256, (2, 16))
    for model in (plain, checkpointed):
        model(tokens).float().square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


# -- the training state's checkpoints ---------------------------------------------------------


class OneProcess:
    """What TrainingState asks of a runtime, for one process without a process group."""

    world_rank, world_size, is_rank0 = 0, 1, True

    def all_gather_object(self, value):
        return [value]


def trained(seed: int = 0) -> TrainingState:
    torch.manual_seed(seed)
    model = CharGPT(layers=2, width=32, heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 256, (2, 8))).float().mean().backward()
    optimizer.step()
    return TrainingState(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), Position(epoch=1, step=7))


def test_a_checkpoint_holds_model_optimizer_and_position_and_gives_them_back(tmp_path):
    saved = trained(seed=0)
    save = saved.save(tmp_path / "ckpt", OneProcess(), {"lr": 0.01}, distributed=False)
    save.wait()
    directory = tmp_path / "ckpt"
    assert checkpoints.is_complete(directory)
    assert {p.name for p in directory.iterdir()} >= {".metadata", "train_state.pt", "model.pt", "position.json"}
    assert json.loads((directory / "position.json").read_text())["step"] == 7

    fresh = trained(seed=1)  # other weights, other optimizer state
    fresh.load(directory, OneProcess(), seed=0, distributed=False, load_optimizer=lambda load: load())
    for (name, a), (_, b) in zip(saved.model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(a, b), name
    moments = [s["exp_avg"] for s in saved.optimizer.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, fresh.optimizer.state.values()))


@pytest.mark.parametrize("held", [holding.Ddp(), holding.Fsdp()], ids=["ddp", "fsdp"])
def test_the_strategy_says_whether_a_checkpoint_carries_the_plain_model(tmp_path, held):
    saved = trained()
    saved.holding = held
    saved.save(tmp_path / "ckpt", OneProcess(), {}, distributed=False).wait()
    assert (tmp_path / "ckpt" / "model.pt").exists() == held.holds_whole_model
    # the train state's key, as every version has written it
    assert checkpoints.load_train_state(tmp_path / "ckpt")["sharded"] == (not held.holds_whole_model)


def test_a_replica_heals_from_a_live_peers_state():
    peer, joiner = trained(seed=0), trained(seed=1)
    joiner.position = Position()
    joiner.load_live(peer.live())
    assert all(torch.equal(a, b) for a, b in zip(peer.weights().values(), joiner.weights().values()))
    assert joiner.position == peer.position


def test_a_sharded_checkpoint_without_its_plain_model_still_exports_the_weights(tmp_path):
    saved = trained()
    saved.save(tmp_path / "ckpt", OneProcess(), {}, distributed=False).wait()
    (tmp_path / "ckpt" / "model.pt").unlink()  # as under --strategy fsdp: only the DCP files
    weights = checkpoints.load_model_weights(tmp_path / "ckpt")
    CharGPT(layers=2, width=32, heads=2).load_state_dict(weights, strict=True)
    assert checkpoints.model_shapes(tmp_path / "ckpt") == {k: tuple(v.shape) for k, v in weights.items()}
    assert checkpoints.load_state(tmp_path / "ckpt")["optimizer"]["state"]  # the moments, by parameter name


def test_a_checkpoint_of_another_model_is_named_before_anything_runs(tmp_path):
    trained().save(tmp_path / "ckpt", OneProcess(), {}, distributed=False).wait()
    shapes = checkpoints.model_shapes(tmp_path / "ckpt")
    resume.check_model_fits(shapes, CharGPT(layers=2, width=32, heads=2), "ckpt")  # the same model: fine
    with pytest.raises(CheckpointError, match="tokens.weight is \\[256, 32\\] there and \\[256, 64\\] in the model"):
        resume.check_model_fits(shapes, CharGPT(layers=2, width=64, heads=2), "ckpt")
    with pytest.raises(CheckpointError, match="missing from the checkpoint: blocks.2"):
        resume.check_model_fits(shapes, CharGPT(layers=3, width=32, heads=2), "ckpt")


def test_a_corrupt_shard_is_a_checkpoint_error_not_a_crash(tmp_path):
    trained().save(tmp_path / "ckpt", OneProcess(), {}, distributed=False).wait()
    shard = next((tmp_path / "ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot be read"):
        trained().load(tmp_path / "ckpt", OneProcess(), seed=0, distributed=False, load_optimizer=lambda load: load())


def test_an_earlier_versions_single_file_checkpoint_still_resumes_unsharded(tmp_path):
    saved = trained()
    directory = tmp_path / "checkpoint_old"
    directory.mkdir()
    state = {
        "model": saved.weights(),
        "optimizer": saved.optimizer.state_dict(),
        "scaler": saved.scaler.state_dict(),
        "rng": [],
        "position": {"epoch": 1, "step": 7},
    }
    torch.save(state, directory / "state.pt")
    (directory / "position.json").write_text(json.dumps(state["position"]))
    assert checkpoints.checkpoint_dirs(tmp_path) == [directory]
    fresh = trained(seed=3)
    fresh.load(directory, OneProcess(), seed=0, distributed=False, load_optimizer=lambda load: load())
    assert all(torch.equal(a, b) for a, b in zip(saved.weights().values(), fresh.weights().values()))
    fresh.holding = holding.Fsdp()
    with pytest.raises(CheckpointError, match="resume it with --strategy ddp"):
        fresh.load(directory, OneProcess(), seed=0, distributed=False, load_optimizer=lambda load: load())


def test_the_checkpoint_is_complete_only_once_its_train_state_is_written(tmp_path):
    directory = tmp_path / "checkpoint_x"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"")
    (directory / "position.json").write_text("{}")
    assert not checkpoints.is_complete(directory)
    (directory / "train_state.pt").write_bytes(b"")
    assert checkpoints.is_complete(directory)
    assert checkpoints.checkpoint_dirs(tmp_path) == [directory]
    assert not checkpoints.is_complete(Path(tmp_path / "missing"))


def test_unsharded_ranks_each_write_a_balanced_part_that_together_is_the_whole():
    state = trained()
    full = state._dcp_state()
    parts = [state._dcp_part(rank, 3) for rank in range(3)]
    # rank 0 writes the whole model: it reads model.pt back from its own file (other ranks'
    # files may be on other nodes, under an object store)
    assert [set(part["model"]) for part in parts] == [set(full["model"]), set(), set()]
    optim_keys = [set(part["optim"]["state"]) for part in parts]
    assert set().union(*optim_keys) == set(full["optim"]["state"])
    assert sum(map(len, optim_keys)) == len(full["optim"]["state"])
    assert [("param_groups" in part["optim"]) for part in parts] == [True, False, False]

    def nbytes(part):
        tensors = [*part["model"].values(), *(v for s in part["optim"]["state"].values() for v in s.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    sizes = sorted(nbytes(part) for part in parts)
    assert sizes[-1] <= 1.5 * sizes[0]  # balanced by bytes
    keys = [set(part["optim"]["state"]) for part in parts]
    assert [set(p["optim"]["state"]) for p in (state._dcp_part(r, 3) for r in range(3))] == keys  # the same every time


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_reshards_the_blocks_as_asked_and_leaves_the_root_to_its_default(one_rank_group, reshard):
    from torch.distributed.fsdp import fully_shard

    tower = Tower()
    cfg = TrainConfig(strategy="fsdp", workers=2, fsdp_reshard_after_forward=reshard)
    model = strategy.shard(tower, list(tower.layers), cfg)
    model(torch.ones(2, 4)).sum().backward()  # the root is found, and set, at the first forward

    def resharded(module) -> bool:
        return fully_shard.state(module)._fsdp_param_group.post_forward_mesh_info is not None

    assert [resharded(block) for block in tower.layers] == [reshard] * len(tower.layers)
    assert not resharded(model)  # its backward starts at once: FSDP2 keeps the root's parameters
