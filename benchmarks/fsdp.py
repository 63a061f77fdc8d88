"""--strategy fsdp against ddp, measured: memory, equivalence, throughput and checkpoints.

    python benchmarks/fsdp.py OUT_DIR [--sections memory,equivalence,checkpoint]
        [--workers 1,2,4] [--width 768] [--layers 8] [--steps 50]

- memory: `raytrain train charlm` at each worker count under ddp and fsdp, with charlm at
  WIDTH × LAYERS (768 × 8: 57M parameters; 768 × 12: 85M), until its first step: the bytes each
  worker holds of the parameters, their gradients and AdamW's state (summed over its local
  shards by torch's own accounting, as the run's `memory` event reports them) and each
  process's peak RSS. Target: fsdp's per-worker state ≤ 1.15 × (ddp's ÷ N) plus the unsharded
  parts (none here: the root's parameters are sharded too).
- equivalence: the default charlm at fp32, 2 workers, the same seed and global batch, one
  metrics row per step for --steps steps: ddp, fsdp, fsdp with --activation-checkpointing,
  fsdp with --compile, ddp with --compile. Target: each within 1e-4 relative of its plain
  counterpart at every step. The same runs give fsdp's steady throughput against ddp's.
- checkpoint: raytrain's own checkpoint writer (`TrainingState.save`) on charlm at WIDTH ×
  LAYERS under fsdp and ddp at each worker count, in torch.distributed processes (gloo) of
  their own: how long the loop blocks for an asynchronous save (the staging copy) against
  the same save waited for (synchronous), and the time until every file is written. Target:
  asynchronous blocking ≤ 25 % of the synchronous save; under fsdp the per-rank save time
  falls as N grows.

Prints Markdown tables (and writes OUT_DIR/fsdp.json); the figures and commands are in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from raytrain.observe.render import markdown_table  # noqa: E402
from raytrain.rundir import Kind, RunDir  # noqa: E402


def train(out: Path, name: str, **options) -> RunDir:
    from raytrain import TrainConfig, fit

    cfg = TrainConfig(storage=str(out), name=name, progress="off", **options)
    fit("charlm", cfg)
    return RunDir(out / name)


# -- memory ------------------------------------------------------------------------------------


def memory(out: Path, args) -> list[dict]:
    rows = []
    for strategy in ("ddp", "fsdp"):
        for workers in args.workers:
            run = train(
                out,
                f"memory-{strategy}-{workers}",
                strategy=strategy,
                workers=workers,
                epochs=1,
                batch_size_per_worker=2,
                lr=1e-4,
                warmup_epochs=0,
                pipeline_args={
                    "width": args.width,
                    "layers": args.layers,
                    "heads": max(1, args.width // 64),
                    "block": 32,
                    "corpus_mb": 0.0004 * workers,
                },
            )
            event = next(e for e in run.events() if e.kind == Kind.MEMORY)
            row = {"strategy": strategy, "workers": workers}
            for key in ("parameters", "gradients", "optimizer", "peak_rss"):
                row[key] = max(event.extra[key])
            row["state"] = row["parameters"] + row["gradients"] + row["optimizer"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    ddp = {row["workers"]: row for row in rows if row["strategy"] == "ddp"}
    for row in rows:
        if row["strategy"] == "fsdp":
            row["vs_ddp_over_n"] = row["state"] / (ddp[row["workers"]]["state"] / row["workers"])
    return rows


# -- equivalence and throughput ----------------------------------------------------------------

VARIANTS = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "fsdp+ac": {"strategy": "fsdp", "activation_checkpointing": True},
    "fsdp+compile": {"strategy": "fsdp", "compile": True},
    "ddp+compile": {"strategy": "ddp", "compile": True},
}
COUNTERPART = {"fsdp": "ddp", "fsdp+ac": "fsdp", "fsdp+compile": "fsdp", "ddp+compile": "ddp"}


def equivalence(out: Path, args) -> list[dict]:
    losses, speeds = {}, {}
    for name, options in VARIANTS.items():
        run = train(
            out,
            f"equivalence-{name.replace('+', '-')}",
            workers=2,
            epochs=1,
            global_batch_size=32,
            log_every_steps=1,
            precision="fp32",
            pipeline_args={"corpus_mb": round(args.steps * 32 * 129 / 0.95 / 2**20 + 0.01, 3)},
            **options,
        )
        rows = [row for row in run.metrics() if not row.epoch_end]
        losses[name] = {row.step: row.loss for row in rows if row.step <= args.steps}
        speeds[name] = run.summary().steady_samples_per_s
    table = []
    for name, counterpart in COUNTERPART.items():
        steps = sorted(set(losses[name]) & set(losses[counterpart]))
        worst = max(abs(losses[name][s] - losses[counterpart][s]) / abs(losses[counterpart][s]) for s in steps)
        table.append(
            {
                "run": name,
                "against": counterpart,
                "steps": len(steps),
                "max_relative_loss_difference": worst,
                "samples_per_s": speeds[name],
                "throughput_ratio": speeds[name] / speeds[counterpart],
            }
        )
        print(json.dumps(table[-1]), flush=True)
    return table


# -- checkpoints -------------------------------------------------------------------------------


class Harness:
    """What TrainingState.save asks of a runtime, over a plain torch.distributed group."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.world_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_rank0 = self.world_rank == 0
        self.group = None

    def all_gather_object(self, value):
        gathered = [None] * self.world_size
        self.dist.all_gather_object(gathered, value)
        return gathered

    def dcp_options(self, load: bool = False):
        if self.group is None:
            self.group = self.dist.new_group(backend="gloo")
        return {"process_group": self.group}


