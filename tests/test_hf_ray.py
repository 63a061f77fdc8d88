"""CPU Ray tier: the Hugging Face pipelines end to end on tiny models made in the test (no
download), `raytrain export --format hf` loaded back with from_pretrained (from a run directory
and from an object store's URI), packed blocks each trained once with a rank killed, the same
blocks after a resume at 3 workers and at 1, and `datasets` values returned by build_datasets."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
import torch
from rt_test_pipelines import read_jsonl

import raytrain

pytestmark = pytest.mark.ray

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from hf_fixtures import RecordingCausalLM, make_model, make_tokenizer, stdlib_text  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    make_tokenizer(root / "tokenizer")
    make_model(root / "gpt2-config", "gpt2", weights=False)
    make_model(root / "gpt2-config-weights", "gpt2")
    make_model(root / "bert", "bert")
    lines = stdlib_text(40_000)
    (root / "train.txt").write_text("\n".join(lines[:800]))
    (root / "val.jsonl").write_text(
        "".join(json.dumps({"text": line, "n": i}) + "\n" for i, line in enumerate(lines[800:1000]))
    )
    return root


def exported_strict(export_args: list[str], trained: dict):
    """`raytrain export … --format hf` exits 0 and `from_pretrained` loads the directory with no
    key missing or unexpected and the weights of the run's `model.pt`; returns that model."""
    from transformers import AutoModelForCausalLM

    from raytrain.cli import main

    assert main(export_args) == 0
    out = export_args[export_args.index("-o") + 1]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert all(torch.equal(model.state_dict()[key], value) for key, value in trained.items())
    return model


def test_a_causal_lm_from_a_config_trains_under_fsdp_and_exports_a_pretrained_directory(
    ray_session, hf_dir, tmp_path, make_config
):
    from transformers import AutoTokenizer

    cfg = make_config(
        workers=2,
        max_steps=4,
        strategy="fsdp",
        name="clm",
        pipeline_args={
            "model": str(hf_dir / "gpt2-config"),
            "tokenizer": str(hf_dir / "tokenizer"),
            "train": str(hf_dir / "train.txt"),
            "val": str(hf_dir / "val.jsonl"),
            "block_size": 32,
        },
    )
    result = raytrain.fit("hf-causal-lm", cfg)
    assert (result.summary["status"], result.summary["steps"]) == ("finished", 4)
    plan = read_jsonl(tmp_path / "clm" / "events.jsonl")[0]["message"]
    assert "the pipeline's build_optimizer (AdamW, 2 groups)" in plan and "fsdp" in plan
    rows = read_jsonl(tmp_path / "clm" / "metrics.jsonl")
    assert rows[-1]["val_loss"] < 6.0  # below the uniform guess over the 300 tokens, ln 300 = 5.70 + a margin

    out = tmp_path / "exported"
    trained = torch.load(tmp_path / "clm" / "model.pt", weights_only=True)
    exported_strict(["export", str(tmp_path / "clm"), "--format", "hf", "-o", str(out)], trained)
    assert AutoTokenizer.from_pretrained(out)("def f")["input_ids"]  # the run's tokenizer, beside the model


