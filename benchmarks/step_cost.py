"""The trainer's own CPU cost per step, without Ray: raytrain's step path against a bare loop.

One process, one thread, no Ray and no process group: `benchmarks.overhead:TinyMLP` (a step of
well under a millisecond) trained through the loop's own step, `Training.take_step` (the
context, the heartbeat marks, the phase timer, the loss window and its snapshot, the commit,
the pipeline's hooks under their rule, the batch plan's weight, the rate set every step) and
through the bare loop a user writes (slice, forward, backward, AdamW). Timed in CPU time of the
thread (`time.thread_time`), so other work on a busy machine does not land in the figure; min
and median over rounds, after 50 warm-up steps each. And the Python calls of a step of the step
path (`sys.setprofile`), a count that noise does not move. The step path runs with its instruments
on (the heartbeat's marks, the phase timer, the rank's own time: what a run does) and off (each
phase block a `nullcontext`: the step as if nothing watched it), round by round with the bare loop.
Usage:

    python benchmarks/step_cost.py [--rounds 7] [--steps 400] [--instruments both|on|off]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from raytrain import hooks  # noqa: E402
from raytrain.config import TrainConfig  # noqa: E402
from raytrain.data.table import Table  # noqa: E402
from raytrain.faults.restart import Recovery  # noqa: E402
from raytrain.instruments.phases import Measures  # noqa: E402
from raytrain.instruments.window import LossWindow  # noqa: E402
from raytrain.parallel.strategy import Prepared  # noqa: E402
from raytrain.pipeline import load_pipeline  # noqa: E402
from raytrain.rules import steps  # noqa: E402
from raytrain.rules.batch import resolve_batch_plan  # noqa: E402
from raytrain.rules.position import Position  # noqa: E402
from raytrain.rules.schedule import run_schedule  # noqa: E402
from raytrain.rundir.heartbeats import Heartbeat  # noqa: E402
from raytrain.worker.loop import Training  # noqa: E402
from raytrain.worker.optim import Rate  # noqa: E402
from raytrain.worker.runtime import Runtime  # noqa: E402
from raytrain.worker.step import StepRunner  # noqa: E402

BATCH, WARMUP = 64, 50


class OneProcess(Runtime):
    """The runtime of a single process on the CPU (what local mode's runtime says), without Ray."""

    def __init__(self) -> None:
        self.world_rank, self.world_size, self.local_rank, self.nodes = 0, 1, 0, 1
        self.distributed, self.backend, self.device = False, "none", torch.device("cpu")


def setup(steps_per_round: int):
    pipe = load_pipeline("benchmarks.overhead:TinyMLP")
    rows = BATCH * (steps_per_round + WARMUP)
    cfg = TrainConfig(
        warmup_epochs=0, batch_size_per_worker=BATCH, reference_batch_size=BATCH, epochs=1, time_phases=True
    )
    rng = np.random.default_rng(0)
    table = Table({"x": rng.standard_normal((rows, 32), dtype=np.float32), "y": rng.integers(0, 10, rows)})
    return pipe, cfg, table


def raytrain_step_s(pipe, cfg, table: Table, n: int, instruments: bool = True) -> tuple[float, float]:
    torch.manual_seed(0)
    plan = resolve_batch_plan(1, batch_size_per_worker=BATCH)
    model = pipe.build_model(cfg)
    optimizer = hooks.call(pipe, "build_optimizer", model, cfg)
    runner = StepRunner(
        pipeline=pipe,
        cfg=cfg,
        runtime=OneProcess(),
        batch_plan=plan,
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        rate=Rate.of(pipe, run_schedule(cfg, plan, len(table)), [1.0] * len(optimizer.param_groups)),
        window=LossWindow.on(torch.device("cpu")),
        measures=Measures(Heartbeat(Path("."), 0, enabled=False), torch.device("cpu"), cfg.time_phases),
        prepared=Prepared.plain(model, cfg.precision),
    )
    if not instruments:  # blocks that mark no heartbeat, lap no timer and count no own time
        phases = runner.measures.step_phases
        phases.data = phases.forward = phases.backward = phases.optimizer = contextlib.nullcontext()
    training = Training(cfg, Recovery(cfg, ".", runner.runtime), None, runner, None, table, None, Position())
    data = table.epoch(0, 0, 0, 0, 1)
    planned = steps.epoch_steps(len(table), BATCH)[: n + WARMUP]
    for step in planned[:WARMUP]:
        training.take_step(data, step, last=False)
    started = time.thread_time()
    for step in planned[WARMUP:]:
        training.take_step(data, step, last=False)
    return (time.thread_time() - started) / n, python_calls(training, data, planned[WARMUP : WARMUP + 20])


def python_calls(training, data, planned) -> float:
    """Python function calls per step of `Training.take_step` (sys.setprofile's "call" events;
    calls into C not counted): the step path's cost in calls, which noise does not move."""
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        for step in planned:
            training.take_step(data, step, last=False)
    finally:
        sys.setprofile(None)
    return calls / len(planned)


def bare_step_s(pipe, cfg, table: Table, n: int) -> float:
    torch.manual_seed(0)
    model = pipe.build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    order = np.random.default_rng(0).permutation(len(table))
    started = 0.0
    for i in range(n + WARMUP):
        if i == WARMUP:
            started = time.thread_time()
        rows = order[i * BATCH : (i + 1) * BATCH]
        batch = {name: torch.from_numpy(column[rows]) for name, column in table.columns.items()}
        pipe.compute_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.thread_time() - started) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--instruments", choices=["both", "on", "off"], default="both")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe, cfg, table = setup(args.steps)
    kinds = {"both": ["on", "off"]}.get(args.instruments, [args.instruments])
    rounds: dict[str, list] = {kind: [] for kind in [*kinds, "bare"]}
    for _ in range(args.rounds):  # round by round, so that a busier moment weighs on every contender
        for kind in kinds:
            rounds[kind].append(raytrain_step_s(pipe, cfg, table, args.steps, instruments=kind == "on"))
        rounds["bare"].append((bare_step_s(pipe, cfg, table, args.steps), 0.0))
    mid, bare = args.rounds // 2, sorted(seconds for seconds, _ in rounds["bare"])
    print(
        f"CPU time per step, min / median of {args.rounds} rounds of {args.steps} steps: "
        f"bare loop {bare[0] * 1e6:.0f} / {bare[mid] * 1e6:.0f} µs"
    )
    for kind in kinds:
        ours, calls = sorted(seconds for seconds, _ in rounds[kind]), rounds[kind][-1][1]
        print(
            f"raytrain, instruments {kind}: {ours[0] * 1e6:.0f} / {ours[mid] * 1e6:.0f} µs; its own cost "
            f"{(ours[0] - bare[0]) * 1e6:.0f} µs per step (from the minima); {calls:.0f} Python calls per step"
        )


if __name__ == "__main__":
    main()
