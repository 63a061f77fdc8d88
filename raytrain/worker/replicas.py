"""Per-step fault tolerance (`--fault-tolerance per-step`): every worker is a torchft replica
group, and the replicas that are alive take each step together.

Ray Train's `TorchftConfig` runs torchft's lighthouse and, when a worker dies, replaces only
that replica group. At every step torchft's `Manager` forms a quorum of the live replicas;
a replica that joins heals from a live peer (weights, optimizer, scaler and the training
position) before the step, so it steps on the same rows and rate as the others. Gradients
are averaged over the step's participants, and a step is applied only if every participant
commits it; one that is not committed (a peer died inside it) is taken again from the same
position over the next quorum.

`ReplicaRuntime` is the `Runtime` the loop sees in this mode: its rank and world size are
this replica's place in the current quorum, its collectives go through the Manager, and
checkpoints are written by the quorum's rank 0 straight to the run directory (Ray's report
is a barrier over every worker, which a lost replica would hold up).

Replicas that start together (a fresh start, a resume, a restart of every replica) start their
Managers before they restore and meet at a barrier once restored, so the first quorum holds
all of them; a replacement starts its Manager once it is built, so its restore holds up no
live quorum (`raytrain.driver.replacement` tells each worker which it is).

With `--replica-group-size K` (and `--strategy fsdp`) a replica is a group of K workers that
shard one copy of the model (`raytrain.parallel.hsdp`): the group's K workers form their own
process group on the store the controller hosts for them, rank r of each group steps with
rank r of the others through the Manager, a worker's share of a step's rows is its group's
share split by rank (`raytrain.rules.replicas.step_share`), and the quorum's first group
writes checkpoints together (DCP over the group). A group loses all its workers or none: the
controller takes a lost worker's group out, and a worker that sees a member of its group gone
leaves (`GroupWatch`).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import torch
from ray.train.v2.torch import torchft_config as ray_torchft

from raytrain.parallel.hsdp import GroupWatch
from raytrain.rules import replicas as rules
from raytrain.rundir import RunDir
from raytrain.rundir.records import Event, Kind
from raytrain.rundir.storage import Store
from raytrain.text import first_line
from raytrain.worker.runtime import Quorum, Runtime, group_barrier

# The lighthouse waits up to join_timeout_ms for every live (heartbeating) replica before it
# forms a quorum: torchft's 100 ms default is shorter than a step, so the replicas would never
# all meet; 30 s covers a replica still writing a checkpoint at an epoch's end. A replica is
# gone after heartbeat_timeout_ms without a heartbeat: what the survivors wait when one dies
# (measured here: about 1 s lost per failure at 1000 ms).
JOIN_TIMEOUT_S = 30.0
HEARTBEAT_TIMEOUT_S = 1.0
# A worker of a replica group of several leaves once a member of its group has not beaten for
# this long (`raytrain.parallel.hsdp.GroupWatch`). The controller takes a lost worker's group
# out first, within its poll (`raytrain.driver.replacement`); the watch is for a loss the
# controller does not see. Long enough that a loaded machine, where a process can go a few
# seconds unscheduled, is not taken for a loss (2.5 s seen with 4 workers on 2 cores).
GROUP_LOST_AFTER_S = 15.0
LIGHTHOUSE_KWARGS = {
    "min_replicas": 1,
    "join_timeout_ms": int(JOIN_TIMEOUT_S * 1000),
    "heartbeat_timeout_ms": int(HEARTBEAT_TIMEOUT_S * 1000),
}


class _Backend(ray_torchft._TorchftBackend):
    """Ray Train's torchft backend, with a lighthouse that asks for no CPU. Ray 2.60 pins the
    lighthouse to the controller's node as an actor with the default request of 1 CPU for
    scheduling: on a cluster whose head has none (`ray start --head --num-cpus=0`, where the
    driver and the controller run), it can never be placed and the run never starts. It
    answers a few small requests per step: it needs no CPU of its own."""

    def _maybe_create_lighthouse_actor(self, backend_config) -> str:
        if self.lighthouse_actor is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            self.lighthouse_actor = ray_torchft.LighthouseServerActor.options(
                num_cpus=0, scheduling_strategy=here
            ).remote(lighthouse_kwargs={"bind": "[::]:0", **backend_config.lighthouse_kwargs})
        return super()._maybe_create_lighthouse_actor(backend_config)  # its address, from the actor


class _TorchftConfig(ray_torchft.TorchftConfig):
    @property
    def backend_cls(self):
        return _Backend


def torchft_config(use_gpu: bool, timeout_s: float, min_groups: int = 1):
    """The TorchTrainer's torch_config in per-step mode. `min_groups`: the fewest replica
    groups a quorum takes a step with (an elastic run's MIN, in groups; a fixed run's
    survivors go on whatever is lost)."""
    return _TorchftConfig(
        lighthouse_kwargs={**LIGHTHOUSE_KWARGS, "min_replicas": min_groups},
        backend="nccl" if use_gpu else "gloo",
        timeout_s=timeout_s,  # seconds as given: Ray makes a timedelta of them (0.5 stays 0.5)
    )


class StallWatch:
    """Ends a replica stuck in one step's work (a hung kernel, a lost NFS mount): past the
    step's limit (`raytrain.rules.replicas.stall_after_s`), `on_stall(step, seconds)` runs (it
    says so and exits the process, and Ray Train replaces the replica). The others' all-reduce
    gave up on it long before; once it is gone the lighthouse forms their quorum without it."""

    def __init__(self, on_stall: Callable[[int, float], None], clock: Callable[[], float] = time.monotonic):
        self.on_stall, self.clock = on_stall, clock
        self.step: int | None = None
        self.since, self.limit_s = 0.0, math.inf

    def enter(self, step: int, limit_s: float) -> None:
        self.since, self.limit_s, self.step = self.clock(), limit_s, step

    def leave(self) -> float:
        """Seconds since `enter`."""
        self.step = None
        return self.clock() - self.since

    def check(self) -> bool:
        """Whether the replica is stalled (then `on_stall` has run)."""
        step = self.step
        if step is None:
            return False
        seconds = self.clock() - self.since
        if seconds <= self.limit_s:
            return False
        self.on_stall(step, seconds)
        return True

    def run_in_background(self, interval_s: float = 1.0) -> threading.Thread:
        def watch() -> None:
            while not self.check():
                time.sleep(interval_s)

        thread = threading.Thread(target=watch, name="raytrain-stall-watch", daemon=True)
        thread.start()
        return thread


class ReplicaRuntime(Runtime):
    """This worker as one replica of the quorum (see the module's docstring)."""

    per_step = True

    def __init__(self, timeout_s: float, run_dir: "str | os.PathLike | Store", group_size: int = 1) -> None:
        super().__init__()

        self.replica_rank, self._replicas = self.world_rank, self.world_size  # Ray Train's rank and size
        self.timeout_s = timeout_s
        self.group_size = group_size
        self.group, self.group_rank = rules.group_of(self.replica_rank, group_size)
        self.group_store: tuple[str, int] | None = None  # a group of several workers: where it meets
        self.group_watch: GroupWatch | None = None
        self.quorum = Quorum(self.replica_count, self.replica_rank)  # until the first step's quorum
        self.healed = False
        self.starts_with_group = rules.starts_with_group(os.environ)
        self.manager = None
        self._state: Callable[[], dict[str, Any]] | None = None
        self._load: Callable[[dict[str, Any]], None] | None = None
        self.run_dir = Store.of(run_dir)
        self.watch = StallWatch(self._leave_stalled)
        self.work_s: deque[float] = deque(maxlen=rules.STEPS_REMEMBERED)  # committed steps' work
        self.distributed = True
        collectives = "nccl" if self.device.type == "cuda" else "gloo"
        self.backend = f"torchft ({collectives}) over {self.replica_count} replicas"
        if group_size > 1:
            self._form_group(collectives)
            groups = self.replica_count // group_size
            self.backend = f"torchft ({collectives}) over {groups} replica groups of {group_size} (fsdp within each)"

    def _form_group(self, backend: str) -> None:
        """This worker's replica group of several: the process group its model is sharded over
        (its default group, in place of Ray Train's group of one), met on the group's store
        (`raytrain.driver.replacement`), and the watch that ends this worker once a member of
        its group is gone (the group is replaced whole)."""
        import torch.distributed as dist

        host, port, generation = os.environ[rules.GROUP_STORE_ENV].rsplit(":", 2)
        self.group_store = (host, int(port))
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"raytrain/group/{generation}", store),
            rank=self.group_rank,
            world_size=self.group_size,
            timeout=timeout,
        )
        watched = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
        self.group_watch = GroupWatch(
            watched, self.group_rank, self.group_size, self._leave_group, lost_after_s=GROUP_LOST_AFTER_S
        )
        self.group_watch.run_in_background()

    @property
    def replica_count(self) -> int:
        return self._replicas

    # -- the quorum ---------------------------------------------------------------------

    def start_manager(self) -> None:
        """Start this replica's torchft Manager: from here on it heartbeats to the lighthouse,
        which waits for every heartbeating replica before it forms a quorum. Replicas that start
        together call it before they restore, so that the first of them to ask for a quorum
        waits for the others; a replacement calls it once built, so that its restore holds up
        no live quorum."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        timeout = timedelta(seconds=self.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if self.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        if self.group_store is not None:  # rank r of every group averages with rank r of the others
            host, port = self.group_store
            group = {"rank": self.group_rank, "world_size": self.group_size, "store_addr": host, "store_port": port}
            replica_id = f"raytrain_group_{self.group}"
        else:  # a replica group of one worker: rank 0 of 1 inside it (RANK/WORLD_SIZE hold Ray Train's)
            group, replica_id = {"rank": 0, "world_size": 1}, f"raytrain_{self.replica_rank}"
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load_live_state,
            state_dict=self._live_state,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the step's rows are chosen
            replica_id=replica_id,
            **group,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=rules.quorum_wait_s(self.timeout_s, JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S)),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=self.device),
        )

    def join(
        self, model: torch.nn.Module, state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]
    ) -> torch.nn.Module:
        """Ready to step: returns `model` in torchft's DDP (gradients averaged over each step's
        participants), or, sharded within a group of several workers, with its gradient shards
        averaged across the step's groups (`raytrain.parallel.hsdp`). `state`/`load`: what a
        joining replica copies from a live one (model, optimizer, scaler, position). Starts the
        Manager if it has not started yet."""
        from torchft import DistributedDataParallel

        from raytrain.parallel.hsdp import average_across_groups

        self._state, self._load = state, load
        if self.manager is None:
            self.start_manager()
        self.watch.run_in_background()
        if self.group_store is not None:
            average_across_groups(model, self.manager)
            return model
        return DistributedDataParallel(self.manager, model)

    def _live_state(self) -> dict[str, Any]:
        return self._state() if self._state is not None else {}

    def _load_live_state(self, state: dict[str, Any]) -> None:
        if state and self._load is not None:
            self._load(state)
            self.healed = True

    def _leave_group(self, why: str) -> None:
        """A member of this worker's group is gone, and its shards with it: say so, then exit,
        so that the whole group is replaced while the other groups go on."""
        message = f"Replica group {self.group} lost a worker ({why}): its worker {self.group_rank} leaves too"
        with contextlib.suppress(Exception):
            RunDir(self.run_dir).append_event(
                Event(Kind.QUORUM, message, extra={"group": self.group, "replica": self.replica_rank})
            )
        os._exit(1)

    def _leave_stalled(self, step: int, seconds: float) -> None:
        """Say which replica stalled, then exit: Ray Train replaces it, the others go on."""
        usual = f"its steps take {statistics.median(self.work_s):.2g} s" if self.work_s else "its first step"
        message = (
            f"Replica {self.replica_rank} stuck in step {step} for {seconds:.0f} s (the others gave up on it after "
            f"--collective-timeout-s {self.timeout_s:g}; {usual}): it leaves the quorum and is replaced; "
            "the others go on"
        )
        with contextlib.suppress(Exception):
            RunDir(self.run_dir).append_event(
                Event(Kind.STALL, message, extra={"replica": self.replica_rank, "step": step, "seconds": seconds})
            )
        os._exit(1)

    def start_step(self, step: int) -> Quorum:
        """The quorum of the step at `step` (a joining replica heals first). From here to the
        commit the stall watch runs: the wait for the quorum is not this replica's work."""
        self.healed = False
        self.manager.start_quorum()
        place = self.manager.participating_rank()  # this group's among the step's groups
        rank, size = rules.step_share(place or 0, self.manager.num_participants(), self.group_rank, self.group_size)
        self.quorum = Quorum(size, rank)
        # The loop splits rows, weights gradients and writes files by its place in the quorum.
        self.world_size, self.world_rank = self.quorum.size, self.quorum.rank
        self.watch.enter(step, rules.stall_after_s(self.timeout_s, list(self.work_s)))
        return self.quorum

    def commit(self) -> bool:
        """Whether every participant finished the step (then, and only then, apply it)."""
        committed = False
        try:
            committed = bool(self.manager.should_commit())
            return committed
        finally:
            seconds = self.watch.leave()
            if committed:
                self.work_s.append(seconds)

    def wait_for_group(self) -> str | None:
        """Replicas that start together meet here once restored, so that the first quorum holds
        every one of them. Returns why it could not wait (a replica lost while the group
        started, or one slower than --collective-timeout-s), or None."""
        if not self.starts_with_group or self.replica_count == 1:
            return None
        try:
            group_barrier()
        except Exception as exc:  # a replica lost (Ray resets the barrier) or late: start without it
            return f"{type(exc).__name__}: {first_line(str(exc))}"
        return None

    def shutdown(self) -> None:
        if self.group_watch is not None:
            self.group_watch.stop()
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    # -- what the loop sees (per_step: no collective outside a step, `Runtime`) ----------------

    @property
    def distributed_checkpoints(self) -> bool:
        """A group of several workers writes and reads its checkpoints together (DCP over the
        group); a replica of one writes and reads all of one by itself."""
        return self.group_store is not None

    @property
    def writes_checkpoints(self) -> bool:
        """The quorum's first group writes them (a group of one: the quorum's rank 0)."""
        return self.quorum.rank < self.group_size

    def group_sum(self, values: list[float]) -> list[float]:
        """Sum over this worker's group (a collective within it; a group of one: these values).
        What a group's workers decide from it, they decide alike."""
        if self.group_store is None:
            return list(values)
        return self._sum_in_process_group(values)  # the group's own process group is the default one

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every worker of this group's `value`, by rank in the group (a group of one: this one's)."""
        if self.group_store is None:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.group_size
        dist.all_gather_object(gathered, value)
        return gathered

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over the participants of the last step: within the group, then across the
        groups (a failed reduction across groups counts this group only)."""
        from torch.distributed import ReduceOp

        values = self.group_sum(values)
        tensor = torch.tensor(
            values, dtype=torch.float64 if self.device.type == "cpu" else torch.float32, device=self.device
        )
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        errored = float(self.manager.errored() is not None)  # a member lost after the commit
        if self.group_sum([errored])[0] if self.group_store is not None else errored:
            return list(values)  # this group's own figures, the same on each of its workers
        return [float(v) for v in tensor.tolist()]


__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "JOIN_TIMEOUT_S",
    "LIGHTHOUSE_KWARGS",
    "Quorum",
    "ReplicaRuntime",
    "StallWatch",
    "torchft_config",
]
