"""How long the training loop stalls at a checkpoint: local storage vs s3:// (moto on loopback),
the upload synchronous vs asynchronous, with a 50 M-parameter model.

The loop's own checkpoint path, in one process (no Ray, so nothing else competes for the
cores but the store): `TrainingState.save` (the state copied to host memory in the loop's
thread, the files written by a background writer) and the publish step of
`raytrain.rundir.publish` (a rename into the run directory, or the upload with its marker
last). "sync" runs the publish step in the loop's thread, as an upload without ASYNC would;
"async" runs it in the background, as `Runtime.report` hands it to Ray Train's upload thread.

Each round trains `--steps` optimizer steps of a 12 × Linear(2048, 2048) MLP (50.3 M
parameters, AdamW: a 604 MB DCP checkpoint and a 201 MB model.pt) and checkpoints at step
`--at`. The stall is the time the loop's thread spends in the checkpoint call (the step's own
compute excluded: on a loaded machine it varies more than the stall); the steps after it
show what a background upload costs the steps it overlaps (moto is a Python process on the
same two cores here).

    python benchmarks/checkpoint_stall.py --rounds 3            # starts moto_server itself
    MOTO_SERVER=/path/to/moto_server python benchmarks/checkpoint_stall.py

Prints one line per round and a table of medians: stall (s) and stall / local-async.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from raytrain.rules.position import Position  # noqa: E402
from raytrain.rundir import checkpoints as ckpt  # noqa: E402
from raytrain.rundir.publish import Publish  # noqa: E402
from raytrain.rundir.storage import Store  # noqa: E402
from raytrain.worker.state import TrainingState  # noqa: E402

WIDTH, DEPTH, BATCH = 2048, 12, 16


class OneProcess:
    """What TrainingState.save asks of the runtime, for one process."""

    is_rank0 = True

    @staticmethod
    def all_gather_object(value):
        return [value]


def build() -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return TrainingState(model, optimizer, scaler, Position())


def step(state: TrainingState, data: torch.Tensor) -> None:
    state.optimizer.zero_grad(set_to_none=True)
    state.model(data).square().mean().backward()
    state.optimizer.step()


def checkpoint(state: TrainingState, store: Store, staging_root: Path, name: str, sync: bool):
    """The loop's side of a checkpoint; returns the background thread (None when sync)."""
    staging = staging_root / name
    save = state.save(staging, OneProcess(), {}, distributed=False)
    publish = Publish(staging, store / name, save.wait, rank=None, coordinator=True, step=1).run
    if sync:
        publish()
        return None
    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    return thread


def one_round(store: Store, sync: bool, steps: int, at: int) -> dict[str, float]:
    state = build()
    data = torch.randn(BATCH, WIDTH)
    staging_root = Path(tempfile.mkdtemp(prefix="raytrain-stall-staging-"))
    times, background = [], None
    try:
        for index in range(steps):
            started = time.perf_counter()
            step(state, data)
            if index == at:
                blocked = time.perf_counter()
                background = checkpoint(state, store, staging_root, f"checkpoint_s{index:09d}_bench", sync)
                blocked_s = time.perf_counter() - blocked
            times.append(time.perf_counter() - started)
        published = time.perf_counter()
        if background is not None:
            background.join()
        waited = time.perf_counter() - published
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    before = statistics.median(times[1:at])
    after = times[at + 1 :]
    return {
        "step_s": before,
        "stall_s": blocked_s,
        "after_extra_s": sum(t - before for t in after),
        "left_to_upload_s": waited,
        "complete": float(bool(ckpt.checkpoint_dirs(store))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--at", type=int, default=10, help="the step that checkpoints")
    args = parser.parse_args()

    from s3_server import MotoServer, moto_server_binary

    binary = moto_server_binary()
    if binary is None:
        sys.exit("moto_server not found: pip install 'moto[server]>=5.2.5' (or set RAYTRAIN_TEST_MOTO_SERVER)")
    work = Path(tempfile.mkdtemp(prefix="raytrain-stall-"))
    server = MotoServer(binary, work / "moto.log")
    parameters = sum(p.numel() for p in build().model.parameters())
    print(f"model: {parameters / 1e6:.1f} M parameters; moto at {server.endpoint}")
    results: dict[str, list[dict[str, float]]] = {}
    try:
        for round_index in range(args.rounds):
            for where in ("local", "s3"):
                for mode in ("async", "sync"):
                    if where == "local":
                        store = Store.of(work / f"local-{round_index}-{mode}")
                        store.make_dir()
                    else:
                        store = Store.of(server.uri(server.new_bucket(), "runs/bench"))
                    result = one_round(store, mode == "sync", args.steps, args.at)
                    results.setdefault(f"{where} {mode}", []).append(result)
                    print(
                        f"round {round_index + 1} {where:5} {mode:5}: step {result['step_s']:.3f} s, stall "
                        f"{result['stall_s']:.2f} s, extra over the next steps {result['after_extra_s']:.2f} s, "
                        f"upload still running at the end {result['left_to_upload_s']:.1f} s, "
                        f"complete {bool(result['complete'])}",
                        flush=True,
                    )
                    if where == "local":
                        shutil.rmtree(store.path, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(r["stall_s"] for r in results["local async"])
    print("\n| storage, upload | stall at the checkpoint (median s) | × local async | extra over the next steps (s) |")
    print("|---|---|---|---|")
    for key, rows in results.items():
        stall = statistics.median(r["stall_s"] for r in rows)
        extra = statistics.median(r["after_extra_s"] for r in rows)
        print(f"| {key} | {stall:.2f} | {stall / base:.2f} | {extra:.2f} |")


if __name__ == "__main__":
    main()
