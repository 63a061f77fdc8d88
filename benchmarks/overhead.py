"""raytrain's own cost against the classic torchrun template, side by side in one run.

Throughput (steady samples/s at 2 CPU workers, `raytrain bench`'s machinery: the same
planned runs, `run_raytrain` and `run_template`, the first steps of every epoch left out):

- `mlp`: a ~2.8k-parameter MLP (32 -> 64 -> 10) whose step takes about 2 ms, where the
  trainer's own per-step cost shows, as it would around a fast GPU step;
- `cnn`: a small CNN on 3×32×32 images, batch 64 per worker.

Start (each contender a fresh process; the clock runs from just before it starts):

- `raytrain train benchmarks.start_common:MarkedDigits --workers 2 --epochs 1` (`digits`,
  noting when rank 0 starts its first training step) against the template
  (`torchrun --nproc_per_node 2 -m raytrain.baselines.classic_ddp`) on the same rows and
  config: time to the first step and to the process's exit;
- the same `raytrain train`, joining a head started once by `raytrain up` before the rounds
  (`raytrain-head`; stopped by `raytrain down` after them; `--head-env KEY=VALUE` starts that
  head with extra environment, e.g. RAY_num_prestart_python_workers=2, read by its raylet). The
  other contenders run while that head idles beside them;
- the floor: `benchmarks/startup_phases.py`'s bare TorchTrainer (ray.init + an almost empty
  train function: prepare_model and one step), and raytrain's start phase by phase.

The replica check (`fingerprint`, in this process, no Ray): the seed CNN (pipelines/digits'
DigitsCNN, AdamW, batch 32) timed per training step and per fingerprint of its weights and
optimizer state (`raytrain.instruments.agreement`), medians of interleaved repeats; its cost per step
at the default interval: before every checkpoint (digits checkpoints at each epoch's end: 23
steps at 2 workers) and at least every 1,000 steps.

Rounds alternate the order; every figure is the median over rounds. Usage:

    python benchmarks/overhead.py --rounds 2 [--skip throughput,start,phases,head,fingerprint] [--head-env K=V]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import raytrain  # noqa: E402
from benchmarks import startup_phases  # noqa: E402
from benchmarks.start_common import echo, head_command, start_template, timed_process  # noqa: E402

TARGETS = {"mlp": 0.97, "cnn": 0.95, "first_step_s": 10.0, "end_to_end_s": 12.0, "fingerprint_share": 0.01}
# The steps between two replica checks by default for digits: an epoch (1,437 rows at global batch 64).
DIGITS_STEPS_PER_EPOCH = 23
# With `raytrain up` running: end to end against the template, and the first step (issue 32).
HEAD_TARGETS = {"end_to_end_ratio": 2.0, "first_step_s": 6.0}


def _table(columns: dict[str, np.ndarray]):
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    return ray.data.from_arrow(
        pa.table({k: ArrowTensorArray.from_numpy(v) if v.ndim > 1 else v for k, v in columns.items()})
    )


class TinyMLP(raytrain.Pipeline):
    """32 features -> 64 -> 10 classes (2,762 parameters) on 32,768 random rows."""

    default_config = {"batch_size_per_worker": 64, "lr": 1e-3, "warmup_epochs": 0}

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def build_datasets(self, cfg):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((32_768, 32), dtype=np.float32)
        return {"train": _table({"x": x, "y": rng.integers(0, 10, len(x))})}

    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    @property
    def name(self) -> str:
        return "tiny-mlp"


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head for 3×32×32 images (the CIFAR tutorial's shape)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        conv = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        conv += [nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*conv)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def forward(self, images):
        return self.head(self.features(images))


class ImageCNN(raytrain.Pipeline):
    """SmallCNN on 3,072 random 3×32×32 images, batch 64 per worker."""

    default_config = {"batch_size_per_worker": 64, "lr": 1e-3, "warmup_epochs": 0}

    def build_model(self, cfg):
        return SmallCNN()

    def build_datasets(self, cfg):
        rng = np.random.default_rng(0)
        images = rng.standard_normal((3_072, 3, 32, 32), dtype=np.float32)
        return {"train": _table({"image": images, "label": rng.integers(0, 10, len(images))})}

    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["image"]), batch["label"])

    @property
    def name(self) -> str:
        return "image-cnn"


MODELS = {"mlp": "benchmarks.overhead:TinyMLP", "cnn": "benchmarks.overhead:ImageCNN"}


# -- the replica check's fingerprint against the step ---------------------------------------------


def fingerprint_cost(repeats: int = 200) -> dict[str, float]:
    """Seconds per training step of the seed CNN and per fingerprint (medians of interleaved repeats)."""
    import torch

    from pipelines.digits.model import DigitsCNN
    from raytrain.instruments.agreement import fingerprint, held_tensors

    torch.manual_seed(0)
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    step_s, check_s = [], []
    for index in range(repeats + 10):
        tick = time.perf_counter()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        middle = time.perf_counter()
        fingerprint(held_tensors(model, optimizer))
        done = time.perf_counter()
        if index >= 10:  # warm-up left out
            step_s.append(middle - tick)
            check_s.append(done - middle)
    step, check = median(step_s), median(check_s)
    return {"step_s": step, "fingerprint_s": check, "per_epoch_share": check / (DIGITS_STEPS_PER_EPOCH * step)}


def fingerprint_report(figures: dict[str, float]) -> str:
    share, target = figures["per_epoch_share"], TARGETS["fingerprint_share"]
    return (
        f"| replica check: fingerprint of the seed CNN's weights and AdamW state / its step | "
        f"{figures['step_s'] * 1e3:.2f} ms step | {figures['fingerprint_s'] * 1e3:.3f} ms | "
        f"{share:.2%} of the step time at the default interval ({DIGITS_STEPS_PER_EPOCH} steps) | ≤ {target:.0%} | "
        f"{'yes' if share <= target else 'no'} |"
    )


# -- throughput: raytrain bench's planned runs, raytrain and the template -------------------------


def plan(kind: str, out: Path, steps: int):
    """The 2-worker run `raytrain bench` would plan for `kind`, with its data saved for the template."""
    from raytrain.bench import BenchOptions, bench_config, plan_runs, prepare_data
    from raytrain.pipeline import load_pipeline

    spec = MODELS[kind]
    pipe = load_pipeline(spec)
    opts = BenchOptions(workers=[2], steps=steps, baselines=["torchrun"], storage=str(out), name=kind)
    values = dict(pipe.default_config)
    base = bench_config(values, opts, workers=2, epochs=1, storage=out / kind / "runs", name="probe")
    (out / kind).mkdir(parents=True, exist_ok=True)
    num_rows = prepare_data(pipe, base, out / kind)
    run = next(r for r in plan_runs(values, opts, out / kind, num_rows) if r.workers == 2)
    return spec, pipe, opts, run


# Ray's own processes, by what their command line holds; the workers and actors are `ray::<name>`.
RAY_SERVICES = ("gcs_server", "raylet", "dashboard", "monitor.py", "log_monitor", "ray.util.client", "Agent")


def renice_ray_services(niceness: int, stop: threading.Event) -> None:
    """Until `stop`: every second, Ray's own processes under this one (GCS, raylet, dashboard and
    its modules, monitors, agents) at `niceness`, its workers and actors at raytrain's (0; they
    would inherit a niceness the raylet had when it forks them)."""
    import psutil

    while not stop.is_set():
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                line = " ".join(process.cmdline())
                service = any(part in line for part in RAY_SERVICES)
                wanted = niceness if service else 0
                if process.nice() != wanted:
                    process.nice(wanted)
        stop.wait(1.0)


def throughput_round(
    index: int, plans: dict, out: Path, raytrain_first: bool, ray_nice: int | None = None
) -> dict[str, dict[str, float]]:
    from raytrain.bench import run_raytrain
    from raytrain.bench.baselines import run_template
    from raytrain.driver.session import ray_session

    figures: dict[str, dict[str, float]] = {kind: {} for kind in MODELS}
    tag = f"r{index}"

    def ours() -> None:
        stop = threading.Event()
        with ray_session(next(iter(plans.values()))[3].cfg):
            if ray_nice is not None:
                threading.Thread(target=renice_ray_services, args=(ray_nice, stop), daemon=True).start()
            try:
                for kind, (_, pipe, _, run) in plans.items():
                    figures[kind]["raytrain"] = run_raytrain(pipe, run, tag, echo)["steady_samples_per_s"]
            finally:
                stop.set()

    def theirs() -> None:
        for kind, (spec, _, opts, run) in plans.items():
            result = run_template(spec, run, opts, out / kind, mode="torchrun", tag=tag, echo=echo)
            figures[kind]["template"] = result["steady_samples_per_s"]

    for block in (ours, theirs) if raytrain_first else (theirs, ours):
        block()
    return figures


# -- start: raytrain train vs the template, the bare floor, raytrain's phases ----------------------


def start_raytrain(out: Path, storage: str, head_file: Path) -> dict[str, float]:
    """`raytrain train`; it joins the head recorded in `head_file` if there is one (`raytrain up`)."""
    command = [str(Path(sys.executable).with_name("raytrain")), "train", "benchmarks.start_common:MarkedDigits"]
    command += ["--workers", "2", "--epochs", "1", "--storage", storage]
    return timed_process(command, out / "mark-raytrain", env={"RAYTRAIN_HEAD_FILE": str(head_file)})


def start_phased(kind: str, storage: str, head_file: Path | None = None) -> dict:
    """startup_phases' contender `kind` (raytrain, raytrain-head or bare): its timeline and its end."""
    started = time.time()
    timeline = startup_phases.measure(kind, 2, storage, str(head_file) if head_file else None)
    return {"timeline": timeline, "first_step_s": timeline[-1][2], "end_to_end_s": time.time() - started}


