"""Time from the command to the first training step: `raytrain train` vs Ray's own floor.

Each contender is a fresh process started by this script; the clock runs from just before
the process starts to the moment rank 0 begins its first training forward pass (written to
a file as wall-clock time). Contenders, on the same number of CPU workers:

- raytrain: `raytrain train benchmarks.startup:TimedDigits --workers N --epochs 1`
  (the `digits` pipeline, unchanged except that it notes the first step);
- bare: the smallest TorchTrainer script: `ray.init` (same options as raytrain's embedded
  Ray), a TorchTrainer whose function builds the same CNN, wraps it with `prepare_model`
  and takes one step on a random batch;
- bare+data: the bare script plus the same Ray Dataset passed to the trainer and read once
  by each worker before its first step (what raytrain's workers do).

Rounds alternate the order; the figures are medians. Usage:

    python benchmarks/startup.py --workers 2 --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK_ENV = "RAYTRAIN_STARTUP_MARK"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipelines.digits import DigitsPipeline  # noqa: E402


class TimedDigits(DigitsPipeline):
    """`digits`, noting when rank 0 starts its first training step."""

    def __init__(self) -> None:
        self.mark_file = os.environ.get(MARK_ENV)  # read on the driver, pickled to the workers
        self.marked = False

    def compute_loss(self, model, batch):
        import raytrain

        if not self.marked and model.training and self.mark_file and raytrain.context().world_rank == 0:
            self.marked = True
            Path(self.mark_file).write_text(repr(time.time()))
        return super().compute_loss(model, batch)

    @property
    def name(self) -> str:
        return "digits"


def digits_epoch(config: dict) -> None:
    """One epoch of `digits` as a plain Ray Train function (the torchrun template's loop: the
    same training rows, a DistributedSampler, batch 32 per worker, AdamW 1e-3), rank 0 noting
    its phases in `config["phases_file"]` when there is one."""
    import ray.train
    import torch
    import torch.nn.functional as F
    from ray.train.torch import prepare_model
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from benchmarks.start_common import note
    from pipelines.digits.model import DigitsCNN
    from pipelines.digits.pipeline import load_arrays, split

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    phases = config.get("phases_file") if rank == 0 else None
    note("train function started (process group formed)", path=phases)
    images, labels = load_arrays()
    rows, _ = split(len(labels))
    dataset = TensorDataset(torch.from_numpy(images[rows]), torch.from_numpy(labels[rows]))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    torch.manual_seed(0)
    model = prepare_model(DigitsCNN())
    note("model prepared (DDP)", path=phases)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, (batch, target) in enumerate(DataLoader(dataset, batch_size=32, sampler=sampler)):
        if step == 0 and rank == 0:
            note("first batch", path=phases)
            Path(config["mark_file"]).write_text(repr(time.time()))
        optimizer.zero_grad()
        F.cross_entropy(model(batch), target).backward()
        optimizer.step()
    note("epoch done", path=phases)


def bare(workers: int, with_data: bool, address: str = "local", epoch: bool = False) -> None:
    """The floor: ray.init + TorchTrainer + prepare_model + one step (optionally reading the
    dataset first); with `epoch`, `digits_epoch` instead; `address`: a running Ray to join."""
    import ray
    import ray.train
    import torch
    import torch.nn.functional as F
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer, prepare_model

    from pipelines.digits.model import DigitsCNN

    mark_file = os.environ[MARK_ENV]

    def train_func(config) -> None:
        if config["with_data"]:
            for _ in ray.train.get_dataset_shard("train").iter_batches(batch_size=4096, batch_format="numpy"):
                pass
        torch.manual_seed(0)
        model = prepare_model(DigitsCNN())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        images, labels = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
        if ray.train.get_context().get_world_rank() == 0:
            Path(config["mark_file"]).write_text(repr(time.time()))
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    runtime_env = {"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "PYTHONPATH": str(REPO)}}
    quiet = {"logging_level": "ERROR", "log_to_driver": False, "runtime_env": runtime_env}
    if address == "local":
        cpus = max(os.cpu_count() or 1, workers + 2)
        ray.init(address="local", num_cpus=cpus, include_dashboard=True, dashboard_host="127.0.0.1", **quiet)
    else:
        ray.init(address=address, **quiet)
    datasets = {}
    if with_data:
        from pipelines.digits.pipeline import load_arrays, to_dataset

        images, labels = load_arrays()
        datasets = {"train": to_dataset(images, labels)}
    storage = tempfile.mkdtemp(prefix="raytrain-startup-")
    config = {"with_data": with_data, "mark_file": mark_file, "phases_file": os.environ.get("RAYTRAIN_PHASES_FILE")}
    TorchTrainer(
        digits_epoch if epoch else train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        datasets=datasets,
        run_config=RunConfig(storage_path=storage),
    ).fit()
    ray.shutdown()


def measure(kind: str, workers: int, storage: str) -> dict[str, float]:
    """Seconds from starting the process to rank 0's first step, and to its end."""
    mark = Path(tempfile.mkstemp(prefix=f"startup-{kind}-")[1])
    mark.unlink()
    env = {
        **os.environ,
        MARK_ENV: str(mark),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    if kind == "raytrain":
        raytrain = Path(sys.executable).with_name("raytrain")
        command = [
            str(raytrain),
            "train",
            "benchmarks.startup:TimedDigits",
            "--workers",
            str(workers),
            "--epochs",
            "1",
            "--storage",
            storage,
        ]
    else:
        command = [sys.executable, __file__, "--bare", "--workers", str(workers)] + (
            ["--with-data"] if kind == "bare+data" else []
        )
    started = time.time()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    ended = time.time()
    if done.returncode != 0 or not mark.exists():
        raise RuntimeError(f"{kind} failed ({done.returncode}): {done.stderr[-2000:]}")
    first_step = float(mark.read_text())
    mark.unlink()
    return {"to_first_step_s": first_step - started, "total_s": ended - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--with-data", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare(args.workers, args.with_data)
        return
    kinds = ["raytrain", "bare", "bare+data"]
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    storage = tempfile.mkdtemp(prefix="raytrain-startup-runs-")
    for index in range(args.rounds):
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            figures = measure(kind, args.workers, storage)
            results[kind].append(figures)
            print(
                f"round {index + 1}: {kind:9s} first step after {figures['to_first_step_s']:.1f} s (process ended "
                f"after {figures['total_s']:.1f} s)",
                flush=True,
            )
    median = {kind: statistics.median(r["to_first_step_s"] for r in runs) for kind, runs in results.items()}
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "workers": args.workers,
        "rounds": args.rounds,
        "load_average_at_end": list(os.getloadavg()),
        "median_to_first_step_s": median,
        "raytrain_over_bare": median["raytrain"] / median["bare"],
        "raytrain_over_bare_with_data": median["raytrain"] / median["bare+data"],
        "runs": results,
    }
    print(
        f"Median time to the first step over {args.rounds} rounds ({args.workers} workers): raytrain "
        f"{median['raytrain']:.1f} s, "
        f"bare TorchTrainer {median['bare']:.1f} s (ratio {summary['raytrain_over_bare']:.2f}), "
        f"bare TorchTrainer + Ray Data {median['bare+data']:.1f} s (ratio "
        f"{summary['raytrain_over_bare_with_data']:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