def test_a_classifier_trains_on_a_saved_dataset_and_build_datasets_may_return_a_dataset_dict(
    ray_session, hf_dir, tmp_path, make_config
):
    import datasets

    from raytrain.data.sources import build_datasets

    lines = stdlib_text(40_000)[:600]
    rows = {"text": lines, "label": [int(line.lstrip().startswith(("def ", "class "))) for line in lines]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(hf_dir / "saved"))
    datasets.Dataset.from_dict({k: v[:100] for k, v in rows.items()}).to_parquet(str(hf_dir / "val.parquet"))
    cfg = make_config(
        workers=2,
        max_steps=4,
        name="cls",
        pipeline_args={
            "model": str(hf_dir / "bert"),
            "tokenizer": str(hf_dir / "tokenizer"),
            "train": str(hf_dir / "saved"),
            "val": str(hf_dir / "val.parquet"),
            "block_size": 24,
        },
    )
    result = raytrain.fit("hf-classification", cfg)
    assert (result.summary["status"], result.summary["steps"]) == ("finished", 4)
    assert 0 <= read_jsonl(tmp_path / "cls" / "metrics.jsonl")[-1]["val_accuracy"] <= 1

    class FromDatasets(raytrain.Pipeline):
        def build_datasets(self, cfg):
            whole = datasets.Dataset.from_dict({"x": [[float(i)] for i in range(10)], "y": list(range(10))})
            split = whole.train_test_split(test_size=0.3, shuffle=False)
            return datasets.DatasetDict(train=split["train"], validation=split["test"], test=split["test"])

    DatasetDict = datasets.DatasetDict
    assert isinstance(FromDatasets().build_datasets(None), DatasetDict)
    converted = build_datasets(FromDatasets(), raytrain.TrainConfig())
    assert sorted(converted) == ["train", "val"]
    assert [converted["train"].count(), converted["val"].count()] == [7, 3]
    assert converted["val"].take_batch(3, batch_format="numpy")["y"].tolist() == [7, 8, 9]