# -- the report ------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(rounds: list[dict]) -> str:
    lines = ["| figure | template | raytrain | raytrain / template | target | met |", "|---|---:|---:|---:|---|---|"]
    kinds = (("mlp", "MLP (2.8k params), steady samples/s"), ("cnn", "CNN 3×32×32, steady samples/s"))
    for kind, label in kinds if rounds[0]["throughput"] else ():
        ours = median([r["throughput"][kind]["raytrain"] for r in rounds])
        theirs = median([r["throughput"][kind]["template"] for r in rounds])
        ratios = [r["throughput"][kind]["raytrain"] / r["throughput"][kind]["template"] for r in rounds]
        target, met = TARGETS[kind], "yes" if min(ratios) >= TARGETS[kind] else "no"  # in every round
        lines.append(
            f"| {label} | {theirs:,.0f} | {ours:,.0f} | {median(ratios):.3f} | ≥ {target} each round | {met} |"
        )
    starts = (("first_step_s", "time to the first step, s"), ("end_to_end_s", "train digits, end to end, s"))
    both = all("raytrain" in r["start"] and "template" in r["start"] for r in rounds)
    for key, label in starts if both else ():
        ours = median([r["start"]["raytrain"][key] for r in rounds])
        theirs = median([r["start"]["template"][key] for r in rounds])
        target = TARGETS[key]
        lines.append(
            f"| {label} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f}× | ≤ {target:g} | "
            f"{'yes' if ours <= target else 'no'} |"
        )
    if all("raytrain-head" in r["start"] and "template" in r["start"] for r in rounds):
        first = median([r["start"]["raytrain-head"]["first_step_s"] for r in rounds])
        end = median([r["start"]["raytrain-head"]["end_to_end_s"] for r in rounds])
        theirs = median([r["start"]["template"]["end_to_end_s"] for r in rounds])
        ratio = median(
            [r["start"]["raytrain-head"]["end_to_end_s"] / r["start"]["template"]["end_to_end_s"] for r in rounds]
        )
        target = HEAD_TARGETS["end_to_end_ratio"]
        lines.append(
            f"| train digits joining `raytrain up`, end to end, s | {theirs:.1f} | {end:.1f} | {ratio:.2f}× | "
            f"≤ {target:g}× | {'yes' if ratio <= target else 'no'} |"
        )
        target = HEAD_TARGETS["first_step_s"]
        lines.append(
            f"| train digits joining `raytrain up`, first step, s | | {first:.1f} | | ≤ {target:g} | "
            f"{'yes' if first <= target else 'no'} |"
        )
    if all("bare" in r["start"] for r in rounds):
        first = median([r["start"]["bare"]["first_step_s"] for r in rounds])
        end = median([r["start"]["bare"]["end_to_end_s"] for r in rounds])
        lines.append(f"| the floor: bare TorchTrainer, first step / exit, s | | {first:.1f} / {end:.1f} | | | |")
    each = ", ".join(
        f"{k} " + "/".join(f"{r['throughput'][k]['raytrain'] / r['throughput'][k]['template']:.2f}" for r in rounds)
        for k in (MODELS if rounds[0]["throughput"] else ())
    )
    if each:
        lines.append(f"\nRatios by round: {each}.")
    for kind in ("raytrain", "raytrain-head", "bare"):
        timelines = [r["start"][f"{kind}-phases"]["timeline"] for r in rounds if f"{kind}-phases" in r["start"]]
        if timelines:
            lines.append(f"\n{kind}: the start phase by phase (median seconds since the process started)")
            for row in startup_phases.phase_table(timelines):
                lines.append(f"  {row['at']:6.2f}  +{row['seconds']:5.2f}  {row['process']:6s}  {row['to']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150, help="steady steps per throughput run (default 150)")
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to leave out: throughput, start, phases, head"
    )
    parser.add_argument(
        "--head-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the `raytrain up` head (repeatable), e.g. RAY_num_prestart_python_workers=2",
    )
    parser.add_argument(
        "--ray-nice",
        type=int,
        metavar="N",
        help="throughput: Ray's own processes (GCS, raylet, dashboard, agents) at niceness N, its workers at 0",
    )
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    skip = {part for part in args.skip.split(",") if part}
    out = Path(tempfile.mkdtemp(prefix="raytrain-overhead-"))
    storage = str(out / "runs")
    plans = {}
    if "throughput" not in skip:
        from raytrain.config import TrainConfig
        from raytrain.driver.session import ray_session

        with ray_session(TrainConfig(workers=2)):  # the datasets are Ray Datasets: read on raytrain's own Ray
            plans = {kind: plan(kind, out, args.steps) for kind in MODELS}
    no_head, head_file = out / "no-head.json", out / "head.json"  # the first is never written
    with_head = "start" not in skip and "head" not in skip
    if with_head:
        head_command("up", head_file, dict(item.split("=", 1) for item in args.head_env))
    try:
        rounds = run_rounds(args, skip, plans, out, storage, no_head, head_file if with_head else None)
    finally:
        if with_head:
            head_command("down", head_file)
    check = fingerprint_cost() if "fingerprint" not in skip else None
    if args.json:
        figures = {"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": rounds, "fingerprint": check}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print(report(rounds))
    if check is not None:
        print(fingerprint_report(check))


