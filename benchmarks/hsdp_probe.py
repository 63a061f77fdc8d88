"""Replica groups of 2 under FSDP2, averaged across groups by torchft, with one group lost and
replaced while the other trains on: the mechanism of per-step recovery for sharded models
(`raytrain.parallel.hsdp`) on CPU and gloo, without Ray.

    python benchmarks/hsdp_probe.py [--steps 40] [--kill-at 8] [--pace-s 0.4] [--lose one|both]
        [--out DIR] [--json FILE]

Four processes form 2 groups of 2 (K=2). Within a group FSDP2 shards a 3-block MLP over the
group's own gloo process group; torchft's Manager (one per rank, the group's rank 0 speaking to
a lighthouse) averages each rank's gradient shard over the same rank of the other group. Every
step trains on the same 32 rows, split over the step's participants: so whatever the groups
present, each committed step is the step of one process on all 32 rows.

At step --kill-at, group 1's rank 1 is SIGKILLed, and its rank 0 is taken out a poll later
(0.25 s, as raytrain's controller takes a lost worker's group out: a group's shards are one
model only together; `GroupWatch` is the backstop); --lose both kills both at once. Then group
1 starts again as new processes: they heal from group 0, rank from rank, and join at a step
boundary (each step lasts at least --pace-s, and the groups train past --steps until the new
group has trained 5 steps with the other, so that the run is still going when the new
processes have started). Group 0's processes run throughout.

Printed: the steps group 0 took (step/groups/committed); the survivors' extra wait for the
failure (their first step alone, plus the step the group was lost in when it was lost inside
one, which is not applied, less one usual step); the model state a rank holds (parameters,
gradients, AdamW's moments) against a DDP worker's over K; and the largest relative
difference of the final weights between the groups and against one process trained on all
rows (fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROWS, WIDTH, K, GROUPS, LR, SEED = 32, 16, 2, 2, 1e-2, 0
# A member whose peer has not beaten for this long leaves (raytrain.parallel.hsdp.GroupWatch):
# the backstop. First, as raytrain's controller does at its next poll of the workers, the probe
# takes the lost member's group out after POLL_S.
LOST_AFTER_S = 3.0
POLL_S = 0.25


def build_model():
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    # 33 hidden units: FSDP2 shards the first two layers unevenly over 2 ranks (17 and 16 rows).
    return nn.Sequential(nn.Linear(WIDTH, 33), nn.Tanh(), nn.Linear(33, 33), nn.Tanh(), nn.Linear(33, WIDTH))


def rows(step: int):
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, WIDTH, generator=generator), torch.randn(ROWS, WIDTH, generator=generator)


def reference(steps: int) -> tuple[dict, int]:
    """One process on all rows, every step: its final weights, and the bytes of model state it
    holds (parameters, gradients, optimizer state), as a DDP worker holds them."""
    import torch
    import torch.nn.functional as F

    from raytrain.parallel.strategy import state_bytes

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    held = 0
    for step in range(steps):
        x, y = rows(step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        held = held or sum(state_bytes(model, optimizer).values())
        optimizer.zero_grad(set_to_none=True)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}, held


def last_step(out: Path, steps: int) -> int:
    """The groups train `steps` steps, and past them until a replacement has trained 5 steps
    with the others (on a loaded machine its processes may take longer to start than the
    steps left): both groups read the same file, steps before they are to stop."""
    try:
        rejoined = int((out / "rejoined").read_text())
    except (FileNotFoundError, ValueError):
        return steps + 1_000_000 if (out / "killed").exists() else steps
    return max(steps, rejoined + 5)


def member(
    group: int, rank: int, store_port: int, lighthouse: str, steps: int, pace_s: float, out: str, replacement: bool
) -> None:
    """One rank of one replica group, to `steps` committed steps (`last_step`)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from raytrain.parallel.holding import load_local_state, local_state
    from raytrain.parallel.hsdp import GroupWatch, average_across_groups
    from raytrain.parallel.strategy import state_bytes
    from raytrain.rules.replicas import step_share

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=K)

    def leave(why: str) -> None:  # the group is replaced whole: its other members go too
        (Path(out) / f"left_{group}_{rank}_{os.getpid()}").write_text(why)
        os._exit(1)

    GroupWatch(store, rank, K, leave, lost_after_s=LOST_AFTER_S).run_in_background()
    model = build_model()
    for block in (model[0], model[2], model[4]):
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    timeout = timedelta(seconds=20)
    pg = ProcessGroupGloo(timeout=timeout)
    healed = []
    manager = Manager(
        pg=pg,
        load_state_dict=lambda state: (load_local_state(model, optimizer, state), healed.append(True)),
        state_dict=lambda: local_state(model, optimizer),
        min_replica_size=1,
        use_async_quorum=False,
        rank=rank,
        world_size=K,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=f"group{group}",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    average_across_groups(model, manager)
    log, held = [], 0
    progress = Path(out) / f"progress_{group}_{rank}"
    while manager.current_step() < last_step(Path(out), steps):
        started = time.perf_counter()
        manager.start_quorum()
        step, groups = manager.current_step(), manager.num_participants()
        share, shares = step_share(manager.participating_rank() or 0, groups, rank, K)
        x, y = rows(step)
        per = ROWS // shares
        F.mse_loss(model(x[share * per : (share + 1) * per]), y[share * per : (share + 1) * per]).backward()
        time.sleep(max(0.0, pace_s - (time.perf_counter() - started)))
        committed = manager.should_commit()
        if committed:
            optimizer.step()
            held = held or sum(state_bytes(model, optimizer).values())
        optimizer.zero_grad(set_to_none=True)
        log.append(
            {
                "step": step,
                "groups": groups,
                "committed": committed,
                "s": time.perf_counter() - started,
                "quorum": manager._quorum_id,
            }
        )
        progress.write_text(str(manager.current_step()))
        if replacement and healed and committed and not (Path(out) / "rejoined").exists():
            (Path(out) / "rejoined").write_text(str(manager.current_step()))
    weights = {name: value.full_tensor() for name, value in model.state_dict().items()}
    if rank == 0:
        torch.save(weights, Path(out) / f"weights_{group}.pt")
    (Path(out) / f"log_{group}_{rank}_{os.getpid()}.json").write_text(
        json.dumps({"log": log, "healed": bool(healed), "held_bytes": held})
    )
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def start_group(group: int, lighthouse: str, steps: int, pace_s: float, out: str, replacement: bool = False):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    procs = [
        context.Process(
            target=member, args=(group, rank, store.port, lighthouse, steps, pace_s, out, replacement), daemon=True
        )
        for rank in range(K)
    ]
    for proc in procs:
        proc.start()
    return store, procs


def step_of(out: Path, group: int) -> int:
    try:
        return int((out / f"progress_{group}_0").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def run(steps: int, kill_at: int, pace_s: float, out: Path, lose: str = "one") -> dict:
    """The scenario of the module's docstring; its figures."""
    import torch
    from torchft.coordination import LighthouseServer

    out.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30_000, heartbeat_timeout_ms=1000)
    started = time.perf_counter()
    groups = {g: start_group(g, lighthouse.address(), steps, pace_s, str(out)) for g in range(GROUPS)}
    first_pids = [p.pid for p in groups[0][1]]
    while step_of(out, 0) < kill_at:
        if any(p.exitcode not in (None, 0) for _, procs in groups.values() for p in procs):
            lighthouse.shutdown()
            raise RuntimeError("hsdp probe: a member failed before the kill")
        time.sleep(0.05)
    _, lost = groups[1]
    (out / "killed").write_text("")
    os.kill(lost[1].pid, signal.SIGKILL)
    killed_at = time.perf_counter()
    if lose == "one":
        time.sleep(POLL_S)  # rank 0 may have left by itself already (a collective with rank 1 failed)
    with contextlib.suppress(ProcessLookupError):
        os.kill(lost[0].pid, signal.SIGKILL)
    for proc in lost:
        proc.join()
    groups[1] = start_group(1, lighthouse.address(), steps, pace_s, str(out), replacement=True)
    replaced_in = time.perf_counter() - killed_at
    for _, procs in groups.values():
        for proc in procs:
            proc.join(timeout=600)
    lighthouse.shutdown()
    logs = {path.name: json.loads(path.read_text()) for path in sorted(out.glob("log_*.json"))}
    survivor = next(v["log"] for k, v in logs.items() if k.startswith("log_0_0_"))
    times = [entry["s"] for entry in survivor]
    usual = statistics.median(times)
    final = {g: torch.load(out / f"weights_{g}.pt") for g in range(GROUPS) if (out / f"weights_{g}.pt").exists()}
    trained = 1 + max(entry["step"] for entry in survivor if entry["committed"])  # steps the run trained
    ref, one_process_bytes = reference(trained)
    held = max(v["held_bytes"] for v in logs.values())

    def max_diff(a: dict, b: dict) -> float:
        return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in b)

    # The survivors' first step without the lost group, and before it the step the group was
    # lost in when it was lost inside one (not applied, and taken again).
    alone = next(i for i, e in enumerate(survivor) if e["groups"] == 1 and i > 0 and survivor[i - 1]["groups"] == 2)
    lost_inside = not survivor[alone - 1]["committed"]
    waited = times[alone] + (times[alone - 1] if lost_inside else 0.0)
    return {
        "exit_codes": {g: [p.exitcode for p in procs] for g, (_, procs) in groups.items()},
        "group0_pids_unchanged": [p.pid for p in groups[0][1]] == first_pids,
        "group1_healed": [v["healed"] for k, v in logs.items() if k.startswith("log_1_")],
        "group0_steps": [[e["step"], e["groups"], e["committed"]] for e in survivor],
        "steps_trained": trained,
        "survivor_step_median_s": round(usual, 4),
        "lost_inside_a_step": lost_inside,
        "survivor_extra_wait_s": round(waited - usual, 3),
        # --lose one: rank 0 taken out (-9), or it left by itself first (1: a failed collective).
        "group1_rank0_exitcode": lost[0].exitcode,
        "group1_left_why": [path.read_text() for path in sorted(out.glob("left_1_*"))],
        "group1_restarted_after_s": round(replaced_in, 2),
        # Model state a rank holds against a DDP worker's (the whole model's) over K.
        "held_bytes_per_rank": held,
        "ddp_held_bytes": one_process_bytes,
        "held_vs_ddp_over_k": round(held / (one_process_bytes / K), 3),
        "groups_max_rel_diff": max_diff(final[0], final[1]) if len(final) == 2 else None,
        "vs_one_process_max_rel_diff": max_diff(final[0], ref) if 0 in final else None,
        "wall_s": round(time.perf_counter() - started, 1),
        "out": str(out),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--pace-s", type=float, default=0.4)
    parser.add_argument(
        "--lose", choices=("one", "both"), default="one", help="one member of group 1 (then the other), or both at once"
    )
    parser.add_argument("--out", default=None, help="the processes' files (default: a new temporary directory)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="hsdp-probe-"))
    report = run(args.steps, args.kill_at, args.pace_s, out, args.lose)
    if args.json:
        Path(args.json).write_text(json.dumps(report))
    steps = report.pop("group0_steps")
    print(json.dumps(report, indent=1))
    print("group 0's steps (step, groups, committed):", " ".join(f"{s}/{g}/{int(c)}" for s, g, c in steps))
    ok = all(code == 0 for codes in report["exit_codes"].values() for code in codes)
    return 0 if ok and report["groups_max_rel_diff"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
