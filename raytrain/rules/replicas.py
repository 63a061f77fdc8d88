"""Per-step fault tolerance's rules: how a replica starts, when it is stuck in a step, and how
long it waits for its quorum.

Replicas that start together (a fresh start, a resume, a restart of every replica) must all be
in the first quorum, so they wait for each other; a replacement of one lost replica joins a
live quorum and waits for no one. The controller tells each worker which it is (`START_ENV`).

A step's work (after its quorum formed, to the commit) is the replica's forward and backward,
then the gradient all-reduce, which gives up on a missing member after the peer wait
(`peer_wait_s`): the collective timeout until the replica has committed a step, then four of
its usual steps, at least PEER_WAIT_MIN_S, doubled for each step in a row that was not
committed (so that peers merely slower than that are waited for on the next try) and never
more than the collective timeout. A host lost, frozen or cut off thus costs the survivors the
peer wait and a new quorum (the lighthouse forgets a member after a second without its
heartbeat), not the collective timeout. A quorum, and a heal from a live peer, wait the
collective timeout. A replica whose work outlasts the peer wait by more than its grace is stuck
(a hung kernel, a lost mount) and must leave: while it lives it heartbeats, and torchft's lighthouse keeps
counting it. With three replicas or more the others go on without it after the lighthouse's
join wait; with two, the lighthouse forms no quorum of one out of two live replicas (its guard
against a split brain), so the survivor waits until the stuck one is gone.

The grace follows the replica's own committed steps, so a slow but healthy step is never taken
for a hang: four of its usual steps, at least STALL_GRACE_MIN_S. A replica that has not
committed a step yet (its first, where a compile or a warm-up may run) gets the longer of
FIRST_STEP_GRACE_S and the collective timeout, and so, under --compile, does a step whose rows
have a shape no committed step had (an epoch's smaller last step, a new quorum's share), which
Dynamo compiles again (`new_shape_stall_after_s`). Pure: nothing here touches Ray or torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

# Set on every per-step worker before its training function runs (raytrain.faults.replacement).
START_ENV = "RAYTRAIN_REPLICA_START"
# With replica groups of several workers: "HOST:PORT:GENERATION" of the worker's group's store.
GROUP_STORE_ENV = "RAYTRAIN_GROUP_STORE"
STARTS_WITH_GROUP = "group"
REPLACES_ONE = "replacement"

# Floor of the grace: longer than the scheduling noise of a loaded machine (a healthy step
# delayed by it must not be taken for a hang).
STALL_GRACE_MIN_S = 10.0
# The grace in usual steps of this replica.
STEPS_OF_GRACE = 4
# The grace of a replica that has not committed a step yet (first forward and backward: a
# compile, allocations, a warm-up).
FIRST_STEP_GRACE_S = 60.0
# How many of a replica's last committed steps its usual step is taken from.
STEPS_REMEMBERED = 50
# Floor of the peer wait: above what replicas of one run drift apart in a healthy step on a
# loaded machine (a data read, a collection), under the 10 s a lost host may cost the others.
PEER_WAIT_MIN_S = 5.0


def group_of(world_rank: int, group_size: int) -> tuple[int, int]:
    """(group, rank within it) of a worker when replicas are groups of `group_size` workers
    that shard one model (HSDP): consecutive world ranks, which Ray Train gives a node's
    workers, so that a group spans as few nodes as it can."""
    return divmod(world_rank, group_size)


def step_share(group_in_quorum: int, groups: int, group_rank: int, group_size: int) -> tuple[int, int]:
    """(rank, size) of a worker's share of a step's rows: the step's quorum of `groups` groups
    splits the global batch by group, and each group by rank, so the shares of every
    participant are disjoint and together the whole batch."""
    return group_in_quorum * group_size + group_rank, groups * group_size


def whole_groups(workers: int, group_size: int) -> int:
    """The most workers of `workers` that make whole replica groups: an elastic per-step run
    starts, shrinks and grows by whole groups (a part of a group holds no model)."""
    return workers // group_size * group_size


class GroupGenerations:
    """Which incarnation of its replica group a starting worker joins. A group of several
    workers is one model only together: when one of its workers is replaced, the group starts
    again as a new generation (a new rendezvous), which its other workers join as they are
    replaced in turn (they leave once they see the loss). A worker that starts while it is
    still a member of its group's current generation is the first of a new one."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.generation: dict[int, int] = {}
        self.members: dict[int, set[int]] = {}

    def start_all(self, world_size: int) -> dict[int, int]:
        """Every worker starts (a fresh start, a restart of the whole group): each group's next
        generation, by group."""
        for group in range(world_size // self.group_size):
            self.generation[group] = self.generation.get(group, -1) + 1
            self.members[group] = set(range(group * self.group_size, (group + 1) * self.group_size))
        return dict(self.generation)

    def start_one(self, world_rank: int) -> tuple[int, int, bool]:
        """A replacement starts: (its group, the generation it joins, whether that generation
        is new)."""
        group = world_rank // self.group_size
        members = self.members.setdefault(group, set())
        new = world_rank in members or group not in self.generation
        if new:
            self.generation[group] = self.generation.get(group, -1) + 1
            members.clear()
        members.add(world_rank)
        return group, self.generation[group], new

    def taken_out(self, failing: "set[int] | list[int]") -> set[int]:
        """The workers to take out for `failing` ones: a failing member of its group's current
        generation takes every member of that generation out with it (their shards alone are
        no model); a failing worker of an earlier generation (one taken out already, or left),
        only itself: its group's new generation is forming without it."""
        out: set[int] = set()
        for rank in failing:
            members = self.members.get(rank // self.group_size, set())
            out |= members if rank in members else {rank}
        return out


def starts_with_group(environ: Mapping[str, str]) -> bool:
    """Whether this worker starts with its group (and waits for it). Unsaid, it is taken for a
    replacement: one that waits for no one can never hold a live quorum up."""
    return environ.get(START_ENV) == STARTS_WITH_GROUP


def peer_wait_s(collective_timeout_s: float, committed_work_s: Sequence[float], uncommitted_in_a_row: int = 0) -> float:
    """How long a step's collectives across replicas wait for a missing peer before the step is
    given up (not committed; the next quorum forms without a peer that stopped heartbeating):
    see the module's docstring."""
    if not committed_work_s:
        return collective_timeout_s  # a first step may compile
    usual = _usual_step_s(committed_work_s)
    return min(collective_timeout_s, max(PEER_WAIT_MIN_S, STEPS_OF_GRACE * usual) * 2 ** min(uncommitted_in_a_row, 20))


def stall_after_s(peer_wait_s: float, committed_work_s: Sequence[float]) -> float:
    """How long a replica may stay in one step's work before it is taken as stuck: the peer
    wait (how long the others' all-reduce waits for it), then its grace."""
    if not committed_work_s:
        return peer_wait_s + max(FIRST_STEP_GRACE_S, peer_wait_s)
    return peer_wait_s + max(STALL_GRACE_MIN_S, STEPS_OF_GRACE * _usual_step_s(committed_work_s))


def new_shape_stall_after_s(peer_wait_s: float, collective_timeout_s: float) -> float:
    """How long a replica may stay in a step whose rows have a shape none of its committed steps
    had: Dynamo compiles such a step again (on a GPU, seconds to minutes against a step's tenths
    of a second), so it gets a first step's grace."""
    return peer_wait_s + max(FIRST_STEP_GRACE_S, collective_timeout_s)


def _usual_step_s(committed_work_s: Sequence[float]) -> float:
    """A replica's usual step: the median of its last STEPS_REMEMBERED committed steps."""
    return statistics.median(committed_work_s[-STEPS_REMEMBERED:])


def quorum_wait_s(collective_timeout_s: float, join_timeout_s: float, heartbeat_timeout_s: float) -> float:
    """How long a replica waits for its quorum before it fails: long enough for a stuck member
    to leave (the longest `stall_after_s`, that of a first step) and be forgotten by the
    lighthouse, and for the lighthouse's join wait. A member stuck outside a step (validation, a
    checkpoint write) is not watched: with two replicas the other waits this long for it, then
    fails too, and Ray Train restarts both from the last checkpoint."""
    first_step = stall_after_s(collective_timeout_s, ())
    return first_step + join_timeout_s + 2 * heartbeat_timeout_s


def partial_start_line(size: int, replicas: int, not_waited: str | None, join_timeout_s: float) -> str:
    """Why replicas that started together do not all take the first step: `size` of `replicas`
    met; `not_waited`: why the others could not wait for them (None: they were not ready within
    the lighthouse's join wait)."""
    why = (
        f"the others could not wait for them ({not_waited})"
        if not_waited
        else f"they were not ready within the lighthouse's {join_timeout_s:g} s join wait"
    )
    joins = "the others join when ready, healed from a live peer"
    return f"Training starts with {size} of {replicas} replicas: {why}; {joins}"
