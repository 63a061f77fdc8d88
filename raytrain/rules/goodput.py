"""Goodput: the share of wall time spent on training steps that were kept, and the checkpoint
interval that makes it largest.

The model (docs/fault-tolerance.md, *Goodput*): failures arrive as a Poisson process (each node
fails independently, exponential times between failures, mean `node_mtbf_s`), so the job's
mean time between failures is the node's over the node count. Training runs in segments: an
interval of steps (`interval_s` of compute), then a save that stalls the loop `stall_s`. Under
`restart` a failure anywhere (a step, a save, a recovery) loses the work since the last save
that was durable, and every worker starts again after `recovery_s`. Under the per-step modes a
failed node's replicas are replaced while the others go on: the survivors wait, retake the one
step in flight, and train one node short while the replacement starts; only the loss of the
node holding the driver and the lighthouse (one node's rate) restarts the job from the last save.
A rollback waits `detection_s` more: the head declares a silent node dead before the restart is
placed. Preemptions come on top of the failures; one whose notice covers a save (the step under
way, the stall, the write) loses no step: the job pauses for the save and the restart instead
(per-step: the node's replicas leave at a step boundary). Without such a notice it is a failure.
A pause (a failure ridden out, a preemption saved) lengthens the wall time a rollback can strike.

`restart_goodput` is Daly's exact expression for that process (Daly 2006, "A higher order
estimate of the optimum checkpoint interval for restart dumps", FGCS 22); `daly_interval_s` his
higher-order optimum and `young_interval_s` Young's first-order one (Young 1974, CACM 17(9)).
Pure: no Ray, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HOUR_S = 3600.0
DAY_S = 86400.0
MODES = ("restart", "per-step", "per-step-groups")
"""The fault-tolerance modes the planner compares: --fault-tolerance restart, per-step (a
replica group per worker) and per-step with replica groups (--replica-group-size K)."""

# The per-node MTBF that large runs see. Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models",
# section 3.3.4): 419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs, i.e.
# 2,048 nodes of 8: 54 × 24 × 2048 / 419 ≈ 6,335 node-hours between interruptions.
LLAMA3_NODE_MTBF_H = 54 * 24 * 2048 / 419
DEFAULT_NODE_MTBF_H = round(LLAMA3_NODE_MTBF_H)


class GoodputError(ValueError):
    """Inputs the model cannot use (a negative time, no workers): the caller names the option."""


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young's interval: compute between saves √(2·C·M)."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of the compute between saves: √(2CM)·(1 + ⅓√(C/2M) + ⅑·C/2M) − C
    while C < 2M; M beyond (a save costlier than the failures it guards against)."""
    if stall_s <= 0:
        return 0.0
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = stall_s / (2.0 * mtbf_s)
    return young_interval_s(stall_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall_s


def restart_goodput(interval_s: float, stall_s: float, mtbf_s: float, recovery_s: float) -> float:
    """Kept compute over wall time when each failure rolls back to the last save: a segment of
    `interval_s` compute then `stall_s` saving completes, on average, after
    M·e^(R/M)·(e^((τ+C)/M) − 1) of wall time (Daly's model: failures may strike during a save or
    a recovery too)."""
    if interval_s <= 0:
        return 0.0
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + stall_s)
    # In logs: a failure rate far above the segment's (an MTBF of microseconds, a step of years)
    # overflows e^x, and its goodput is 0 to every digit shown, not an error.
    x = (interval_s + stall_s) / mtbf_s
    log_expm1 = x if x > 30.0 else math.log(math.expm1(x))
    log_wall = math.log(mtbf_s) + recovery_s / mtbf_s + log_expm1
    return math.exp(min(0.0, math.log(interval_s) - log_wall))


