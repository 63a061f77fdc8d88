"""What the Hugging Face pipelines share: the optional packages, local directories only, the
input files as a Ray Dataset, the tokenizer on Ray Data's workers, the model from a local
directory, and weight decay off for biases and norms."""

from __future__ import annotations

import codecs
import functools
import json
import os
from pathlib import Path
from typing import Any

import raytrain
from raytrain.errors import DataError, PipelineError
from raytrain.meta import UnitInit, WeightFiles, build_on_meta, fill, on_meta

INSTALL = "pip install 'raytrain[hf]'"
# What `save_pretrained` writes as weights (one file, or an index of shards).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# What a tokenizer directory (`tokenizer.save_pretrained`) holds: one of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")
# Rows tokenized at once (a classifier's Ray Data batch; a causal LM's group of rows packed
# together, pipelines/hf/causal_lm.py): HF's `map` default.
TOKENIZE_BATCH_ROWS = 1000
# What read_text reads (one row per line), as read_input decides.
TEXT_SUFFIXES = (".txt", ".text", "")
# Bytes of each text file decoded before Ray starts, to name a binary file as such.
TEXT_SNIFF_BYTES = 1 << 16


def require_hf(pipeline: str) -> None:
    """PipelineError (exit 2) naming the install command when an HF package is missing."""
    missing = []
    for package in ("transformers", "tokenizers", "datasets", "safetensors"):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    if missing:
        raise PipelineError(
            f"pipeline {pipeline} needs {', '.join(missing)}, not installed here: {INSTALL} (on a cluster, on every "
            "node or in the job's runtime environment)"
        )


def local_directory(option: str, value: str, wanted: tuple[str, ...]) -> str:
    """`value` as an absolute local directory holding one of `wanted`; else a ValueError (the
    pipeline's options refuse it before Ray starts) saying that nothing is downloaded."""
    path = Path(value).expanduser()
    if path.is_dir() and any((path / name).is_file() for name in wanted):
        return str(path.absolute())
    found = "is a directory without" if path.is_dir() else "is not a local directory holding"
    raise ValueError(
        f"--pipeline-arg {option}={value} {found} {' or '.join(wanted)}; raytrain never downloads a model or "
        "tokenizer (a cluster may have no network): save it with save_pretrained(DIR) where there is one and "
        f"point at that directory, --pipeline-arg {option}=DIR"
    )


def local_input(option: str, value: str) -> str:
    """An input path (file or directory) that exists, as an absolute path; else a ValueError."""
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(
            f"--pipeline-arg {option}={value} does not exist; give a text, JSON lines or Parquet file or directory, "
            "or a directory written by datasets' save_to_disk"
        )
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if not p.name.startswith((".", "_"))]
    if not any(p.stat().st_size for p in files):
        raise ValueError(
            f"--pipeline-arg {option}={value} is empty ({'no file holds a byte' if path.is_dir() else '0 bytes'}); "
            "give a file or directory with rows"
        )
    for file in files:
        if file.suffix in TEXT_SUFFIXES and (problem := text_problem(file)):
            raise ValueError(f"--pipeline-arg {option}={value}: {problem}")
    return str(path.absolute())


def text_problem(path: Path) -> str | None:
    """Why the start of a text file is not UTF-8 text (Ray Data's read_text decodes it as such;
    a binary file would fail deep in a read task), or None."""
    with open(path, "rb") as handle:
        head = handle.read(TEXT_SNIFF_BYTES)
    where = None
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError as exc:
        where = exc.start
    if b"\0" in head:
        where = min(where if where is not None else len(head), head.index(b"\0"))
    if where is None:
        return None
    return (
        f"{path} is not UTF-8 text (byte {where:,} is {head[where : where + 1]!r}): a .txt file is read as UTF-8 text, "
        "one row per line; convert it (iconv -f LATIN1 -t UTF-8), or leave binary files out of the input"
    )


def has_weights(directory: str) -> bool:
    return any((Path(directory) / name).is_file() for name in WEIGHT_FILES)


def check_model(model: str, tokenizer: str, block_size: int, *, causal: bool) -> None:
    """ValueError listing what makes the model, the tokenizer and block_size unable to train
    together (`model_problems`), before Ray starts: each would otherwise fail on the workers,
    as an index error or a damaged file, or train a causal LM on an encoder."""
    problems = model_problems(model, tokenizer, block_size, causal)
    if problems:
        raise ValueError("; ".join(problems))