def test_packed_blocks_each_trained_once_with_a_rank_killed_then_exported_from_the_bucket(
    ray_session, hf_dir, s3, bucket, tmp_path
):
    """Rank 0's process SIGKILLed mid-epoch: the run resumes from the last checkpoint in the
    bucket and every packed block of the epoch is trained exactly once; `export --format hf`
    from the run's URI then loads with from_pretrained, no key missing or unexpected."""

    records = tmp_path / "records"
    records.mkdir()
    lines = stdlib_text(40_000)[:200]
    # A line number in front of every line makes every 32-token block distinct, so that a block's
    # key names one block.
    (tmp_path / "numbered.txt").write_text("\n".join(f"{i} {line}" for i, line in enumerate(lines)))
    cfg = raytrain.TrainConfig(
        workers=2,
        epochs=1,
        batch_size_per_worker=8,
        max_failures=1,
        checkpoint_every_steps=3,
        log_every_steps=3,
        storage=s3.uri(bucket, "runs"),
        name="killed",
        pipeline_args={
            "model": str(hf_dir / "gpt2-config"),
            "tokenizer": str(hf_dir / "tokenizer"),
            "train": str(tmp_path / "numbered.txt"),
            "block_size": 32,
        },
    )
    # The pace lets rank 0's buffered log lines (the plan among them) reach the bucket before the
    # kill, and the step-6 checkpoint's upload usually finish.
    pipeline = RecordingCausalLM(str(records), crash_at_step=8, step_sleep_s=0.4)
    summary = raytrain.fit(pipeline, cfg).summary
    assert summary["status"] == "finished" and summary["failures_recovered"] == 1
    builds = [json.loads(line) for line in (records / "blocks.jsonl").read_text().splitlines()]
    assert all(build == builds[0] for build in builds)  # a rebuilt training set packs the same blocks
    blocks = builds[0]
    assert len(set(blocks)) == len(blocks) and summary["steps"] == -(-len(blocks) // 16) > 8
    rows = [row for r in range(2) for row in read_jsonl(records / f"blocks-rank{r}.jsonl")]
    second = [row for row in rows if row["attempt"] == "second"]
    resumed_at = min(row["step"] for row in second)
    assert resumed_at in (3, 6)  # the last checkpoint complete in the bucket before the kill at step 8
    trained = [key for row in rows if row["attempt"] == "first" and row["step"] < resumed_at for key in row["blocks"]]
    trained += [key for row in second for key in row["blocks"]]
    assert Counter(trained) == Counter(blocks)

    out = tmp_path / "exported"
    run_uri = s3.uri(bucket, "runs/killed")
    trained_weights = torch.load(io.BytesIO(s3.read(bucket, "runs/killed/model.pt")), weights_only=True)
    exported_strict(
        ["export", run_uri, "--format", "hf", "-o", str(out), "--pipeline", "hf-causal-lm"], trained_weights
    )


def test_fsdp_fills_each_ranks_shards_from_the_weights_resumes_at_three_workers_and_at_one_and_exports(
    ray_session, hf_dir, tmp_path, make_config
):
    """Built on the meta device, each of 2 ranks reads its rows of the saved weights (marked
    with values no fresh init gives); resumed at 3 workers, then at 1, on the same packed
    blocks (3,000 rows of text: 3 groups of rows packed on their own, split by Ray Data into
    blocks by the cluster's CPUs), no block trained twice; exported and loaded strict."""
    from transformers import AutoModelForCausalLM

    marked = AutoModelForCausalLM.from_pretrained(hf_dir / "gpt2-config-weights")
    with torch.no_grad():
        marked.transformer.ln_f.bias.fill_(3.0)  # in the root's unit
        marked.transformer.h[1].ln_2.weight.fill_(2.0)  # in a block's
    marked.save_pretrained(tmp_path / "weights")
    # A line number in front of every line makes blocks distinct (a long line may still repeat one).
    lines = stdlib_text(200_000)[:3_000]
    (tmp_path / "numbered.txt").write_text("\n".join(f"{i} {line}" for i, line in enumerate(lines)))
    records = tmp_path / "records"
    records.mkdir()
    pipeline = RecordingCausalLM(str(records), crash_at_step=-1)
    base = {
        "max_steps": 2,
        "strategy": "fsdp",
        "lr": 1e-4,
        "name": "meta",
        "pipeline_args": {
            "model": str(tmp_path / "weights"),
            "tokenizer": str(hf_dir / "tokenizer"),
            "train": str(tmp_path / "numbered.txt"),
            "block_size": 32,
        },
    }
    first = raytrain.fit(pipeline, make_config(workers=2, **base))
    assert (first.summary["status"], first.summary["steps"]) == ("finished", 2)
    plan = read_jsonl(tmp_path / "meta" / "events.jsonl")[0]["message"]
    assert "built on the meta device" in plan
    trained = torch.load(tmp_path / "meta" / "model.pt", weights_only=True)
    # two AdamW steps at 1e-4 move a weight by about 2e-4: these are the file's values, not fresh ones
    assert torch.allclose(trained["transformer.ln_f.bias"], torch.full((32,), 3.0), atol=0.01)
    assert torch.allclose(trained["transformer.h.1.ln_2.weight"], torch.full((32,), 2.0), atol=0.01)
    assert torch.equal(trained["lm_head.weight"], trained["transformer.wte.weight"])  # still tied

    for workers, steps in ((3, 4), (1, 6)):
        resumed = raytrain.fit(pipeline, make_config(workers=workers, resume=True, **{**base, "max_steps": steps}))
        assert (resumed.summary["status"], resumed.summary["steps"]) == ("finished", steps)
    assert resumed.summary["world_sizes"] == [2, 3, 1]
    builds = [json.loads(line) for line in (records / "blocks.jsonl").read_text().splitlines()]
    assert len(builds) == 3 and all(build == builds[0] for build in builds)  # the same blocks at 2, 3 and 1
    blocks = Counter(builds[0])
    assert len(builds[0]) > 1_000
    rows = [
        row
        for r in range(3)
        if (records / f"blocks-rank{r}.jsonl").exists()
        for row in read_jsonl(records / f"blocks-rank{r}.jsonl")
    ]
    assert sorted({row["step"] for row in rows}) == [0, 1, 2, 3, 4, 5]
    trained_keys = [key for row in rows for key in row["blocks"]]
    assert len(trained_keys) == resumed.summary["samples_seen"] == 2 * 64 + 2 * 96 + 2 * 32  # 32 per worker a step
    assert not Counter(trained_keys) - blocks  # none trained more often than it is in the epoch

    out = tmp_path / "exported"
    final = torch.load(tmp_path / "meta" / "model.pt", weights_only=True)
    model = exported_strict(["export", str(tmp_path / "meta"), "--format", "hf", "-o", str(out)], final)
    assert model.lm_head.weight is model.transformer.wte.weight