@dataclass(frozen=True)
class Scenario:
    """A job on paper: its size, how often its nodes fail and what a step, a save and a
    recovery cost (seconds)."""

    workers: int
    gpus_per_node: int = 8
    node_mtbf_s: float = DEFAULT_NODE_MTBF_H * HOUR_S
    step_s: float = 1.0
    stall_s: float = 1.0
    """The loop's wait at a save (async: the copy to host memory)."""
    write_s: float = 0.0
    """From a save's stall to its files being durable (an async save's background write): a
    failure in that time rolls back one save further."""
    recovery_s: dict[str, float] = field(default_factory=lambda: dict(RECOVERY_S))
    """Per mode: restart, from a failure to every worker training again from the last save;
    per-step, the survivors' wait before they step again (per-step-groups likewise)."""
    replace_s: float = 8.0
    """Per-step modes: from a failure to its replacement training (the group one node short meanwhile)."""
    group_size: int = 8
    """per-step-groups: the workers of one replica group (a lost node takes out the groups it holds)."""
    detection_s: float = 0.0
    """From a node going silent (lost, frozen, cut off) to the head acting on it: a rollback's
    restart is placed only once Ray declares the node dead, so every rollback waits this long. A
    failure the per-step modes ride out does not: the survivors find it by their own peer wait,
    which their `recovery_s` already holds, not by the head."""
    preemptions_per_node_day: float = 0.0
    """Preemptions (a spot or preemptible node reclaimed) per node per day, besides the failures."""
    preemption_notice_s: float = 0.0
    """The warning a preemption gives (a drain's deadline, SIGTERM's grace); 0: none."""

    @property
    def nodes(self) -> int:
        return -(-self.workers // self.gpus_per_node)

    def check(self) -> list[tuple[str, str]]:
        """(input, why) for every value the model cannot use."""
        found = []
        if self.workers < 1:
            found.append(("workers", f"got {self.workers}; need at least 1 worker"))
        if self.gpus_per_node < 1:
            found.append(("gpus_per_node", f"got {self.gpus_per_node}; need at least 1"))
        if self.group_size < 1:
            found.append(("group_size", f"got {self.group_size}; need at least 1"))
        for name in ("node_mtbf_s", "step_s"):
            if not 0 < getattr(self, name) < math.inf:
                found.append((name, f"got {getattr(self, name)}; must be a positive number"))
        for name in (
            "stall_s",
            "write_s",
            "replace_s",
            "detection_s",
            "preemptions_per_node_day",
            "preemption_notice_s",
        ):
            if not 0 <= getattr(self, name) < math.inf:
                found.append((name, f"got {getattr(self, name)}; must be 0 or more"))
        for mode, seconds in self.recovery_s.items():
            if not 0 <= seconds < math.inf:
                found.append((f"recovery_s.{mode}", f"got {seconds}; must be 0 or more"))
        return found


# Measured on this project's CPU runs (docs/fault-tolerance.md, *What it costs*; issue figures):
# a restart about 37 s from a failure to the first step again; a per-step survivor about 1 s.
RECOVERY_S = {"restart": 37.0, "per-step": 1.0, "per-step-groups": 1.0}


@dataclass(frozen=True)
class ModeGoodput:
    """One mode's expected goodput at one interval, and where the rest of the wall time goes
    (shares of wall time, summing to 1 with `goodput`)."""

    mode: str
    workers: int
    interval_steps: int
    goodput: float
    stalls: float
    recovery: float
    redone: float
    failures_per_day: float


def notice_needed_s(s: Scenario) -> float:
    """The shortest notice that keeps every step of a preempted node: the step under way, then a
    save's stall and its write (the node's shard must be durable before the node goes)."""
    return s.step_s + s.stall_s + s.write_s


Pause = tuple[float, float, float, float]
"""Events the job pauses for without losing a save: (per second, then stall, recovery and redone
seconds each)."""


def events(s: Scenario, mode: str) -> tuple[float, list[Pause]]:
    """(events per second that roll the job back to its last durable save, the pauses).

    Rolled back: every failure under `restart`, the head node's under the per-step modes (it holds
    the driver and the lighthouse), and a preemption whose notice is shorter than a save. Paused:
    a preemption with that notice (a save, then the restart without the node), and under the
    per-step modes another node's failure (the survivors' wait, the lost node's share of the job
    times its replacement's start, the step retaken) or preemption (the same without the step
    retaken, when its notice covers the step under way)."""
    failed, preempted = 1.0 / s.node_mtbf_s, s.preemptions_per_node_day / DAY_S
    saved = s.preemption_notice_s >= notice_needed_s(s)
    rollback = failed + (0.0 if saved else preempted)  # per node
    save_and_restart = (preempted if saved else 0.0, s.stall_s, s.recovery_s.get("restart", 0.0), 0.0)
    if mode == "restart" or s.nodes == 1:
        return s.nodes * rollback, [(s.nodes * save_and_restart[0], *save_and_restart[1:])]
    held = max(s.gpus_per_node, s.group_size if mode == "per-step-groups" else 1)
    wait_s = s.recovery_s.get(mode, 0.0) + min(1.0, held / s.workers) * s.replace_s
    left = s.preemption_notice_s >= s.step_s  # the node's replicas leave at the step boundary
    others = s.nodes - 1
    return rollback, [
        save_and_restart,
        (others * (failed + (0.0 if left else preempted)), 0.0, wait_s, s.step_s),
        (others * (preempted if left else 0.0), 0.0, wait_s, 0.0),
    ]


def exposed_rate(rate: float, pauses: list[Pause]) -> float:
    """Rollbacks per second of the job's progress, `rate` a second of wall time: a pause lengthens the
    wall time a rollback can strike, less what the rollback cancels (it ends the pause it strikes).

    A segment of progress L then completes unstruck with probability e^(−L·(λ + μ(1 − B))), μ the
    pauses' rate and B the transform at λ of the pauses a pause starts (one that strikes a pause
    lengthens it): B = Σ μᵢ/μ · e^(−(λ + μ − μB)·cᵢ), its one root in [0, 1], cᵢ each pause's
    seconds. Small pauses give λ / (1 − the paused share)."""
    mu = sum(per_s for per_s, *_ in pauses)
    if mu == 0:
        return rate
    low, high = 0.0, 1.0  # the root, by bisection: B − Σ(...) is concave, below 0 at 0, above at 1
    for _ in range(100):
        b = (low + high) / 2
        starts = sum(per_s / mu * math.exp(-(rate + mu - mu * b) * sum(costs)) for per_s, *costs in pauses)
        low, high = (b, high) if b < starts else (low, b)
    return rate + mu * (1.0 - low)


def restart_mtbf_s(s: Scenario, mode: str) -> float:
    """The mean progress (the job's working time) between the events that send it back to its last save."""
    return 1.0 / exposed_rate(*events(s, mode))


def predict_mode(s: Scenario, mode: str, interval_steps: int) -> ModeGoodput:
    """`mode`'s expected goodput with a save every `interval_steps` steps."""
    rollback_rate, pauses = events(s, mode)
    exposed = exposed_rate(rollback_rate, pauses)
    rollback_s = s.recovery_s.get("restart", 0.0) + s.detection_s
    # A failure while a save is written rolls back one save further: in Daly's expression, as
    # `write_s` more of recovery (first order: the work lost grows by write_s on average). The
    # exponents count rollbacks per second of progress; an attempt still lasts 1/rate of wall time.
    tau = interval_steps * s.step_s
    kept = restart_goodput(tau, s.stall_s, 1.0 / exposed, rollback_s + s.write_s) * rollback_rate / exposed
    per_day = s.nodes * DAY_S / s.node_mtbf_s
    if kept <= 0.0:  # no segment ever completes: the wall time goes to recovering and redoing
        return ModeGoodput(mode, s.workers, interval_steps, 0.0, 0.0, 1.0, 0.0, per_day)
    stalls = s.stall_s * kept / tau + sum(rate * stall for rate, stall, _, _ in pauses)
    recovery_share = rollback_rate * rollback_s + sum(rate * recover for rate, _, recover, _ in pauses)
    redone = max(0.0, 1.0 - kept - stalls - recovery_share)
    return ModeGoodput(mode, s.workers, interval_steps, kept, stalls, recovery_share, redone, per_day)


def best_interval_steps(s: Scenario, mode: str, min_steps: int = 1, max_steps: int | None = None) -> int:
    """Daly's interval for the failures that roll `mode` back, in whole steps within the bounds."""
    seconds = daly_interval_s(s.stall_s, restart_mtbf_s(s, mode))
    return bound_steps(seconds / s.step_s, min_steps, max_steps)


def bound_steps(steps: float, min_steps: int, max_steps: int | None) -> int:
    steps = max(min_steps, round(steps)) if math.isfinite(steps) else (max_steps or min_steps)
    return min(steps, max_steps) if max_steps is not None else steps


def best(s: Scenario, mode: str) -> ModeGoodput:
    """`mode`'s prediction at its best interval."""
    return predict_mode(s, mode, best_interval_steps(s, mode))