@functools.lru_cache(maxsize=8)
def model_problems(model: str, tokenizer: str, block_size: int, causal: bool) -> tuple[str, ...]:
    config = model_config(model)
    problems = []
    damaged = weights_problem(model)
    if damaged:
        problems.append(
            f"--pipeline-arg model={model}: {damaged}; save the model there again with save_pretrained, or move its "
            "weight files away to build it fresh from config.json"
        )
    if causal:
        problems += causal_problems(model, config)
    vocab, ids = getattr(config, "vocab_size", None), len(tokenizer_at(tokenizer))
    if isinstance(vocab, int) and ids > vocab:
        problems.append(
            f"--pipeline-arg tokenizer={tokenizer} has {ids:,} token ids, but the model at {model} has vocab_size "
            f"{vocab:,} (one embedding row per id): ids from {vocab:,} on have none. Give the model's own tokenizer, "
            "--pipeline-arg tokenizer=DIR, or grow the model first: model.resize_token_embeddings(len(tokenizer)), "
            "then save_pretrained"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and block_size > positions:
        problems.append(
            f"--pipeline-arg block_size={block_size}: the model at {model} has max_position_embeddings {positions} "
            f"(positions it has embeddings for); give --pipeline-arg block_size={positions} or less"
        )
    return tuple(problems)


@functools.lru_cache(maxsize=8)
def model_config(directory: str):
    """The model's config.json as transformers reads it, once per process."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"--pipeline-arg model={directory}: transformers cannot read its config.json ({reason}); save the model "
            "with save_pretrained(DIR) and point at DIR"
        ) from None


def causal_problems(model: str, config: Any) -> list[str]:
    """Why AutoModelForCausalLM would not give a causal LM for `config`: a family without one,
    or an encoder (BERT, RoBERTa…), whose causal-LM class attends to the following tokens unless
    the config says `is_decoder: true`, and whose masked-LM weights leave its LM head fresh."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return [
            f"--pipeline-arg model={model} is a {kind} model, which transformers has no causal LM class for; give a "
            "decoder (GPT-2, Llama, Qwen…), or train it with hf-classification"
        ]
    encoder = kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_encoder_decoder
    if encoder and not config.is_decoder and not getattr(config, "causal", False):
        return [
            f"--pipeline-arg model={model} is a {kind} model, an encoder: as a causal LM "
            f"({MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]}) each token would attend to the following ones and the LM "
            "head would start fresh. Give a decoder (GPT-2, Llama, Qwen…), train it with hf-classification, or set "
            '"is_decoder": true in its config.json to train it as a decoder on purpose'
        ]
    return []


