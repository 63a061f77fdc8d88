"""The `hf-causal-lm` pipeline: a local Hugging Face causal LM, text packed into blocks."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from pipelines.hf import common
from raytrain.errors import DataError


@dataclass
class CausalLMArgs:
    """--pipeline-arg options of the hf-causal-lm pipeline."""

    model: str
    """A local directory holding the model's config.json, with or without weights (without: built from the config)."""
    train: str
    """Training text: .txt, .jsonl or .parquet files (a file or a directory), or a save_to_disk directory."""
    val: str | None = None
    """Validation text, the same kinds."""
    tokenizer: str | None = None
    """A local tokenizer directory (default: the model's directory)."""
    text_column: str = "text"
    """The column holding the text (a .txt file's lines are `text`)."""
    block_size: int = 128
    """Tokens per training row: the tokenized text is concatenated and cut into blocks of this many."""

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"--pipeline-arg block_size: got {self.block_size}; at least 2 tokens")
        self.model = common.local_directory("model", self.model, ("config.json",))
        self.tokenizer = common.local_directory("tokenizer", self.tokenizer or self.model, common.TOKENIZER_FILES)
        self.train = common.local_input("train", self.train)
        self.val = common.local_input("val", self.val) if self.val else None


def pack_blocks(batch: dict, *, tokenizer: str, column: str, block_size: int) -> dict:
    """One Ray Data batch of text as rows of `block_size` token ids: tokenized, concatenated and
    cut into blocks, the remainder dropped (HF's `group_texts` over each batch of 1,000 rows)."""
    ids = common.tokenizer_at(tokenizer)([str(text) for text in batch[column]])["input_ids"]
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64)
    blocks = len(flat) // block_size
    return {"input_ids": flat[: blocks * block_size].reshape(blocks, block_size)}


def tokenized(path: str, option: str, spec: CausalLMArgs):
    """The rows at `path` as blocks of token ids, computed once in Ray Data (map_batches) and
    kept: packing changes the number of rows, which the workers' shares are cut by."""
    ds = common.read_input(path, option)
    common.check_column(ds, spec.text_column, "text_column", path)
    packed = ds.map_batches(
        pack_blocks,
        fn_kwargs={"tokenizer": spec.tokenizer, "column": spec.text_column, "block_size": spec.block_size},
        batch_size=common.TOKENIZE_BATCH_ROWS,
        batch_format="numpy",
    ).materialize()
    if not packed.count():
        raise DataError(
            f"--pipeline-arg {option}={path}: its text makes no block of {spec.block_size} tokens; give more text or "
            "a smaller --pipeline-arg block_size"
        )
    return packed


class HFCausalLMPipeline(common.HFPipeline):
    """A Hugging Face `AutoModelForCausalLM` from a local directory, trained on packed text."""

    default_config = {"epochs": 3, "batch_size_per_worker": 8, "lr": 5e-4, "warmup_epochs": 0.1, "weight_decay": 0.01}
    Args = CausalLMArgs

    def prepare(self, path, split, spec):
        return tokenized(path, split, spec)

    def build_model(self, cfg):
        return common.load_model("AutoModelForCausalLM", self.args(cfg).model)

    def compute_loss(self, model, batch):
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss  # the model shifts the labels by one itself

    @property
    def name(self) -> str:
        return "hf-causal-lm"
