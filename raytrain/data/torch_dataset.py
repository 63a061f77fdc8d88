"""Map-style torch Datasets as Ray Datasets: read in parallel, each sample's fields as columns."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raytrain.errors import DataError

# A map-style torch Dataset is read through Ray Data in this many read tasks at most (a parallel
# read over index ranges, each task fetching its indices; the tasks are a stream's units).
TORCH_READ_TASKS = 96


def from_torch_dataset(dataset, name: str):
    """A map-style torch Dataset as a Ray Dataset: `ray.data.range` over its indices, each
    read task fetching its samples in parallel (`ray.data.from_torch` reads in one task).
    A sample's fields become columns: '0', '1', ... for a tuple or list, the keys of a dict,
    '0' for a lone tensor or number."""
    import ray.data

    try:
        size = len(dataset)
    except TypeError:
        raise DataError(
            f"dataset {name!r} is a torch IterableDataset: it has no length and no indices to shard; give a "
            "map-style Dataset (with __len__ and __getitem__) or a ray.data.Dataset"
        ) from None
    if size == 0:
        raise DataError(f"dataset {name!r} is empty: the torch Dataset has length 0")
    first = sample_columns(dataset[0], name, 0)  # the first sample's fields, checked before any worker starts
    blocks = max(1, min(size, TORCH_READ_TASKS))
    shapes = {key: value.shape for key, value in first.items()}
    return ray.data.range(size, override_num_blocks=blocks).map_batches(
        TorchSamples(dataset, name, shapes), batch_format="numpy"
    )


# The torch Datasets a Ray worker process has loaded, by object id (the few most recent): every
# read task of a dataset runs the same map step, and a Dataset of many small tensors takes long to
# unpickle (2,048 pairs of tensors: 0.8 s), which each task paid again before (98 tasks, ~50 s for
# the 2,048-row tutorial port on 2 cores).
_LOADED: dict[str, Any] = {}
_LOADED_KEPT = 4


class TorchSamples:
    """The map_batches step of `from_torch_dataset`: indices in, columns out, every sample
    with the fields and shapes of sample 0 (`shapes`). The Dataset travels once, through the
    object store, and each process that reads it loads it once."""

    def __init__(self, dataset, name: str, shapes: dict[str, tuple[int, ...]] | None = None):
        import ray

        self.name, self.shapes = name, shapes
        # Without Ray (called directly, as a plain function) the Dataset itself.
        self.inline = None if ray.is_initialized() else dataset
        self.dataset_ref = ray.put(dataset) if self.inline is None else None

    @property
    def dataset(self):
        import ray

        if self.inline is not None:
            return self.inline
        key = self.dataset_ref.hex()
        if key not in _LOADED:
            while len(_LOADED) >= _LOADED_KEPT:
                _LOADED.pop(next(iter(_LOADED)))
            _LOADED[key] = ray.get(self.dataset_ref)
        return _LOADED[key]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, dataset = [], self.dataset
        for index in map(int, batch["id"]):
            row = sample_columns(dataset[index], self.name, index)
            check_like_first(row, self.shapes or {k: v.shape for k, v in (rows or [row])[0].items()}, self.name, index)
            rows.append(row)
        return {column: np.stack([row[column] for row in rows]) for column in rows[0]}


def check_like_first(row: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]], name: str, index: int) -> None:
    """Sample `index` has the fields of sample 0, each of the same shape: else a DataError
    naming the sample, the field and the fix (np.stack would fail without either)."""
    if sorted(row) != sorted(shapes):
        raise DataError(
            f"dataset {name!r}: sample {index} has the fields {sorted(row)} where sample 0 has {sorted(shapes)}; "
            "every sample of a torch Dataset must have the same fields"
        )
    for key, shape in shapes.items():
        if row[key].shape != shape:
            raise DataError(
                f"dataset {name!r}: sample {index}, field {key!r} has shape {row[key].shape} where sample 0's has "
                f"{shape}; every sample's field must have one shape: resize, crop or pad it in __getitem__ (e.g. "
                "transforms.Resize for images, or padding sequences to one length)"
            )


def sample_columns(sample: Any, name: str, index: int) -> dict[str, np.ndarray]:
    """One torch sample as named numeric arrays (DataError naming the dataset, index and field)."""
    if isinstance(sample, dict):
        fields = {str(key): value for key, value in sample.items()}
    elif isinstance(sample, (tuple, list)):
        fields = {str(i): value for i, value in enumerate(sample)}
    else:
        fields = {"0": sample}
    columns = {}
    for key, value in fields.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        array = np.asarray(value) if isinstance(value, (np.ndarray, np.generic, int, float, bool)) else None
        if (
            array is None
            or array.dtype == object
            or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_)
        ):
            raise DataError(
                f"dataset {name!r}: sample {index}, field {key!r} is a {type(value).__name__} ({str(value)[:60]!r}); "
                "a torch Dataset must yield tensors, numpy arrays or numbers (for images, e.g. torchvision's "
                "transforms.ToTensor())"
            )
        columns[key] = array
    return columns