def weights_problem(directory: str) -> str | None:
    """What is wrong with the safetensors weights in `directory` (the file, or an index and its
    shards), from their headers only; None when nothing is or there are none."""
    root = Path(directory)
    files = [root / "model.safetensors"] if (root / "model.safetensors").is_file() else []
    index = root / "model.safetensors.index.json"
    if not files and index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{index} is not a safetensors index (JSON with a weight_map)"
        missing = [name for name in shards if not (root / name).is_file()]
        if missing:
            return f"{index} names {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}, not in {root}"
        files = [root / name for name in shards]
    return next((problem for problem in map(safetensors_problem, files) if problem), None)


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (an 8-byte header length, a JSON header, then
    every tensor's bytes), or None."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little") if size >= 8 else None
        if length is None or length > size - 8:
            said = f"its header says {length:,} bytes" if length is not None else "it has no header"
            return f"{path} is damaged: {said}, the file holds {size:,} (truncated, or not a safetensors file)"
        try:
            header = json.loads(handle.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return f"{path} is damaged: its header is not a safetensors header (not a safetensors file?)"
    if 8 + length + end > size:
        return f"{path} is damaged: its tensors end at byte {8 + length + end:,}, the file holds {size:,} (truncated)"
    return None


def is_saved_dataset(path: str) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict's)."""
    root = Path(path)
    return root.is_dir() and ((root / "state.json").is_file() or (root / "dataset_dict.json").is_file())


def read_input(path: str, option: str):
    """The rows at `path` (`read_rows`); a DataError when there are none (a text file of empty
    lines only: Ray Data drops empty lines)."""
    ds = read_rows(path, option)
    if ds.schema() is None:
        raise DataError(
            f"--pipeline-arg {option}={path} holds no rows (no line of text, no record); give a file or directory "
            "with rows"
        )
    return ds


def read_rows(path: str, option: str):
    """The rows at `path` as a Ray Dataset: Parquet (read by row groups, so each worker reads its
    own), JSON lines, text (one row per line, column `text`), or a `save_to_disk` directory
    (through Ray Data's `from_huggingface`)."""
    import ray.data

    if is_saved_dataset(path):
        import datasets

        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            raise DataError(
                f"--pipeline-arg {option}={path} holds a DatasetDict ({', '.join(loaded)}); point at one split's "
                f"directory, e.g. {path}/{next(iter(loaded))}"
            )
        return ray.data.from_huggingface(loaded)
    files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if os.path.isdir(path) else [Path(path)]
    suffixes = {p.suffix for p in files if not p.name.startswith((".", "_"))}
    if suffixes <= {".parquet"} and suffixes:
        return ray.data.read_parquet(path)
    if suffixes <= {".jsonl", ".json"} and suffixes:
        return ray.data.read_json(path, lines=True)
    if suffixes <= {".txt", ".text", ""} and suffixes:
        return ray.data.read_text(path)
    raise DataError(
        f"--pipeline-arg {option}={path}: files of kinds {', '.join(sorted(suffixes)) or 'none'}; give .parquet, "
        ".jsonl or .txt files (one kind) or a save_to_disk directory"
    )


def check_column(ds, column: str, option: str, path: str) -> None:
    """DataError naming the columns there are, before any row is tokenized."""
    names = ds.schema().names
    if column not in names:
        raise DataError(
            f"--pipeline-arg {option}={column}: {path} has no column {column!r} (it has {', '.join(names)}); "
            f"name one of them, --pipeline-arg {option}=COLUMN"
        )


@functools.lru_cache(maxsize=4)
def tokenizer_at(directory: str):
    """The tokenizer saved in `directory`, loaded once per process (a Ray Data worker keeps it
    across the batches it tokenizes); never from the network."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # Ray Data runs many tasks already
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2's tokenizers have none; HF's examples pad with EOS
    return tokenizer


def load_model(auto_class: str, directory: str, **config_changes: Any):
    """The model in `directory`: its weights when it has them, else built from its config.json
    (fresh weights). `config_changes`: fields set on the config first (e.g. num_labels)."""
    import transformers

    auto = getattr(transformers, auto_class)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    for name, value in config_changes.items():
        if value is not None:
            setattr(config, name, value)
    if has_weights(directory) and not on_meta():  # on meta: the architecture only, `materialize` reads the weights
        return auto.from_pretrained(directory, config=config, local_files_only=True)
    return auto.from_config(config)


def materialize(model: Any, template: Any, directory: str, blocks: list[str], seed: int) -> None:
    """Fill a sharded model (storage allocated, values not) with this rank's rows: read from the
    weights in `directory`, the rest (no weights there, a head they lack, a non-persistent
    buffer) freshly initialized unit by unit by the model's own `_init_weights`
    (`raytrain.meta.UnitInit`, from the meta `template`)."""
    weights = WeightFiles(directory)
    fresh = UnitInit(template, blocks, getattr(template, "_init_weights", None), seed)
    fill(model, weights if weights else fresh, fallback=fresh)


def no_decay(name: str, parameter: Any, norm_parameters: set[int]) -> bool:
    """HF's examples' rule: no weight decay on biases and on normalization layers' weights."""
    return name.endswith("bias") or id(parameter) in norm_parameters


def decay_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters as two groups: with `weight_decay`, and without it (biases and the
    parameters of every normalization layer: LayerNorm, RMSNorm, whatever the family names it)."""
    norms = {
        id(p) for module in model.modules() if "norm" in type(module).__name__.lower() for p in module.parameters()
    }
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if not no_decay(n, p, norms)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if no_decay(n, p, norms)], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def build_decay_optimizer(model: Any, cfg: Any):
    """--optimizer (adamw, sgd, lamb) over `decay_groups`, at --lr (raytrain sets the rate)."""
    from raytrain.pipeline import default_optimizer

    return default_optimizer(model, cfg, groups=decay_groups(model, cfg.weight_decay))


class HFPipeline(raytrain.Pipeline):
    """What the HF pipelines share: the extra checked when built, the train and val sets each
    prepared by `prepare(path, split, args)`, no weight decay on biases and norms, the tokenizer."""

    def __init__(self):
        require_hf(self.name)

    def prepare(self, path: str, split: str, spec: Any):
        raise NotImplementedError

    def build_datasets(self, cfg):
        spec = self.args(cfg)
        datasets = {"train": self.prepare(spec.train, "train", spec)}
        if spec.val:
            datasets["val"] = self.prepare(spec.val, "val", spec)
        return datasets

    def build_optimizer(self, model, cfg):
        return build_decay_optimizer(model, cfg)

    def materialize(self, model, cfg):
        """Under fsdp: each rank reads only its shards' rows of the weights (or initializes only
        its rows, unit by unit, when the directory has none)."""
        template = build_on_meta(lambda: self.build_model(cfg))
        blocks = {id(m): name for name, m in template.named_modules()}
        units = [blocks[id(m)] for m in self.shard_modules(template)]
        materialize(model, template, self.args(cfg).model, units, cfg.seed)

    def tokenizer(self, cfg):
        """The run's tokenizer (`raytrain export --format hf` saves it beside the model)."""
        return tokenizer_at(self.args(cfg).tokenizer)
