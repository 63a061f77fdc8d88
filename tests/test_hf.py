"""Pure tier: the Hugging Face pipelines' rules — local directories only (nothing downloaded),
the install command when the packages are missing, packing into blocks, encoding rows, weight
decay off for biases and norms, the blocks --strategy fsdp shards, `datasets` values accepted
from build_datasets."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from raytrain.errors import PipelineError
from raytrain.pipeline import default_blocks, load_pipeline, parse_pipeline_args

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from hf_fixtures import make_model, make_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    make_tokenizer(root / "tokenizer")
    for family in ("gpt2", "llama", "bert"):
        make_model(root / family, family)
    make_model(root / "gpt2-config", "gpt2", weights=False)
    (root / "train.txt").write_text("def f(x):\n    return x\n")
    return root


def test_a_model_name_that_would_need_a_download_is_refused_naming_a_local_directory(hf_dir):
    pipe = load_pipeline("hf-causal-lm")
    with pytest.raises(PipelineError, match="model=gpt2 is not a local directory.*never downloads.*model=DIR"):
        parse_pipeline_args(pipe, {"model": "gpt2", "train": str(hf_dir / "train.txt")})
    with pytest.raises(PipelineError, match="tokenizer=.*gpt2-config is a directory without tokenizer.json"):
        parse_pipeline_args(pipe, {"model": str(hf_dir / "gpt2-config"), "train": str(hf_dir / "train.txt")})
    spec = parse_pipeline_args(
        pipe, {"model": hf_dir / "gpt2", "tokenizer": hf_dir / "tokenizer", "train": hf_dir / "train.txt"}
    )
    assert spec.model == str(hf_dir / "gpt2") and spec.block_size == 128


def test_without_the_hf_packages_an_hf_pipeline_is_exit_2_naming_the_install_command(monkeypatch, capsys):
    from raytrain.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    status = main(["train", "hf-classification", "--pipeline-arg", "model=m", "--pipeline-arg", "train=t"])
    assert status == 2
    assert "needs transformers, not installed here: pip install 'raytrain[hf]'" in capsys.readouterr().err


def test_text_is_packed_into_blocks_of_block_size_as_group_texts_does(hf_dir):
    from pipelines.hf.causal_lm import pack_texts
    from pipelines.hf.common import tokenizer_at

    texts = ["import os", "def main(argv):", "    return 0", "x = [i for i in range(10)]"]
    out = pack_texts(texts, tokenizer=str(hf_dir / "tokenizer"), block_size=4)
    ids = [i for text in texts for i in tokenizer_at(str(hf_dir / "tokenizer"))(text)["input_ids"]]
    assert out.shape == (len(ids) // 4, 4) and out.dtype == np.int64
    assert out.reshape(-1).tolist() == ids[: len(ids) // 4 * 4]  # the remainder is dropped


def test_rows_are_grouped_from_the_first_row_wherever_the_blocks_are_cut():
    from pipelines.hf.causal_lm import row_groups

    assert row_groups([0, 5, 0, 3], 4) == [[(1, 0, 4)], [(1, 4, 5), (3, 0, 3)]]
    assert row_groups([4, 4], 4) == [[(0, 0, 4)], [(1, 0, 4)]]
    assert row_groups([2, 1, 1], 4) == [[(0, 0, 2), (1, 0, 1), (2, 0, 1)]]
    assert row_groups([], 4) == [] and row_groups([0, 0], 4) == []


def test_the_packed_blocks_are_the_same_however_the_text_is_cut_into_blocks(hf_dir):
    """Ray Data cuts a read into blocks by the cluster's CPUs (2 per CPU for one text file): at
    2 workers and at 3 the same text came in 8 and 10 blocks. The blocks packed from it must not
    change with that, or a checkpoint could not resume at another worker count."""
    from hf_fixtures import stdlib_text

    from pipelines.hf.causal_lm import pack_groups, pack_texts, row_groups

    lines = stdlib_text(200_000)[:2_500]
    tokenizer = str(hf_dir / "tokenizer")
    # HF's run_clm: every 1,000 rows from the first concatenated and cut on their own
    expected = np.concatenate(
        [pack_texts(lines[i : i + 1000], tokenizer=tokenizer, block_size=32) for i in (0, 1000, 2000)]
    )
    rng = np.random.default_rng(0)
    layouts = [
        [2_500],
        [313] * 7 + [309],
        [1, 999, 0, 1, 1499],
        list(np.diff([0, *sorted(rng.choice(2_499, 40, replace=False) + 1), 2_500])),
    ]
    for rows in layouts:
        bounds = np.cumsum([0, *rows])
        columns = [lines[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
        packed = pack_groups(row_groups(rows, 1000), columns, tokenizer=tokenizer, block_size=32)
        assert packed.dtype == np.int64 and np.array_equal(packed, expected), rows
    assert pack_groups([], [], tokenizer=tokenizer, block_size=32).shape == (0, 32)


def test_classification_rows_are_truncated_or_padded_to_block_size_one_row_out_per_row_in(hf_dir):
    from pipelines.hf.classification import encode_rows

    batch = {"text": np.array(["a", "def f(x): return x * 2 + 1  # long enough to be cut"]), "y": np.array([1, 0])}
    out = encode_rows(batch, tokenizer=str(hf_dir / "tokenizer"), column="text", label="y", block_size=6, num_labels=2)
    assert out["input_ids"].shape == out["attention_mask"].shape == (2, 6)
    assert out["attention_mask"][0].tolist() == [1, 0, 0, 0, 0, 0] and out["attention_mask"][1].all()
    assert out["label"].tolist() == [1, 0]


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_weight_decay_is_off_for_biases_and_norms_only(hf_dir, family):
    from pipelines.hf.common import decay_groups, load_model

    auto = "AutoModelForSequenceClassification" if family == "bert" else "AutoModelForCausalLM"
    model = load_model(auto, str(hf_dir / family))
    decayed, plain = decay_groups(model, 0.1)
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    # the norms as each family names them: GPT-2's ln_1/ln_2/ln_f, Llama's *_layernorm and norm, BERT's LayerNorm
    exempt = re.compile(r"bias$|(^|\.)ln_|layernorm|\.norm\.", re.IGNORECASE)
    assert all(exempt.search(names[id(p)]) for p in plain["params"])
    assert not any(exempt.search(names[id(p)]) for p in decayed["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert any("embed" in names[id(p)] or "wte" in names[id(p)] for p in decayed["params"])  # as HF's examples


def test_a_model_directory_without_weights_is_built_from_its_config(hf_dir):
    import torch

    from pipelines.hf.common import has_weights, load_model

    assert not has_weights(str(hf_dir / "gpt2-config")) and has_weights(str(hf_dir / "gpt2"))
    saved, fresh = (
        load_model("AutoModelForCausalLM", str(hf_dir / "gpt2")),
        load_model("AutoModelForCausalLM", str(hf_dir / "gpt2-config")),
    )
    again = load_model("AutoModelForCausalLM", str(hf_dir / "gpt2"))
    assert saved.state_dict().keys() == fresh.state_dict().keys()
    assert torch.equal(saved.transformer.h[0].attn.c_attn.weight, again.transformer.h[0].attn.c_attn.weight)


@pytest.mark.parametrize(
    "family, auto, blocks",
    [
        ("gpt2", "AutoModelForCausalLM", ["transformer.h.0", "transformer.h.1"]),
        ("llama", "AutoModelForCausalLM", ["model.layers.0", "model.layers.1"]),
        ("bert", "AutoModelForSequenceClassification", ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
    ],
)
def test_fsdp_shards_each_decoder_or_encoder_layer_of_the_common_families_by_default(hf_dir, family, auto, blocks):
    from pipelines.hf.common import load_model

    model = load_model(auto, str(hf_dir / family))
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(block)] for block in default_blocks(model)] == blocks


def test_build_datasets_may_return_datasets_a_dataset_dict_or_a_split_each_but_not_a_stream():
    import datasets

    from raytrain.hooks import HOOKS

    check = HOOKS["build_datasets"].check
    split = datasets.Dataset.from_dict({"x": [1.0, 2.0]})
    assert check(datasets.DatasetDict(train=split, validation=split, test=split), None) is None
    assert check({"train": split}, None) is None
    assert "'train'" in check(datasets.DatasetDict(validation=split), None)
    streamed = split.to_iterable_dataset()
    assert "streaming datasets.IterableDataset" in check({"train": streamed}, None)


def run_of(directory, pipeline: str, pipeline_args: dict, weights: dict):
    """A run directory as a finished run leaves it, for export: config.yaml and model.pt."""
    import torch
    import yaml

    directory.mkdir()
    (directory / "config.yaml").write_text(yaml.safe_dump({"pipeline": pipeline, "pipeline_args": pipeline_args}))
    torch.save(weights, directory / "model.pt")
    return directory


def test_export_format_hf_writes_a_directory_from_pretrained_loads_without_missing_keys(hf_dir, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.hf.common import load_model
    from raytrain.cli import main

    trained = load_model("AutoModelForCausalLM", str(hf_dir / "gpt2-config")).state_dict()  # other weights
    args = {"model": str(hf_dir / "gpt2"), "tokenizer": str(hf_dir / "tokenizer"), "train": str(hf_dir / "train.txt")}
    run = run_of(tmp_path / "run", "hf-causal-lm", args, {f"module.{k}": v for k, v in trained.items()})
    assert main(["export", str(run), "--format", "hf", "-o", str(tmp_path / "out")]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())  # the run's, not the directory's
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("x = 1")["input_ids"]


def test_export_format_hf_of_a_model_that_is_not_a_pretrained_model_is_exit_2(tmp_path, capsys):
    from pipelines.digits.model import DigitsCNN
    from raytrain.cli import main

    run = run_of(tmp_path / "run", "digits", {}, DigitsCNN().state_dict())
    assert main(["export", str(run), "--format", "hf", "-o", str(tmp_path / "out")]) == 2
    assert "not a transformers PreTrainedModel; export it as a state_dict" in capsys.readouterr().err


def copy_of(directory, to):
    import shutil

    return shutil.copytree(directory, to)


def test_a_damaged_safetensors_file_is_named_before_ray_starts(hf_dir, tmp_path, capsys):
    from raytrain.cli import main

    pipe = load_pipeline("hf-causal-lm")
    args = {"tokenizer": str(hf_dir / "tokenizer"), "train": str(hf_dir / "train.txt")}
    truncated = copy_of(hf_dir / "gpt2", tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(
        PipelineError, match=r"truncated/model.safetensors is damaged: its tensors end at byte .*\(truncated\)"
    ):
        parse_pipeline_args(pipe, {"model": truncated, **args})
    garbage = copy_of(hf_dir / "gpt2", tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)  # "header too large" in safetensors' own words
    status = main(
        [
            "train",
            "hf-causal-lm",
            "--pipeline-arg",
            f"model={garbage}",
            *[f"--pipeline-arg={k}={v}" for k, v in args.items()],
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert re.search(r"garbage/model.safetensors is damaged: its header says [\d,]+ bytes, the file holds 64", err)
    assert "save the model there again with save_pretrained" in err


def test_a_tokenizer_with_more_ids_than_the_models_embedding_is_refused(hf_dir, tmp_path):
    make_tokenizer(tmp_path / "big", vocab_size=2_000)
    for name in ("hf-causal-lm", "hf-classification"):
        model = hf_dir / ("gpt2" if name == "hf-causal-lm" else "bert")
        with pytest.raises(
            PipelineError,
            match=r"tokenizer=.*big has [\d,]+ token ids, but the model at .* has vocab_size 300 .*resize_token_embed",
        ):
            parse_pipeline_args(
                load_pipeline(name), {"model": model, "tokenizer": tmp_path / "big", "train": hf_dir / "train.txt"}
            )


def test_block_size_beyond_the_models_positions_is_refused(hf_dir):
    for name, model in (("hf-causal-lm", "gpt2"), ("hf-causal-lm", "llama"), ("hf-classification", "bert")):
        args = {"model": hf_dir / model, "tokenizer": hf_dir / "tokenizer", "train": hf_dir / "train.txt"}
        with pytest.raises(
            PipelineError,
            match="block_size=129: the model at .* has max_position_embeddings 128 .*block_size=128 or less",
        ):
            parse_pipeline_args(load_pipeline(name), {**args, "block_size": 129})
        assert parse_pipeline_args(load_pipeline(name), {**args, "block_size": 128}).block_size == 128


def test_a_causal_lm_on_an_encoder_is_refused_unless_its_config_says_is_decoder(hf_dir, tmp_path):
    import json

    pipe = load_pipeline("hf-causal-lm")
    args = {"tokenizer": hf_dir / "tokenizer", "train": hf_dir / "train.txt"}
    with pytest.raises(
        PipelineError,
        match=r"is a bert model, an encoder: as a causal LM \(BertLMHeadModel\).*hf-classification.*is_decoder",
    ):
        parse_pipeline_args(pipe, {"model": hf_dir / "bert", **args})
    with pytest.raises(
        PipelineError, match="an encoder.*; --pipeline-arg block_size=200"
    ):  # every problem in one message
        parse_pipeline_args(pipe, {"model": hf_dir / "bert", "block_size": 200, **args})
    decoder = copy_of(hf_dir / "bert", tmp_path / "bert-decoder")
    config = json.loads((decoder / "config.json").read_text())
    (decoder / "config.json").write_text(json.dumps({**config, "is_decoder": True}))
    assert parse_pipeline_args(pipe, {"model": decoder, **args}).model == str(decoder)


def test_an_empty_or_binary_text_file_is_refused_naming_it(hf_dir, tmp_path):
    pipe = load_pipeline("hf-causal-lm")
    args = {"model": hf_dir / "gpt2", "tokenizer": hf_dir / "tokenizer"}
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(
        PipelineError, match=r"train=.*empty.txt is empty \(0 bytes\); give a file or directory with rows"
    ):
        parse_pipeline_args(pipe, {**args, "train": tmp_path / "empty.txt"})
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("print(1)\n")
    (tmp_path / "texts" / "b.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")  # an image named .txt
    with pytest.raises(PipelineError, match=r"b.txt is not UTF-8 text \(byte 0 is b'\\x89'\).*iconv"):
        parse_pipeline_args(pipe, {**args, "train": tmp_path / "texts"})
    (tmp_path / "texts" / "b.txt").write_text("café = 'ünïcode'\n")
    assert parse_pipeline_args(pipe, {**args, "train": tmp_path / "texts"}).train == str(tmp_path / "texts")


def test_export_format_hf_after_the_model_directory_moved_takes_pipeline_arg(hf_dir, tmp_path, capsys):
    from pipelines.hf.common import load_model
    from raytrain.cli import main

    trained = load_model("AutoModelForCausalLM", str(hf_dir / "gpt2")).state_dict()
    before = copy_of(hf_dir / "gpt2", tmp_path / "before")
    args = {"model": str(before), "tokenizer": str(hf_dir / "tokenizer"), "train": str(hf_dir / "train.txt")}
    run = run_of(tmp_path / "run", "hf-causal-lm", args, trained)
    after = before.rename(tmp_path / "after")
    assert main(["export", str(run), "--format", "hf", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "before is not a local directory holding config.json" in err and "Traceback" not in err
    assert "raytrain export takes --pipeline-arg KEY=VALUE too, over the run's own" in err
    assert not (tmp_path / "out").exists()
    again = ["export", str(run), "--format", "hf", "-o", str(tmp_path / "out"), "--pipeline-arg", f"model={after}"]
    assert main(again) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert main(["export", str(run), "-o", str(tmp_path / "m.pt"), "--pipeline", "hf-causal-lm", *again[-2:]]) == 0


def test_export_format_hf_refuses_a_prefix_or_a_directory_that_holds_files_alike(hf_dir, tmp_path, s3, bucket, capsys):
    from pipelines.hf.common import load_model
    from raytrain.cli import main

    trained = load_model("AutoModelForCausalLM", str(hf_dir / "gpt2")).state_dict()
    args = {"model": str(hf_dir / "gpt2"), "tokenizer": str(hf_dir / "tokenizer"), "train": str(hf_dir / "train.txt")}
    run = str(run_of(tmp_path / "run", "hf-causal-lm", args, trained))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    s3.client().put_object(Bucket=bucket, Key="exports/taken/config.json", Body=b"{}")
    for out, kind in ((str(tmp_path / "taken"), "directory"), (s3.uri(bucket, "exports/taken"), "prefix")):
        assert main(["export", run, "--format", "hf", "-o", out]) == 2
        assert (
            f"holds files already (config.json); give a new or empty {kind} for --format hf" in capsys.readouterr().err
        )
    assert list(s3.objects(bucket, "exports/taken/")) == ["exports/taken/config.json"]  # nothing written into it
    assert main(["export", run, "--format", "hf", "-o", s3.uri(bucket, "exports/new")]) == 0
    assert "exports/new/model.safetensors" in s3.objects(bucket, "exports/new/")


def test_a_label_out_of_range_or_missing_is_named_with_its_row(hf_dir):
    from pipelines.hf.classification import encode_rows
    from raytrain.errors import DataError

    def encode(labels):
        texts = np.array([f"row {i}" for i in range(len(labels))], dtype=object)
        batch = {"text": texts, "label": labels}
        return encode_rows(
            batch, tokenizer=str(hf_dir / "tokenizer"), column="text", label="label", block_size=4, num_labels=2
        )

    assert encode(np.array([0, 1, 1])).get("label").tolist() == [0, 1, 1]
    for labels, value in ((np.array([0, 7, 1]), 7), (np.array([0, 1, -1]), -1)):
        with pytest.raises(
            DataError,
            match=rf"label_column=label: a row has label {value} \(text 'row \d'\), "
            rf"but the model has 2 classes, 0 to 1 \(num_labels\).*num_labels=N",
        ):
            encode(labels)
    for missing in (np.array([1.0, np.nan, 0.0]), np.array([1, None, None], dtype=object)):
        with pytest.raises(
            DataError, match=r"label_column=label: \d row\(s\) have no label \(the first: text 'row 1'\)"
        ):
            encode(missing)
