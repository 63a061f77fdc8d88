"""A model built on the meta device and filled shard by shard: what lets a sharded run's peak
memory per worker fall with the worker count.

Under `--strategy fsdp`, a pipeline that defines `materialize` (`raytrain.pipeline.Pipeline`)
has its model built with no storage (`build_on_meta`), sharded, given empty storage for this
rank's shards only, and then filled by it: `fill` writes into each parameter and buffer the
rows this rank holds (`local_index`, from the DTensor's own mesh and placements), read from a
`Source`. Two sources are here:

- `WeightFiles`: a `save_pretrained` directory (model.safetensors, or a sharded index, or a
  pytorch_model.bin). safetensors are read a slice at a time (`safe_open(...).get_slice`), a
  .bin through torch.load's memory map, so no rank reads the whole model.
- `UnitInit`: fresh weights, one unit at a time (a block, or the root's own modules): the
  unit is built full-size on the CPU from an unsharded meta template, initialized by the
  model's own rule (Hugging Face's `_init_weights`, or each module's `reset_parameters`) under
  a generator seeded from (seed, unit name), and only this rank's rows are kept. The values
  depend on the seed and on nothing else (not on the worker count, nor on the order in which
  ranks ask), and at most one unit is ever whole on a rank. They are not the numbers the same
  seed gives a model built whole (which draws every tensor from one stream in construction
  order): tests/test_meta.py checks both facts.

Tied parameters (GPT-2's head and token embedding) are one parameter object; `fill` writes each
object once, so they stay tied. torch is imported inside functions: this module is in the
foundation layer.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

# What save_pretrained writes as weights, in the order they are looked for.
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class Source(Protocol):
    """Where full tensors come from, read a block of rows at a time."""

    def has(self, name: str) -> bool: ...

    def read(self, name: str, index: tuple[slice, ...]) -> "torch.Tensor": ...


def on_meta() -> bool:
    """Whether the code runs under `build_on_meta` (torch's default device is meta): a
    pipeline's build_model then builds the architecture only, and reads no weights."""
    import torch

    return torch.get_default_device().type == "meta"


def build_on_meta(build: Callable[[], "nn.Module"]) -> "nn.Module":
    """`build()` with every tensor it creates on the meta device: shapes and dtypes, no storage."""
    import torch

    with torch.device("meta"):
        return build()


def is_meta(model: "nn.Module") -> bool:
    return any(t.is_meta for _, t in named_tensors(model))


def local_index(tensor: "torch.Tensor") -> tuple[slice, ...]:
    """The part of the full tensor this rank holds, as one slice per dimension: a DTensor's
    local shard (torch's own rule for its mesh and placements, uneven shards included), or all
    of a plain tensor."""
    shape = tuple(tensor.shape)
    if not hasattr(tensor, "device_mesh"):
        return tuple(slice(0, size) for size in shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, local))


def fill(model: "nn.Module", source: Source, fallback: Source | None = None) -> dict[str, list[str]]:
    """Write into every parameter and buffer of `model` (its storage allocated, e.g. by
    `to_empty`) the rows this rank holds, read from `source`, or from `fallback` for the names
    `source` lacks (a head the weights do not hold, a non-persistent buffer). Each tensor object
    is written once (tied parameters stay one). Returns the names read from each:
    {"source": [...], "fallback": [...]}; KeyError names a tensor neither has."""
    import torch

    done: set[int] = set()
    read: dict[str, list[str]] = {"source": [], "fallback": []}
    with torch.no_grad():
        for name, tensor in named_tensors(model):
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            origin = source if source.has(name) else fallback
            if origin is None or not origin.has(name):
                raise KeyError(f"{name}: in neither the weights nor the initializer")
            rows = origin.read(name, local_index(tensor))
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local.copy_(rows.to(dtype=local.dtype, device=local.device))
            read["source" if origin is source else "fallback"].append(name)
    return read


def named_tensors(model: "nn.Module", every_name: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Parameters then buffers, each object under its first name (tied ones once), or with
    `every_name` under every name it has."""
    yield from model.named_parameters(remove_duplicate=not every_name)
    yield from model.named_buffers(remove_duplicate=not every_name)


class WeightFiles:
    """The tensors of a save_pretrained directory, read a block of rows at a time."""

    def __init__(self, directory: str | os.PathLike):
        root = Path(directory)
        self.files: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (TORCH_BIN, TORCH_BIN_INDEX)):
            if (root / index).is_file():
                mapping = json.loads((root / index).read_text())["weight_map"]
                self.files = {name: root / file for name, file in mapping.items()}
                break
            if (root / single).is_file():
                self.files = {name: root / single for name in self._handle(root / single).keys()}
                break

    def __bool__(self) -> bool:
        return bool(self.files)

    def has(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, index: tuple[slice, ...]) -> "torch.Tensor":
        path = self.files[name]
        if path.suffix == ".safetensors":
            return self._handle(path).get_slice(name)[index]
        return self._handle(path)[name][index].clone()  # out of the memory map: only these rows

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                self._open[path] = safe_open(str(path), framework="pt", device="cpu")
            else:
                import torch

                self._open[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._open[path]


class UnitInit:
    """Fresh weights, one unit at a time, from an unsharded meta `template` of the model: each
    unit (a block named in `blocks`, or the root: every module in no block) is made full-size
    on the CPU, initialized by `init(module)` over its modules children first (the order of
    `nn.Module.apply`) under a generator seeded from (`seed`, unit name), and kept until a name
    of another unit is asked for."""

    def __init__(self, template: "nn.Module", blocks: list[str], init: Callable[["nn.Module"], Any] | None, seed: int):
        self.template, self.blocks, self.init, self.seed = template, sorted(blocks, key=len, reverse=True), init, seed
        self.names = {name for name, _ in named_tensors(template, every_name=True)}
        self.current: tuple[str, dict[str, Any]] | None = None

    def has(self, name: str) -> bool:
        return name in self.names

    def read(self, name: str, index: tuple[slice, ...]) -> "torch.Tensor":
        unit = self.unit_of(name)
        if self.current is None or self.current[0] != unit:
            self.current = None  # the previous unit is freed before the next is made
            self.current = (unit, self.made(unit))
        return self.current[1][name][index]

    def unit_of(self, name: str) -> str:
        return next((block for block in self.blocks if name.startswith(block + ".")), "")

    def made(self, unit: str) -> dict[str, "torch.Tensor"]:
        """The unit's tensors, full-size and initialized, keyed by their names in the model."""
        import torch

        modules = [
            (n, m) for n, m in self.template.named_modules(remove_duplicate=False) if self.unit_of(n + ".") == unit
        ]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(self.seed, unit))
            for _, module in modules:
                module._apply(lambda t: torch.empty_like(t, device="cpu"), recurse=False)
            for _, module in reversed(modules):  # children before parents, as nn.Module.apply
                self._init(module)
            made = {
                f"{prefix}.{name}" if prefix else name: tensor
                for prefix, module in modules
                for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            }
        for _, module in modules:  # the template keeps no storage
            module._apply(lambda t: t.to("meta"), recurse=False)
        return made

    def _init(self, module: "nn.Module") -> None:
        if self.init is not None:
            self.init(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()


def unit_seed(seed: int, unit: str) -> int:
    """The seed of a unit's fresh weights: the run's seed and the unit's name, nothing else."""
    digest = hashlib.sha256(f"{seed}:{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
