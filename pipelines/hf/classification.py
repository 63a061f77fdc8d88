"""The `hf-classification` pipeline: a local Hugging Face sequence classifier over a text column."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipelines.hf import common
from raytrain.errors import DataError


@dataclass
class ClassificationArgs:
    """--pipeline-arg options of the hf-classification pipeline."""

    model: str
    """A local directory holding the model's config.json, with or without weights (without: built from the config)."""
    train: str
    """Training rows: .jsonl or .parquet files (a file or a directory), or a save_to_disk directory."""
    val: str | None = None
    """Validation rows, the same kinds."""
    tokenizer: str | None = None
    """A local tokenizer directory (default: the model's directory)."""
    text_column: str = "text"
    """The column holding the text."""
    label_column: str = "label"
    """The column holding the class index (an integer from 0)."""
    block_size: int = 128
    """Tokens per row: longer texts are truncated, shorter ones padded."""
    num_labels: int | None = None
    """Classes (default: the model config's num_labels)."""

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"--pipeline-arg block_size: got {self.block_size}; at least 2 tokens")
        if self.num_labels is not None and self.num_labels < 2:
            raise ValueError(f"--pipeline-arg num_labels: got {self.num_labels}; at least 2 classes")
        self.model = common.local_directory("model", self.model, ("config.json",))
        self.tokenizer = common.local_directory("tokenizer", self.tokenizer or self.model, common.TOKENIZER_FILES)
        self.train = common.local_input("train", self.train)
        self.val = common.local_input("val", self.val) if self.val else None
        common.check_model(self.model, self.tokenizer, self.block_size, causal=False)


def encode_rows(batch: dict, *, tokenizer: str, column: str, label: str, block_size: int, num_labels: int) -> dict:
    """One Ray Data batch as token ids and attention masks of `block_size` (truncated or
    padded) and integer labels: one row out per row in, so each worker encodes its own rows.
    A row without a label, or with one outside 0…num_labels-1, is a DataError naming it (the
    loss would fail on the worker with "Target 7 is out of bounds", or an index error)."""
    labels = class_labels(batch[label], label, num_labels, batch[column])
    encoded = common.tokenizer_at(tokenizer)(
        [str(text) for text in batch[column]],
        padding="max_length",
        truncation=True,
        max_length=block_size,
        return_tensors="np",
    )
    return {
        "input_ids": encoded["input_ids"].astype(np.int64),
        "attention_mask": encoded["attention_mask"].astype(np.int64),
        "label": labels,
    }


def class_labels(values, option: str, num_labels: int, texts) -> np.ndarray:
    """`values` as int64 class indices; a DataError for a missing one or one out of range."""
    values = np.asarray(values)
    missing = np.array([v is None for v in values]) if values.dtype == object else np.zeros(len(values), bool)
    if values.dtype.kind == "f":
        missing |= np.isnan(values)
    if missing.any():
        first = int(np.argmax(missing))
        raise DataError(
            f"--pipeline-arg label_column={option}: {int(missing.sum())} row(s) have no label (the first: text "
            f"{str(texts[first])[:60]!r}); give every row an integer class from 0 to {num_labels - 1}, or leave "
            "unlabelled rows out of the files"
        )
    labels = values.astype(np.int64)
    wrong = (labels < 0) | (labels >= num_labels)
    if wrong.any():
        first = int(np.argmax(wrong))
        raise DataError(
            f"--pipeline-arg label_column={option}: a row has label {labels[first]} (text {str(texts[first])[:60]!r}), "
            f"but the model has {num_labels} classes, 0 to {num_labels - 1} (num_labels); map the labels to that "
            f"range, or give --pipeline-arg num_labels=N for N classes"
        )
    return labels


def encoded(path: str, option: str, spec: ClassificationArgs):
    import pyarrow as pa

    ds = common.read_input(path, option)
    common.check_column(ds, spec.text_column, "text_column", path)
    common.check_column(ds, spec.label_column, "label_column", path)
    kind = dict(zip(ds.schema().names, ds.schema().types))[spec.label_column]
    if isinstance(kind, pa.DataType) and pa.types.is_null(kind):
        raise DataError(
            f"--pipeline-arg label_column={spec.label_column}: the rows of {path} read so far have no label there "
            "(the column is empty); give every row an integer class index from 0"
        )
    if isinstance(kind, pa.DataType) and not pa.types.is_integer(kind):
        raise DataError(
            f"--pipeline-arg label_column={spec.label_column}: {path} holds {kind} there; a label must be an integer "
            "class index from 0: map the names to ids when writing the files"
        )
    return ds.map_batches(
        encode_rows,
        fn_kwargs={
            "tokenizer": spec.tokenizer,
            "column": spec.text_column,
            "label": spec.label_column,
            "block_size": spec.block_size,
            "num_labels": spec.num_labels or common.model_config(spec.model).num_labels,
        },
        batch_size=common.TOKENIZE_BATCH_ROWS,
        batch_format="numpy",
    )


class HFClassificationPipeline(common.HFPipeline):
    """A Hugging Face `AutoModelForSequenceClassification` from a local directory."""

    default_config = {"epochs": 3, "batch_size_per_worker": 16, "lr": 5e-5, "warmup_epochs": 0.1, "weight_decay": 0.01}
    Args = ClassificationArgs

    def prepare(self, path, split, spec):
        return encoded(path, split, spec)

    def build_model(self, cfg):
        spec = self.args(cfg)
        # A padded batch needs the pad id in the config (GPT-2-style models find the last token by it).
        pad = common.tokenizer_at(spec.tokenizer).pad_token_id
        return common.load_model(
            "AutoModelForSequenceClassification", spec.model, num_labels=spec.num_labels, pad_token_id=pad
        )

    def compute_loss(self, model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["label"])
        accuracy = (out.logits.argmax(dim=-1) == batch["label"]).float().mean()
        return out.loss, {"accuracy": accuracy.detach()}

    @property
    def name(self) -> str:
        return "hf-classification"
