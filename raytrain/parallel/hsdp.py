"""Replica groups of K workers (HSDP): FSDP2 shards the model within a group, and torchft's
`Manager` averages the sharded gradients across groups, fault-tolerantly.

Within a group the K workers hold one copy of the model between them, FSDP2 over the group's
own process group (its default group: `raytrain.parallel.strategy.shard`). Rank r of every
group holds the same shard, so the groups average their gradients shard by shard: FSDP2's
reduce-scatter averages within the group, then an all-reduce hook averages each rank's shard
over the same rank of every group in the step's quorum (`average_across_groups`). A group that
joins heals from a live group the same way, rank r from rank r (`holding.Fsdp.live_state`,
`holding.load_local_state`): the shards travel as plain tensors, and are copied into this rank's
own.

A group's shards are one model only together: a member whose peer is gone must leave too, so
that the whole group is replaced (`GroupWatch`). Until it leaves, its group's rank 0 keeps
heartbeating to the lighthouse, which keeps waiting for the group: how soon it leaves is what
the other groups wait.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

import torch
from torch import nn


def average_across_groups(model: nn.Module, manager: Any) -> int:
    """Average each FSDP unit's reduce-scattered gradient shard over the step's groups through
    `manager` (torchft's: a group lost inside the step fails the reduction, and the step is
    not committed). Returns how many units it hooked."""
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp import FSDPModule

    def hook(shard: torch.Tensor) -> None:
        manager.allreduce(shard, reduce_op=ReduceOp.AVG).wait()

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_all_reduce_hook(hook)
    return len(units)


class GroupWatch:
    """Tells a group's members that one of them is gone. Each member counts up its own key in
    the group's store every `interval_s`, and reads its peers'; a peer whose count has not
    moved for `lost_after_s`, or a store that no longer answers, is a lost member, and
    `on_lost(why)` runs once (it says so and ends the process: the group is replaced whole)."""

    def __init__(
        self,
        store: Any,
        group_rank: int,
        group_size: int,
        on_lost: Callable[[str], None],
        *,
        interval_s: float = 0.1,
        lost_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.rank, self.size = store, group_rank, group_size
        self.on_lost, self.interval_s, self.lost_after_s, self.clock = on_lost, interval_s, lost_after_s, clock
        self.seen: dict[int, tuple[int, float]] = {}  # peer: (its count, when it last moved)
        self.stopped = threading.Event()

    def beat(self) -> str | None:
        """Count up this member's key and read the peers'. Returns why a peer is lost, or None."""
        try:
            self.store.add(_key(self.rank), 1)
            peers = [peer for peer in range(self.size) if peer != self.rank and not self.store.check([_done(peer)])]
            counts = {peer: self.store.add(_key(peer), 0) for peer in peers}
        except Exception as exc:  # the store's host is gone, or unreachable
            return f"the group's store no longer answers ({type(exc).__name__})"
        now = self.clock()
        for peer, count in counts.items():
            last, since = self.seen.get(peer, (-1, now))
            if count != last:
                self.seen[peer] = (count, now)
            elif now - since > self.lost_after_s:
                return f"member {peer} of the group stopped for {now - since:.1f} s"
        return None

    def run_in_background(self) -> threading.Thread:
        def watch() -> None:
            while not self.stopped.wait(self.interval_s):
                why = self.beat()
                if why is not None:
                    self.on_lost(why)
                    return

        thread = threading.Thread(target=watch, name="raytrain-group-watch", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """This member is done (its run ended): its peers stop counting its beats. One still
        finishing (writing the last checkpoint's final files) must not take it for lost."""
        self.stopped.set()
        with contextlib.suppress(Exception):
            self.store.set(_done(self.rank), "1")


def _key(rank: int) -> str:
    return f"raytrain/group-watch/{rank}"


def _done(rank: int) -> str:
    return f"raytrain/group-watch/done/{rank}"
