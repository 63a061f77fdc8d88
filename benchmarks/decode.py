"""A decode-bound pipeline, streamed: raytrain vs the torchrun template on the same JPEG decode.

The data are `--images` small JPEGs (`--size`² RGB, smooth random images, quality 90) with a
label, stored as Parquet (a binary column) in row groups of `--unit-rows`. Both contenders
decode every image with PIL on every epoch and train the same small CNN with the same global
batch:

- raytrain (`DecodeJpeg`): `ray.data.read_parquet` + `map_batches(decode)`, streamed
  (`--shuffle-window-rows`): each worker reads and decodes only its own row groups, in Ray
  Data tasks, while it trains;
- the template (`--template`, run under torchrun): a map-style Dataset over the encoded bytes,
  `DistributedSampler` (+ `set_epoch`) and `DataLoader(num_workers=--loader-workers)`
  decoding in `__getitem__`, DDP on gloo.

Each is measured at 1 and 2 workers; printed: steady samples/s, speedup at 2, and the share of
the step spent waiting for data. Usage:

    python benchmarks/decode.py [--images 12000] [--size 48] [--epochs 3] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import raytrain  # noqa: E402

CLASSES = 10


def write_images(directory: Path, count: int, size: int, unit_rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    done = directory / "_images"
    if done.exists() and done.read_text() == f"{count} {size}":
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = unit_rows * 8
    for index, start in enumerate(range(0, count, per_file)):
        n = min(per_file, count - start)
        labels = rng.integers(0, CLASSES, n)
        encoded = []
        for label in labels:
            # A smooth image whose mean colour depends on the label: learnable, and JPEG-like.
            base = rng.normal(size=(size // 8, size // 8, 3)) * 40 + 128 + 8 * (label - CLASSES / 2)
            image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).resize((size, size), Image.BILINEAR)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=90)
            encoded.append(buffer.getvalue())
        table = pa.table({"jpeg": pa.array(encoded, type=pa.binary()), "label": labels.astype(np.int64)})
        pq.write_table(table, directory / f"part-{index:04d}.parquet", row_group_size=unit_rows)
    done.write_text(f"{count} {size}")
    return directory


def decode(jpegs) -> np.ndarray:
    """JPEG bytes -> float32 (N, 3, H, W) in [0, 1]: the per-row work both contenders do."""
    from PIL import Image

    return np.stack(
        [
            np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0
            for b in jpegs
        ]
    )


def build_cnn():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 16, CLASSES),
    )


@dataclass
class DecodeJpegArgs:
    path: str


class DecodeJpeg(raytrain.Pipeline):
    """--pipeline-arg path=DIR: read the JPEG Parquet files and decode them in map_batches."""

    Args = DecodeJpegArgs
    default_config = {"epochs": 3, "global_batch_size": 128, "lr": 2e-3, "warmup_epochs": 0}

    def build_datasets(self, cfg):
        import ray.data

        def to_arrays(batch: dict) -> dict:
            return {"image": decode(batch["jpeg"]), "label": np.asarray(batch["label"], dtype=np.int64)}

        return {"train": ray.data.read_parquet(cfg.pipeline_args["path"]).map_batches(to_arrays, batch_format="numpy")}

    def build_model(self, cfg):
        return build_cnn()

    def compute_loss(self, model, batch):
        import torch.nn.functional as F

        return F.cross_entropy(model(batch["image"]), batch["label"])

    @property
    def name(self) -> str:
        return "decode-jpeg"


# -- the torchrun template ------------------------------------------------------------------------


def template(args) -> None:
    """DDP + DistributedSampler + DataLoader(num_workers) decoding in __getitem__ (under torchrun)."""
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    table = pq.read_table(args.path)  # encoded bytes only: a few MB
    jpegs, labels = table.column("jpeg").to_pylist(), table.column("label").to_numpy()

    class Jpegs(Dataset):
        def __len__(self):
            return len(jpegs)

        def __getitem__(self, index):
            return torch.from_numpy(decode([jpegs[index]])[0]), int(labels[index])

    dataset = Jpegs()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    per_rank = math.ceil(args.global_batch / world_size)
    loader = DataLoader(
        dataset,
        batch_size=per_rank,
        sampler=sampler,
        num_workers=args.loader_workers,
        persistent_workers=args.loader_workers > 0,
    )
    torch.manual_seed(0)
    model = DDP(build_cnn())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3 * world_size)
    steady_time = wait_time = 0.0
    steady_samples = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tick = time.perf_counter()
        for step, (images, target) in enumerate(loader):
            got = time.perf_counter()
            loss = F.cross_entropy(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            done = time.perf_counter()
            if step >= 3:
                steady_time += done - tick
                wait_time += got - tick
                steady_samples += len(target) * world_size
            tick = time.perf_counter()
    if rank == 0:
        Path(args.out).write_text(
            json.dumps({"samples_per_s": steady_samples / steady_time, "data_wait_share": wait_time / steady_time})
        )
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------------


def run_raytrain(data: Path, workers: int, args) -> dict:
    storage = Path(tempfile.mkdtemp(prefix="decode-bench-"))
    command = [
        str(Path(sys.executable).with_name("raytrain")),
        "train",
        "benchmarks.decode:DecodeJpeg",
        "--pipeline-arg",
        f"path={data}",
        "--workers",
        str(workers),
        "--epochs",
        str(args.epochs),
        "--global-batch-size",
        str(args.global_batch),
        "--shuffle-window-rows",
        str(args.window),
        "--storage",
        str(storage),
        "--name",
        "run",
        "--progress",
        "off",
    ]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=3600, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    if done.returncode != 0:
        raise RuntimeError(f"raytrain failed:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
    summary = json.loads((storage / "run" / "summary.json").read_text())
    progress = json.loads((storage / "run" / "progress.json").read_text())
    phases = progress.get("phase_time_s") or {}
    total = sum(phases.values()) or float("nan")
    return {"samples_per_s": summary["steady_samples_per_s"], "data_wait_share": phases.get("data_wait", 0.0) / total}


def run_template(data: Path, workers: int, args) -> dict:
    out = Path(tempfile.mkstemp(prefix="decode-template-", suffix=".json")[1])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(workers),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(29600 + workers),
        __file__,
        "--template",
        "--path",
        str(data),
        "--epochs",
        str(args.epochs),
        "--global-batch",
        str(args.global_batch),
        "--loader-workers",
        str(args.loader_workers),
        "--out",
        str(out),
    ]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if done.returncode != 0:
        raise RuntimeError(f"template failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=12_000)
    parser.add_argument("--size", type=int, default=48)
    parser.add_argument("--unit-rows", type=int, default=250)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--loader-workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "raytrain-decode-bench"))
    parser.add_argument("--json")
    parser.add_argument("--template", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.template:
        template(args)
        return
    data = write_images(Path(args.data_dir), args.images, args.size, args.unit_rows)
    start = time.perf_counter()
    decode(
        __import__("pyarrow.parquet", fromlist=["x"])
        .read_table(next(data.glob("*.parquet")))
        .column("jpeg")
        .to_pylist()[:500]
    )
    per_image_us = (time.perf_counter() - start) / 500 * 1e6
    print(
        f"decode: {args.images:,} JPEGs of {args.size}×{args.size}, {per_image_us:.0f} µs each to decode here",
        flush=True,
    )
    runs: dict[str, dict[int, list[dict]]] = {"raytrain": {1: [], 2: []}, "template": {1: [], 2: []}}
    for round_index in range(args.rounds):
        order = [("raytrain", run_raytrain), ("template", run_template)]
        for name, runner in order if round_index % 2 == 0 else order[::-1]:
            for workers in (1, 2):
                figures = runner(data, workers, args)
                runs[name][workers].append(figures)
                print(
                    f"round {round_index + 1}: {name} {workers} worker(s): {figures['samples_per_s']:,.0f} samples/s, "
                    f"data wait {100 * figures['data_wait_share']:.1f} % of the step",
                    flush=True,
                )
    summary = {}
    for name, by_workers in runs.items():
        rates = {w: statistics.median(r["samples_per_s"] for r in rs) for w, rs in by_workers.items()}
        waits = {w: statistics.median(r["data_wait_share"] for r in rs) for w, rs in by_workers.items()}
        summary[name] = {"samples_per_s": rates, "speedup_2": rates[2] / rates[1], "data_wait_share": waits}
        print(
            f"{name}: {rates[1]:,.0f} → {rates[2]:,.0f} samples/s, speedup at 2 workers {rates[2] / rates[1]:.2f}, "
            f"data wait {100 * waits[1]:.1f} % / {100 * waits[2]:.1f} % of the step"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "per_image_decode_us": per_image_us,
                    "summary": summary,
                    "runs": runs,
                    "load_average_at_end": list(os.getloadavg()),
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
