"""A seeded event simulation of a long run under failures, to hold `raytrain.rules.goodput`'s
formulas to (tests/test_goodput_sim.py).

It walks a wall clock event by event, independently of the formulas: every node has its own
exponential failure clock (node 0 holds the driver and the lighthouse); the run computes an
interval, stalls for a save, and the save becomes durable `write_s` later. A failure that
restarts the job drops every save not yet durable, rolls the work back to the last durable one
and spends the detection and the restart's recovery (a failure during them starts them again);
one the per-step modes ride out pauses whatever the job is doing for the survivors' wait, the
lost node's share of its replacement's start and the step retaken. Every node has a preemption
clock too: a preemption is a failure, unless its notice covers the step under way, a save's
stall and its write (then the job pauses for a save and the restart) or, on a node the per-step
modes ride out, the step under way (then the job pauses as for a failure, less the step).
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
    means = {"failed": s.node_mtbf_s}  # between events of each kind, per node
    if s.preemptions_per_node_day:
        means["preempted"] = 86400.0 / s.preemptions_per_node_day
    clocks = [(rng.expovariate(1.0 / means[kind]), node, kind) for node in range(s.nodes) for kind in means]
    heapq.heapify(clocks)
    tau = interval_steps * s.step_s
    held = max(s.gpus_per_node, s.group_size if mode == "per-step-groups" else 1)
    wait_s = s.recovery_s.get(mode, 0.0) + min(1.0, held / s.workers) * s.replace_s
    saved = s.preemption_notice_s >= s.step_s + s.stall_s + s.write_s
    left_early = s.preemption_notice_s >= s.step_s  # a node per-step rides out leaves at the step boundary
    t, work = 0.0, 0.0
    saves: list[tuple[float, float]] = [(0.0, 0.0)]  # (work saved, when durable), in order
    phase, left = "compute", tau
    restarts = ridden = made = dropped = noticed = 0
    while t < horizon:
        failure_at, node, kind = clocks[0]
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
        heapq.heapreplace(clocks, (failure_at + rng.expovariate(1.0 / means[kind]), node, kind))
        left -= failure_at - t
        t = failure_at
        rolls_back = mode == "restart" or node == 0 or s.nodes == 1
        if kind == "preempted" and rolls_back and saved:
            noticed += 1
            left += s.stall_s + s.recovery_s["restart"]
        elif rolls_back:
            restarts += 1
            durable = [save for save in saves if save[1] <= t]
            dropped += len(saves) - len(durable)
            saves = durable
            work = saves[-1][0]
            phase, left = "recover", s.recovery_s["restart"] + s.detection_s
        else:
            ridden += 1
            left += wait_s + (0.0 if kind == "preempted" and left_early else s.step_s)
    durable = [save for save in saves if save[1] <= horizon]
    dropped += len(saves) - len(durable)
    return Simulated(horizon, durable[-1][0], (made - dropped + noticed) * s.stall_s, restarts, ridden + noticed)
