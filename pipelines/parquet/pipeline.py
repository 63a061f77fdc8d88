"""The `parquet` pipeline: columns named by --pipeline-arg, an MLP, cross-entropy or MSE."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.nn.functional as F
from torch import nn

import raytrain
from raytrain.errors import DataError
from raytrain.rundir.storage import Store, is_uri

SPLIT_SEED = 1234


@dataclass
class ParquetArgs:
    """--pipeline-arg options of the parquet pipeline."""

    path: str
    """A Parquet file or directory."""
    label: str
    """The target column."""
    features: str | None = None
    """Comma-separated feature columns (default: every other column)."""
    task: str | None = None
    """Classification or regression (default: from the label's type)."""
    val_path: str | None = None
    """A separate validation set."""
    val_fraction: float = 0.1
    """Else this share of the training rows, held out."""
    hidden: int = 128
    """MLP width."""

    def __post_init__(self):
        problems = []
        if self.task not in (None, "classification", "regression"):
            problems.append(f"--pipeline-arg task: got {self.task!r}; choose classification or regression")
        if not 0 <= self.val_fraction < 1:
            problems.append(f"--pipeline-arg val_fraction: got {self.val_fraction}; a number in [0, 1)")
        if self.hidden < 1:
            problems.append(f"--pipeline-arg hidden: got {self.hidden}; a positive integer")
        if problems:
            raise ValueError("; ".join(problems))
        if not is_uri(self.path):  # s3://, gs://… stay URIs
            self.path = str(Path(self.path).expanduser().absolute())

    @property
    def feature_list(self) -> list[str] | None:
        return [c.strip() for c in self.features.split(",") if c.strip()] if self.features else None


def read(path: str):
    """The Parquet file or directory at `path` (a local path, or an object store's URI read through
    raytrain's storage layer: its credentials, endpoint and retries)."""
    import ray.data

    store = Store.of(path)
    if not store.exists():
        raise DataError(
            f"pipeline parquet: {store} does not exist; point --pipeline-arg path at a Parquet file or directory"
        )
    check_same_columns(path)
    try:
        if store.local:
            return ray.data.read_parquet(path)
        return ray.data.read_parquet(store.root, filesystem=store.fs)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"pipeline parquet: cannot read {path}: {str(exc).splitlines()[0][:300]}") from None


def check_same_columns(path: str) -> None:
    """Every file under `path` has the first file's columns and types, from their footers (no
    row is read): else a DataError naming the file, the columns and the fix, before Ray Data
    fails on it deep in a read task."""
    import pyarrow.parquet as pq

    from raytrain.data.files import schema_difference

    files = sorted(Path(path).rglob("*.parquet")) if Path(path).is_dir() else [Path(path)]
    expected = None
    for file in files:
        try:
            schema = pq.read_schema(file)
        except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
            raise DataError(
                f"pipeline parquet: file {file} cannot be read as Parquet ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}); replace it, or move it out of {path}"
            ) from None
        if expected is None:
            expected, first = schema, file
            continue
        differs = schema_difference(expected, schema)
        if differs:
            raise DataError(
                f"pipeline parquet: file {file} {differs} compared with {first}; every file under --pipeline-arg "
                "path must have the same columns and types: rewrite that file with them, or move it out of the "
                "directory"
            )


def pack(ds, spec: ParquetArgs, features: list[str], regression: bool):
    """One float32 `features` tensor column and a `label` column, built in Ray Data."""

    def to_tensors(batch: dict) -> dict:
        n = len(batch[spec.label])
        parts = [np.asarray(batch[name], dtype=np.float32).reshape(n, -1) for name in features]
        label = np.asarray(batch[spec.label])
        return {
            "features": np.concatenate(parts, axis=1),
            "label": label.astype(np.float32 if regression else np.int64),
        }

    return ds.map_batches(to_tensors, batch_format="numpy")


