"""Do the ports train like their originals? Final training and validation loss, original vs
raytrain port, at 1 and 2 workers, same seeds, data and global batch.

Recipes (docs/porting.md):

- template: the seed's torchrun template (`raytrain/baselines/classic_ddp.py`: DDP, DistributedSampler,
  AdamW, per-step cosine) on digits, vs `raytrain train digits --batch-size-per-worker 32
  --lr-scaling none --warmup-epochs 0`;
- sgd: `examples/sgd_recipe/original.py` (SGD + Nesterov, warmup, step decay, label smoothing,
  crop/flip) vs `examples.sgd_recipe.pipeline:SGDRecipe`;
- nanogpt: `examples/nanogpt_style/original.py` (step-based: 300 iterations of fresh random
  windows of a token file, AdamW in two groups, warmup from 0 and a cosine to a floor, clipping,
  8 windows per process) vs `examples.nanogpt_style.pipeline:NanoGPTStyle` (--max-steps, a
  sampled training set, --global-batch-size 8 × workers). Both final models are scored by this
  script on the same fixed windows of train.bin and val.bin (`fixed_windows`), so the two sides
  are measured alike.

Each original runs under torchrun (or alone at 1 worker) for every seed; the verdict compares
the port's mean over the seeds with the original's mean, against the original's seed-to-seed
spread (max − min over seeds). Usage:

    python benchmarks/reproduce.py [--recipes template,sgd,nanogpt] [--seeds 0,1,2] [--workers 1,2] [--json out.json]
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
RAYTRAIN = str(Path(sys.executable).with_name("raytrain"))
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
EPOCHS = {"template": 8, "sgd": 10, "nanogpt": None}  # nanogpt counts steps (its recipe's 300)
SCORED_WINDOWS = 512  # windows of each split both nanogpt models are scored on


def torchrun(workers: int, script: list[str]) -> list[str]:
    if workers == 1:
        return [sys.executable, *script]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(workers),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(29700 + workers),
        *script,
    ]


def run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:6])} ... failed ({done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
        )


def template_data(work: Path) -> tuple[Path, Path]:
    import numpy as np

    from pipelines.digits.pipeline import load_arrays, split

    images, labels = load_arrays()
    train_rows, val_rows = split(len(labels))
    train, val = work / "train.npz", work / "val.npz"
    np.savez(train, image=images[train_rows], label=labels[train_rows])
    np.savez(val, image=images[val_rows], label=labels[val_rows])
    return train, val


def original(recipe: str, workers: int, seed: int, work: Path) -> dict:
    out = work / f"orig-{recipe}-{workers}-{seed}.json"
    if recipe == "template":
        from raytrain.config import TrainConfig

        config = work / f"config-{seed}.json"
        config.write_text(
            json.dumps(TrainConfig(batch_size_per_worker=32, seed=seed, lr=1e-3, weight_decay=0.01).to_dict())
        )
        train, val = template_data(work)
        script = [
            "-m",
            "raytrain.baselines.classic_ddp",
            "--pipeline",
            "digits",
            "--data",
            str(train),
            "--val",
            str(val),
            "--config",
            str(config),
            "--epochs",
            str(EPOCHS[recipe]),
            "--out",
            str(out),
        ]
    elif recipe == "nanogpt":
        model = work / f"orig-{recipe}-{workers}-{seed}.pt"
        data = str(nanogpt_data(work))
        run(
            torchrun(
                workers,
                ["examples/nanogpt_style/original.py", "--data", data, "--seed", str(seed), "--save", str(model)],
            )
        )
        return score_nanogpt(model, work)
    else:
        script = [
            "examples/sgd_recipe/original.py",
            "--epochs",
            str(EPOCHS[recipe]),
            "--seed",
            str(seed),
            "--out",
            str(out),
        ]
    run(torchrun(workers, script))
    figures = json.loads(out.read_text())
    return {"train_loss": figures["train_loss"], "val_loss": figures["val_loss"]}


def port(recipe: str, workers: int, seed: int, work: Path) -> dict:
    name = f"port-{recipe}-{workers}-{seed}"
    common = [
        "--workers",
        str(workers),
        "--seed",
        str(seed),
        *(["--epochs", str(EPOCHS[recipe])] if EPOCHS[recipe] else []),
        "--storage",
        str(work),
        "--name",
        name,
        "--progress",
        "off",
    ]
    if recipe == "template":
        command = [
            RAYTRAIN,
            "train",
            "digits",
            *common,
            "--batch-size-per-worker",
            "32",
            "--lr",
            "1e-3",
            "--lr-scaling",
            "none",
            "--warmup-epochs",
            "0",
        ]
    elif recipe == "nanogpt":
        command = [
            RAYTRAIN,
            "train",
            "examples.nanogpt_style.pipeline:NanoGPTStyle",
            *common,
            "--global-batch-size",
            str(8 * workers),  # the original's 8 windows per process
            "--pipeline-arg",
            f"data={nanogpt_data(work)}",
        ]
        run(command)
        return score_nanogpt(work / name / "model.pt", work)
    else:
        command = [RAYTRAIN, "train", "examples.sgd_recipe.pipeline:SGDRecipe", *common]
    run(command)
    metrics = json.loads((work / name / "summary.json").read_text())["final_metrics"]
    # the originals report the mean over the last epoch: its port's figure under that name
    return {"train_loss": metrics["epoch_loss"], "val_loss": metrics["val_loss"]}


def nanogpt_data(work: Path) -> Path:
    from examples.nanogpt_style.data import prepare

    return prepare(work / "nanogpt-data")


def score_nanogpt(model_path: Path, work: Path) -> dict:
    """The mean next-token loss of a final nanogpt model on the same fixed windows of each split."""
    import torch
    import torch.nn.functional as F

    from examples.nanogpt_style.data import fixed_windows, tokens
    from examples.nanogpt_style.original import BLOCK, HEADS, LAYERS, WIDTH
    from pipelines.charlm.model import CharGPT

    model = CharGPT(block=BLOCK, width=WIDTH, layers=LAYERS, heads=HEADS)
    model.load_state_dict(torch.load(model_path, weights_only=True), strict=True)
    model.eval()
    figures = {}
    with torch.no_grad():
        for split in ("train", "val"):
            windows = torch.from_numpy(fixed_windows(tokens(nanogpt_data(work), split), BLOCK, SCORED_WINDOWS))
            logits = model(windows[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
            figures[f"{split}_loss"] = float(loss)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="template,sgd,nanogpt")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--json")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(tempfile.mkdtemp(prefix="raytrain-reproduce-"))
    results: dict = {}
    for recipe in args.recipes.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            for kind, runner in (("original", original), ("port", port)):
                for seed in seeds:
                    started = time.time()
                    figures = runner(recipe, workers, seed, work)
                    results.setdefault(recipe, {}).setdefault(workers, {}).setdefault(kind, []).append(figures)
                    print(
                        f"{recipe}, {workers} worker(s), {kind}, seed {seed}: train {figures['train_loss']:.4f}, val "
                        f"{figures['val_loss']:.4f} "
                        f"({time.time() - started:.0f} s)",
                        flush=True,
                    )
    print()
    print(
        "| recipe | workers | loss | original, per seed | original mean (spread) | port, per seed | port mean | "
        "|mean diff| ≤ spread |"
    )
    print("|---|---:|---|---|---:|---|---:|---|")
    verdicts = {}
    for recipe, by_workers in results.items():
        for workers, runs in by_workers.items():
            for loss in ("train_loss", "val_loss"):
                orig, ported = [r[loss] for r in runs["original"]], [r[loss] for r in runs["port"]]
                spread = max(orig) - min(orig)
                diff = abs(statistics.mean(ported) - statistics.mean(orig))
                verdicts[f"{recipe}/{workers}/{loss}"] = diff <= spread
                print(
                    f"| {recipe} | {workers} | {loss} | {', '.join(f'{v:.4f}' for v in orig)} | "
                    f"{statistics.mean(orig):.4f} ({spread:.4f}) | "
                    f"{', '.join(f'{v:.4f}' for v in ported)} | {statistics.mean(ported):.4f} | "
                    f"{'yes' if diff <= spread else 'NO'} ({diff:.4f}) |"
                )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "epochs": EPOCHS,
                    "seeds": seeds,
                    "results": results,
                    "verdicts": verdicts,
                    "load_average_at_end": list(os.getloadavg()),
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
