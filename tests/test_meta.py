"""The model built on the meta device and filled shard by shard (`raytrain.meta`), no Ray:
building on meta reads nothing; the rows a rank reads are exactly its rows of the weights;
tied weights stay tied; fresh weights depend on the seed only, not on the worker count."""

from __future__ import annotations

import pytest
import torch

from raytrain import meta


def test_a_model_built_on_meta_has_shapes_and_no_storage():
    seen = []

    def build():
        seen.append(meta.on_meta())
        return torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.LayerNorm(1000))

    model = meta.build_on_meta(build)
    assert seen == [True] and not meta.on_meta()
    assert meta.is_meta(model) and model[0].weight.shape == (1000, 1000)
    assert not meta.is_meta(torch.nn.Linear(2, 2))


def test_a_plain_tensor_is_held_whole():
    assert meta.local_index(torch.zeros(3, 5)) == (slice(0, 3), slice(0, 5))


def test_weight_files_read_only_the_rows_asked_for_from_safetensors_and_bin(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.arange(40.0).reshape(8, 5), "b": torch.arange(3.0)}
    save_file(tensors, tmp_path / "model.safetensors")
    other = tmp_path / "bin"
    other.mkdir()
    torch.save(tensors, other / "pytorch_model.bin")
    for directory in (tmp_path, other):
        files = meta.WeightFiles(directory)
        assert files.has("a.weight") and not files.has("c")
        assert torch.equal(files.read("a.weight", (slice(3, 6), slice(0, 5))), tensors["a.weight"][3:6])
    assert not meta.WeightFiles(tmp_path / "nothing")


def test_fill_writes_tied_parameters_once_and_takes_what_the_source_lacks_from_the_fallback():
    class Table:
        def __init__(self, values):
            self.values = values

        def has(self, name):
            return name in self.values

        def read(self, name, index):
            return self.values[name][index]

    embed = torch.nn.Embedding(4, 3)
    head = torch.nn.Linear(3, 4, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    weights = Table({"embed.weight": torch.ones(4, 3)})
    fresh = Table({"embed.weight": torch.zeros(4, 3), "head.weight": torch.zeros(4, 3)})
    read = meta.fill(model, weights, fallback=fresh)
    assert read == {"source": ["embed.weight"], "fallback": []}
    assert model["head"].weight is model["embed"].weight and torch.equal(model["head"].weight, torch.ones(4, 3))
    with pytest.raises(KeyError, match="embed.weight: in neither"):
        meta.fill(model, Table({}))


def test_fresh_units_are_seeded_by_the_seed_and_the_unit_only():
    template = meta.build_on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    every = (slice(0, 4), slice(0, 4))
    first = meta.UnitInit(template, ["0", "1"], None, seed=3)
    again = meta.UnitInit(template, ["0", "1"], None, seed=3)
    # the order in which units are asked for does not change their values
    assert torch.equal(first.read("1.weight", every), again.read("1.weight", every))
    assert torch.equal(first.read("0.weight", every), again.read("0.weight", every))
    assert not torch.equal(first.read("0.weight", every), first.read("1.weight", every))
    assert not torch.equal(
        meta.UnitInit(template, ["0", "1"], None, seed=4).read("0.weight", every), first.read("0.weight", every)
    )
    assert meta.is_meta(template)  # the template keeps no storage


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """tests/meta_ranks.py at 1 and at 2 processes over gloo: {world size: what rank 0 saved}."""
    pytest.importorskip("transformers")
    from hf_fixtures import make_model
    from ranks import run_ranks

    root = tmp_path_factory.mktemp("meta")
    make_model(root / "weights", "gpt2")
    make_model(root / "config", "gpt2", weights=False)
    runs = {}
    for world in (1, 2):
        out = root / f"ranks{world}.pt"
        run_ranks("meta_ranks.py", root / "weights", root / "config", out, ranks=world)
        runs[world] = torch.load(out, weights_only=False)
    return root, runs


@pytest.mark.slow
def test_each_rank_reads_exactly_its_rows_of_the_weights_and_tied_weights_stay_tied(gloo_runs):
    from transformers import AutoModelForCausalLM

    root, runs = gloo_runs
    whole = AutoModelForCausalLM.from_pretrained(root / "weights").state_dict()
    for world, run in runs.items():
        assert run["weights"]["rows_match"] and run["weights"]["tied"]
        assert run["weights"]["local_rows"] == 300 // world  # the 300-row embedding, halved at 2
        for name, value in whole.items():
            assert torch.equal(run["weights"]["full"][name], value), (world, name)


@pytest.mark.slow
def test_fresh_weights_depend_on_the_seed_only_not_on_the_worker_count(gloo_runs):
    from transformers import AutoConfig, AutoModelForCausalLM

    root, runs = gloo_runs
    one, two = runs[1], runs[2]
    assert two["fresh"]["tied"]
    for name, value in one["fresh"]["full"].items():
        assert torch.equal(two["fresh"]["full"][name], value), name
        assert torch.equal(one["fresh_again"][name], value), name
    assert not torch.equal(
        one["fresh_other_seed"]["transformer.wte.weight"], one["fresh"]["full"]["transformer.wte.weight"]
    )
    # HF's own init rule: norms at one, biases at zero, GPT-2's residual projections at a smaller std
    fresh = one["fresh"]["full"]
    assert torch.equal(fresh["transformer.h.0.ln_1.weight"], torch.ones(32))
    assert torch.equal(fresh["transformer.h.0.attn.c_attn.bias"], torch.zeros(96))
    assert fresh["transformer.h.0.attn.c_proj.weight"].std() < 0.8 * fresh["transformer.h.0.mlp.c_fc.weight"].std()
    # not the numbers a model built whole with the same seed draws (one stream in build order)
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "config")).state_dict()
    assert not torch.equal(built["transformer.wte.weight"], fresh["transformer.wte.weight"])
