"""Hugging Face `datasets` returned by a pipeline's build_datasets: a `datasets.Dataset` per
split, or a `DatasetDict` with `train` (and `validation` or `val`), turned into Ray Datasets
through Ray Data's own `from_huggingface` (its Arrow table, cut into blocks).

Nothing here imports `datasets`: a value is recognized by its type's module, so raytrain
works without the package installed.
"""

from __future__ import annotations

from typing import Any

# The DatasetDict splits raytrain trains and validates on (HF names it `validation`).
SPLITS = {"train": "train", "validation": "val", "val": "val"}


def _is(value: Any, name: str) -> bool:
    return any(k.__name__ == name and k.__module__.startswith("datasets") for k in type(value).__mro__)


def is_hf_dataset(value: Any) -> bool:
    """A `datasets.Dataset` (not a streaming IterableDataset, whose length is unknown)."""
    return _is(value, "Dataset")


def is_hf_dataset_dict(value: Any) -> bool:
    return _is(value, "DatasetDict")


def splits_of(value: Any) -> dict[str, Any]:
    """A DatasetDict's train and validation splits as {"train", "val"}; a plain dict as it is."""
    if not is_hf_dataset_dict(value):
        return value
    return {SPLITS[name]: split for name, split in value.items() if name in SPLITS}


def problem(name: str, dataset: Any) -> str | None:
    """Why a `datasets` value cannot be trained on (None: it can)."""
    if _is(dataset, "IterableDataset"):
        return (
            f"returned dataset {name!r} as a streaming datasets.IterableDataset, whose length is not known before "
            "reading; load it without streaming=True (or save_to_disk and load_from_disk it)"
        )
    return None


def to_ray(dataset: Any):
    """A `datasets.Dataset` as a Ray Dataset, columns as they are (Ray Data's `from_huggingface`)."""
    import ray.data

    return ray.data.from_huggingface(dataset)