def run_rounds(args, skip: set[str], plans: dict, out: Path, storage: str, no_head: Path, head: Path | None) -> list:
    rounds = []
    for index in range(1, args.rounds + 1):
        first = index % 2 == 1
        figures: dict = {"throughput": {}, "start": {}}
        if plans:
            figures["throughput"] = throughput_round(index, plans, out, raytrain_first=first, ray_nice=args.ray_nice)
            echo(f"round {index}: throughput {json.dumps(figures['throughput'])}")
        if "start" not in skip:
            parts = [
                ("raytrain", lambda: start_raytrain(out, storage, no_head)),
                ("template", lambda: start_template(out)),
            ]
            if head is not None:
                parts += [("raytrain-head", lambda: start_raytrain(out, storage, head))]
            if "phases" not in skip:
                parts += [("bare", lambda: start_phased("bare", storage))]
                parts += [("raytrain-phases", lambda: start_phased("raytrain", storage))]
                if head is not None:
                    parts += [("raytrain-head-phases", lambda: start_phased("raytrain-head", storage, head))]
            for name, measure in parts if first else parts[::-1]:
                try:
                    figures["start"][name] = measure()
                except Exception as exc:  # one contender failing leaves the others' figures
                    echo(f"round {index}: {name} failed: {str(exc)[-1500:]}")
                    continue
                shown = {k: round(v, 2) for k, v in figures["start"][name].items() if k != "timeline"}
                echo(f"round {index}: {name}: {shown}")
            if "bare" in figures["start"]:
                figures["start"]["bare-phases"] = figures["start"]["bare"]
        rounds.append(figures)
        echo(f"round {index} done (load {os.getloadavg()[0]:.1f})")
    return rounds


if __name__ == "__main__":
    main()