def _save_times(rank: int, world: int, port: int, strategy: str, width: int, layers: int, root: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from pipelines.charlm.model import CharGPT
    from raytrain.config import TrainConfig
    from raytrain.parallel import strategy as strategies
    from raytrain.parallel.holding import Ddp, Fsdp
    from raytrain.rules.position import Position
    from raytrain.worker.state import TrainingState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = CharGPT(block=32, width=width, layers=layers, heads=max(1, width // 64))
    if strategy == "fsdp":
        model = strategies.shard(model, list(model.blocks), TrainConfig(strategy="fsdp"))
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (2, 33))
    model(tokens[:, :-1]).float().mean().backward()
    optimizer.step()
    holding = Fsdp() if strategy == "fsdp" else Ddp()
    state = TrainingState(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), Position(), holding)
    harness, times, expected = Harness(), {}, None
    for mode in ("warmup", "synchronous", "asynchronous"):
        if mode == "asynchronous" and strategy != "fsdp":
            expected = {k: v.clone() for k, v in state.weights().items()}  # what this save holds
        dist.barrier()
        started = time.perf_counter()
        save = state.save(Path(root) / f"{mode}-{strategy}-{world}", harness, {}, distributed=True)
        returned = time.perf_counter() - started
        if mode == "asynchronous":  # training goes on meanwhile
            model(tokens[:, :-1]).float().mean().backward()
            optimizer.step()
        save.wait()
        dist.barrier()
        times[mode] = {"blocked_s": returned if mode == "asynchronous" else time.perf_counter() - started}
        times[mode]["complete_s"] = time.perf_counter() - started
    # What was saved comes back: the weights of the asynchronous save's step. Unsharded, each
    # rank writes its part of the replicas' state; replicas can differ by an ulp (on CPU, an
    # AdamW step rounds differently on differently aligned memory), hence the tolerance.
    state.load(
        Path(root) / f"asynchronous-{strategy}-{world}", harness, 0, distributed=True, load_optimizer=lambda f: f()
    )
    if expected is not None:
        bad = [k for k, v in state.weights().items() if not torch.allclose(expected[k], v, rtol=1e-6, atol=1e-6)]
        times["loads_back"] = not bad
        if bad:
            print(f"rank {rank}: {len(bad)} tensors differ after loading, e.g. {bad[:3]}", flush=True)
    queue.put((rank, times))
    dist.destroy_process_group()


def checkpoint(out: Path, args) -> list[dict]:
    import torch.multiprocessing as mp

    from raytrain.driver.session import free_port

    rows = []
    for strategy in args.strategies:
        for workers in args.workers:
            context = mp.get_context("spawn")
            queue = context.Queue()
            port = free_port()
            procs = [
                context.Process(
                    target=_save_times,
                    args=(r, workers, port, strategy, args.width, args.layers, str(out / "saves"), queue),
                )
                for r in range(workers)
            ]
            for proc in procs:
                proc.start()
            results = dict(queue.get(timeout=1800) for _ in procs)
            for proc in procs:
                proc.join()
            sync = max(results[r]["synchronous"]["blocked_s"] for r in results)
            blocked = max(results[r]["asynchronous"]["blocked_s"] for r in results)
            complete = max(results[r]["asynchronous"]["complete_s"] for r in results)
            row = {
                "strategy": strategy,
                "workers": workers,
                "synchronous_save_s": sync,
                "asynchronous_blocked_s": blocked,
                "asynchronous_complete_s": complete,
                "blocked_vs_synchronous": blocked / sync,
                "loads_back": all(results[r].get("loads_back", True) for r in results),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sections", default="memory,equivalence,checkpoint")
    parser.add_argument("--workers", default="1,2,4", type=lambda text: [int(n) for n in text.split(",")])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--strategies", default="fsdp,ddp", type=lambda text: text.split(","))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for section in args.sections.split(","):
        results[section] = {"memory": memory, "equivalence": equivalence, "checkpoint": checkpoint}[section](
            args.out, args
        )
        (args.out / "fsdp.json").write_text(json.dumps(results, indent=2))
    for section, rows in results.items():
        print(f"\n{section}:\n")
        print("\n".join(markdown_table(list(rows[0]), [[_cell(v) for v in row.values()] for row in rows])))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and value > 2**20:
        return f"{value / 2**20:,.0f} MiB"
    return str(value)


if __name__ == "__main__":
    main()
