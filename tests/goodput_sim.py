"""A seeded event simulation of a long run under failures, to hold `raytrain.rules.goodput`'s
formulas to (tests/test_goodput_sim.py).

It walks a wall clock event by event, independently of the formulas: every node has its own
exponential failure clock (node 0 holds the driver and the lighthouse); the run computes an
interval, stalls for a save, and the save becomes durable `write_s` later. A failure that
restarts the job drops every save not yet durable, rolls the work back to the last durable one
and spends the restart's recovery (a failure during it starts the recovery again); one the
per-step modes ride out pauses whatever the job is doing for the survivors' wait, the lost
node's share of its replacement's start and the step retaken.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from raytrain.rules.goodput import Scenario


@dataclass
class Simulated:
    wall_s: float
    kept_s: float  # compute in the last durable save at the end
    stalled_s: float  # stalls of the saves that became durable
    restarts: int
    ridden: int

    @property
    def goodput(self) -> float:
        return self.kept_s / self.wall_s


def simulate(s: Scenario, mode: str, interval_steps: int, hours: float, seed: int) -> Simulated:
    rng = random.Random(seed)
    horizon = hours * 3600.0
    clocks = [(rng.expovariate(1.0 / s.node_mtbf_s), node) for node in range(s.nodes)]
    heapq.heapify(clocks)
    tau = interval_steps * s.step_s
    held = max(s.gpus_per_node, s.group_size if mode == "per-step-groups" else 1)
    ride_cost = s.recovery_s[mode] + min(1.0, held / s.workers) * s.replace_s + s.step_s if mode != "restart" else 0
    t, work = 0.0, 0.0
    saves: list[tuple[float, float]] = [(0.0, 0.0)]  # (work saved, when durable), in order
    phase, left = "compute", tau
    restarts = ridden = made = dropped = 0
    while t < horizon:
        failure_at, node = clocks[0]
        if failure_at >= t + left:
            t += left
            if phase == "compute":
                work += tau
                phase, left = "stall", s.stall_s
            elif phase == "stall":
                while len(saves) > 1 and saves[1][1] <= t:  # only the last durable save matters
                    saves.pop(0)
                saves.append((work, t + s.write_s))
                made += 1
                phase, left = "compute", tau
            else:  # recovered
                phase, left = "compute", tau
            continue
        heapq.heapreplace(clocks, (failure_at + rng.expovariate(1.0 / s.node_mtbf_s), node))
        left -= failure_at - t
        t = failure_at
        if mode == "restart" or node == 0 or s.nodes == 1:
            restarts += 1
            durable = [save for save in saves if save[1] <= t]
            dropped += len(saves) - len(durable)
            saves = durable
            work = saves[-1][0]
            phase, left = "recover", s.recovery_s["restart"]
        else:
            ridden += 1
            left += ride_cost
    durable = [save for save in saves if save[1] <= horizon]
    dropped += len(saves) - len(durable)
    return Simulated(horizon, durable[-1][0], (made - dropped) * s.stall_s, restarts, ridden)