def check_numeric(spec: ParquetArgs, features: list[str], types: dict) -> None:
    """DataError naming every label or feature column that holds text or bytes, from the schema
    (before any row is read)."""
    import pyarrow as pa

    def textual(name: str) -> bool:
        kind = types[name]
        if isinstance(kind, pa.DictionaryType):
            kind = kind.value_type
        return isinstance(kind, pa.DataType) and (
            pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
        )

    problems = []
    if textual(spec.label):
        problems.append(
            f"label column {spec.label!r} holds text ({types[spec.label]}); a classification label must be an "
            "integer class "
            f"index and a regression target a number: map the names to ids when writing the files, "
            f"e.g. df[{spec.label!r}] = df[{spec.label!r}].astype('category').cat.codes"
        )
    text_features = [name for name in features if textual(name)]
    if text_features:
        problems.append(
            f"feature column(s) {', '.join(text_features)} hold text; features must be numbers: encode them when "
            "writing the "
            f"files, or choose the numeric ones with --pipeline-arg features=COL,COL"
        )
    if problems:
        raise DataError(f"pipeline parquet: {spec.path}: " + "; ".join(problems))


def label_max(path: str, label: str, dataset) -> int:
    """The largest label, from the Parquet footers' statistics (no pass over the data);
    a full aggregation only when some file has none."""
    import pyarrow.parquet as pq

    store = Store.of(path)
    if store.is_file(""):
        files = [store.root]
    else:
        files = [store.fs_path(name) for name in store.list(recursive=True) if name.endswith(".parquet")]
    best = None
    try:
        for file in files:
            with store.fs.open_input_file(file) as handle:  # the footer only (a ranged read on a store)
                metadata = pq.ParquetFile(handle).metadata
            column = metadata.schema.names.index(label)
            for group in range(metadata.num_row_groups):
                stats = metadata.row_group(group).column(column).statistics
                if stats is None or not stats.has_min_max:
                    raise ValueError("no statistics")
                best = stats.max if best is None else max(best, stats.max)
    except (ValueError, OSError):
        best = None
    if best is None:
        best = dataset.max("label")
    try:
        return int(best)
    except (TypeError, ValueError):
        raise DataError(
            f"pipeline parquet: label column {label!r} holds {best!r}; a classification label must be an integer "
            "class index"
        ) from None


class ParquetPipeline(raytrain.Pipeline):
    default_config = {"epochs": 5, "batch_size_per_worker": 64, "lr": 1e-3, "warmup_epochs": 1}
    Args = ParquetArgs

    def __init__(self):
        self.shape: tuple[int, int, bool] | None = None  # (num_features, num_outputs, regression)

    def build_datasets(self, cfg):
        spec = self.args(cfg)
        ds = read(spec.path)
        columns = ds.schema().names
        features = spec.feature_list or [c for c in columns if c != spec.label]
        missing = [c for c in [spec.label, *features] if c not in columns]
        if missing:
            raise DataError(
                f"pipeline parquet: column(s) {', '.join(missing)} not in {spec.path} (it has: {', '.join(columns)})"
            )
        types = dict(zip(columns, ds.schema().types))
        check_numeric(spec, features, types)
        label_type = str(types[spec.label])
        regression = spec.task == "regression" or (
            spec.task is None and ("float" in label_type or "double" in label_type)
        )
        train = pack(ds, spec, features, regression)
        if spec.val_path:
            val = pack(read(spec.val_path), spec, features, regression)
        elif spec.val_fraction > 0:
            train, val = train.train_test_split(test_size=spec.val_fraction, shuffle=True, seed=SPLIT_SEED)
        else:
            val = None
        first = train.take(1)  # one row through the packing: the feature count
        if not first:
            raise DataError(f"pipeline parquet: {spec.path} holds no rows")
        num_features = int(np.asarray(first[0]["features"]).size)
        num_outputs = 1 if regression else label_max(spec.path, spec.label, train) + 1
        self.shape = (num_features, num_outputs, regression)
        return {"train": train, **({"val": val} if val is not None else {})}

    def build_model(self, cfg):
        if self.shape is None:  # outside a run (export): the same derivation as build_datasets
            self.build_datasets(cfg)
        num_features, num_outputs, _ = self.shape
        hidden = self.args(cfg).hidden
        return nn.Sequential(
            nn.Linear(num_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_outputs),
        )

    def compute_loss(self, model, batch):
        out = model(batch["features"]).float()
        if self.shape[2]:
            return F.mse_loss(out.squeeze(-1), batch["label"])
        loss = F.cross_entropy(out, batch["label"])
        return loss, {"accuracy": (out.argmax(dim=1) == batch["label"]).float().mean()}

    @property
    def name(self) -> str:
        return "parquet"
