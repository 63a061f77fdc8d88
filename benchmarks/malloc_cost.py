"""What a CPU fsdp worker's fixed mmap threshold costs a step (`parallel.strategy.fix_mmap_threshold`).

    python benchmarks/malloc_cost.py [--rounds 3] [--steps 12] [--world 2] [--threshold-kib 64]

`--world` processes (gloo on this machine) train a charlm-shaped GPT-2 (768 × 8, vocabulary
300, 57 M parameters; Hugging Face transformers, built from a config) under FSDP2, each block
its own unit, AdamW, 4 sequences of 32 tokens per rank, fp32, one thread per process: first
with glibc's allocator as it starts (its mmap threshold rises after the first large free), then
with the threshold fixed at 64 KiB, in alternating order over the rounds, each a fresh set of
processes. Per step after the first two: the wall time (the median over ranks and steps) and
the CPU time and minor page faults of rank 0 (user + system: a fresh mapping's pages are
faulted in and zeroed by the kernel); and each rank's peak RSS. Prints the medians over rounds
and their ratios (fixed ÷ default).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("default", "fixed")  # fixed at --threshold-kib


def worker(rank: int, world: int, port: int, mode: str, steps: int, out: str, threshold_kib: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from raytrain.parallel.strategy import fix_mmap_threshold

    if mode == "fixed":
        assert fix_mmap_threshold(threshold_kib * 1024), "the threshold could not be fixed (not glibc?)"

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = GPT2Config(n_embd=768, n_layer=8, n_head=12, vocab_size=300, n_positions=64)
    model = GPT2LMHeadModel(config)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    wall, cpu, faults = [], [], []
    for _ in range(steps):
        tokens = torch.randint(0, 300, (4, 32), generator=generator)
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_step_faults = [b - a for a, b in zip(faults[1:], faults[2:])]
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"wall": wall[2:], "cpu": cpu[2:], "faults": per_step_faults, "peak_mib": peak_mib})
    )
    dist.destroy_process_group()


def run(mode: str, world: int, steps: int, out: Path, threshold_kib: int) -> dict:
    from raytrain.driver.session import free_port

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(rank), "--world", str(world), "--port", str(port), "--mode", mode]
            + ["--steps", str(steps), "--out", str(out), "--threshold-kib", str(threshold_kib)],
            env=env,
        )
        for rank in range(world)
    ]
    if any(p.wait() for p in processes):
        raise SystemExit(f"a {mode} rank failed")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
    return {
        "step_s": statistics.median(w for r in ranks for w in r["wall"]),
        "cpu_s": statistics.median(ranks[0]["cpu"]),
        "page_faults": statistics.median(ranks[0]["faults"]),
        "peak_mib": max(r["peak_mib"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threshold-kib", type=int, default=64, help="the fixed threshold (default 64 KiB)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.world, args.port, args.mode, args.steps, args.out, args.threshold_kib)
        return
    if args.steps < 3:
        parser.error(f"--steps: got {args.steps}; must be 3 or more (the first two are left out)")
    import tempfile

    rounds = []
    with tempfile.TemporaryDirectory(prefix="malloc-cost-") as tmp:
        for index in range(args.rounds):
            order = MODES if index % 2 == 0 else MODES[::-1]
            figures = {
                mode: run(mode, args.world, args.steps, Path(tmp, f"{index}-{mode}"), args.threshold_kib)
                for mode in order
            }
            print(json.dumps({"round": index, **figures}), flush=True)
            rounds.append(figures)
    for key, label in (
        ("step_s", "step, s (wall)"),
        ("cpu_s", "step, CPU s (rank 0)"),
        ("page_faults", "page faults a step"),
        ("peak_mib", "peak RSS, MiB"),
    ):
        default = statistics.median(r["default"][key] for r in rounds)
        fixed = statistics.median(r["fixed"][key] for r in rounds)
        ratio = statistics.median(r["fixed"][key] / r["default"][key] for r in rounds)
        print(f"{label:22} default {default:9.3f}  fixed {fixed:9.3f}  fixed/default {ratio:.3f}")


if __name__ == "__main__":
    main()
