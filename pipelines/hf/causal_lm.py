"""The `hf-causal-lm` pipeline: a local Hugging Face causal LM, text packed into blocks."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np

from pipelines.hf import common
from raytrain.errors import DataError

# Consecutive rows whose text is concatenated and cut into blocks together, counted from the
# first row (HF's `group_texts` runs over `map`'s batches of 1,000 rows). Counted in rows, not
# in Ray Data's blocks or batches, whose boundaries follow the cluster's CPU count.
GROUP_ROWS = common.TOKENIZE_BATCH_ROWS
# Groups one Ray task tokenizes and packs (any number gives the same blocks).
GROUPS_PER_TASK = 8


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
        common.check_model(self.model, self.tokenizer, self.block_size, causal=True)


def pack_texts(texts, *, tokenizer: str, block_size: int) -> np.ndarray:
    """One group's texts as rows of `block_size` token ids: tokenized, concatenated and cut
    into blocks, the remainder dropped (HF's `group_texts` over one batch of `map`)."""
    ids = common.tokenizer_at(tokenizer)([str(text) for text in texts])["input_ids"]
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64)
    blocks = len(flat) // block_size
    return flat[: blocks * block_size].reshape(blocks, block_size)


def row_groups(block_rows: Sequence[int], group_rows: int) -> list[list[tuple[int, int, int]]]:
    """Rows cut into groups of `group_rows` consecutive rows counted from the first row (the
    last group may be shorter), each group as its pieces `(block, start, end)` in blocks of
    `block_rows` rows. Where the blocks are cut changes only how a group is named, never
    which rows it holds: that is what makes the packing independent of Ray Data's layout."""
    groups: list[list[tuple[int, int, int]]] = []
    group: list[tuple[int, int, int]] = []
    filled = 0
    for block, rows in enumerate(block_rows):
        start = 0
        while start < rows:
            end = min(rows, start + group_rows - filled)
            group.append((block, start, end))
            filled += end - start
            start = end
            if filled == group_rows:
                groups.append(group)
                group, filled = [], 0
    if group:
        groups.append(group)
    return groups


def pack_groups(
    groups: list[list[tuple[int, int, int]]], columns: Sequence[Sequence], *, tokenizer: str, block_size: int
):
    """The blocks of consecutive `groups`, each group packed on its own (`pack_texts`), in
    order; `columns[b]` is the text column of block `b` the pieces name."""
    packed = [
        pack_texts(
            list(chain.from_iterable(columns[block][start:end] for block, start, end in group)),
            tokenizer=tokenizer,
            block_size=block_size,
        )
        for group in groups
    ]
    return np.concatenate(packed) if packed else np.zeros((0, block_size), dtype=np.int64)


def _pack_task(groups, column: str, tokenizer: str, block_size: int, *blocks):
    """Ray task: `pack_groups` over the text column of `blocks` (the ones `groups` name, renumbered from 0)."""
    from ray.data.block import BlockAccessor

    columns = [BlockAccessor.for_block(block).to_numpy(column) for block in blocks]
    ids = pack_groups(groups, columns, tokenizer=tokenizer, block_size=block_size)
    return BlockAccessor.batch_to_block({"input_ids": ids})


def tokenized(path: str, option: str, spec: CausalLMArgs):
    """The rows at `path` as blocks of token ids, computed once and kept: packing changes the
    number of rows, which the workers' shares are cut by. The text is read in Ray Data, in
    the order of its rows, then grouped by `GROUP_ROWS` rows from the first (`row_groups`)
    and each run of `GROUPS_PER_TASK` groups tokenized and packed by a Ray task: the blocks
    are a function of the text, tokenizer and block_size alone, the same at any worker count
    and on any cluster (a checkpoint resumes at another size on the same blocks)."""
    import ray
    import ray.data

    from raytrain.data.shards import materialize_in_order

    ds = common.read_input(path, option)
    common.check_column(ds, spec.text_column, "text_column", path)
    text = materialize_in_order(ds.select_columns([spec.text_column]))
    blocks = [entry for bundle in text.iter_internal_ref_bundles() for entry in bundle.blocks]
    groups = row_groups([entry.metadata.num_rows for entry in blocks], GROUP_ROWS)
    pack = ray.remote(_pack_task)
    refs = []
    for first in range(0, len(groups), GROUPS_PER_TASK):
        run = groups[first : first + GROUPS_PER_TASK]
        used = sorted({block for group in run for block, _, _ in group})
        local = {block: i for i, block in enumerate(used)}
        renamed = [[(local[block], start, end) for block, start, end in group] for group in run]
        args = (spec.text_column, spec.tokenizer, spec.block_size)
        refs.append(pack.remote(renamed, *args, *[blocks[block].ref for block in used]))
    packed = ray.data.from_arrow_refs(refs) if refs else None
    if packed is None or not packed.count():
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
