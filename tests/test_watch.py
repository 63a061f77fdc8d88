"""Pure tier: stragglers named from the ranks' own step times, replicas compared by fingerprint
(`raytrain.rules.stragglers`, `raytrain.rules.agreement`, `raytrain.instruments.agreement`)."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch

from raytrain.config import TrainConfig
from raytrain.errors import ConfigError
from raytrain.instruments.agreement import fingerprint, held_tensors, mismatch_line
from raytrain.instruments.phases import OwnTime, PhaseTimer, StepPhases
from raytrain.rules import agreement, stragglers
from raytrain.rules.stragglers import RankTimes, StragglerWatch, step_ratios
from raytrain.rundir.records import Kind


def window(step_s: list[float], data_s: list[float] | None = None, steps: int = 10) -> list[RankTimes]:
    data_s = data_s or [0.0] * len(step_s)
    return [RankTimes((s - d) * steps, d * steps, steps) for s, d in zip(step_s, data_s)]


def test_each_rank_is_compared_with_the_median_of_the_others():
    assert step_ratios(window([0.05, 0.35, 0.05])) == pytest.approx([1 / 4, 7.0, 1 / 4], rel=1e-6)
    assert step_ratios(window([0.1])) == [1.0]  # alone: nothing to compare with
    assert step_ratios([RankTimes(1.0, 0.0, 10), RankTimes(0.0, 0.0, 0)]) == [1.0, 1.0]  # no steps measured


def test_a_straggler_is_named_once_after_enough_slow_steps_and_again_only_when_the_picture_changes():
    watch = StragglerWatch(factor=1.5, steps_needed=20)
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert watch.observe(window([0.05, 0.35, 0.05]), hosts) == []  # 10 slow steps
    found = watch.observe(window([0.05, 0.35, 0.05]), hosts)  # 20
    assert [(s.rank, s.host, s.cause, s.steps, s.ended) for s in found] == [(1, "10.0.0.2", "compute", 20, False)]
    assert found[0].record()["step_ratio"] == pytest.approx(7.0)
    assert "rank 1 (host 10.0.0.2) takes 7.0×" in found[0].line(1.5) and "computes slowly" in found[0].line(1.5)
    assert watch.observe(window([0.05, 0.4, 0.05]), hosts) == []  # still slow: said already
    # Now it waits for its data: the cause changed, said again.
    changed = watch.observe(window([0.05, 0.4, 0.05], data_s=[0.0, 0.3, 0.0]), hosts)
    assert [(s.rank, s.cause) for s in changed] == [(1, "data")] and "waits for its data" in changed[0].line(1.5)
    gone = watch.observe(window([0.05, 0.06, 0.05]), hosts)
    assert [(s.rank, s.ended) for s in gone] == [(1, True)] and "gone" in gone[0].line(1.5)
    assert watch.observe(window([0.05, 0.06, 0.05]), hosts) == []


def test_a_rank_slow_only_now_and_then_is_never_named():
    watch = StragglerWatch(factor=1.5, steps_needed=20)
    for _ in range(10):  # slow one window in two: never 20 steps running
        assert watch.observe(window([0.05, 0.3, 0.05]), ["a", "b", "c"]) == []
        assert watch.observe(window([0.05, 0.05, 0.05]), ["a", "b", "c"]) == []


def test_a_step_counts_its_own_phases_and_leaves_the_backward_out():
    own = OwnTime()
    heartbeat = type("Beat", (), {"mark": lambda self, step, phase: None})()
    phases = StepPhases(heartbeat, 0, PhaseTimer(None, lambda: None), own)
    for phase, seconds in (("data", 0.02), ("forward", 0.03), ("backward", 0.2), ("optimizer", 0.01)):
        with getattr(phases, phase):
            time.sleep(seconds)
    with pytest.raises(RuntimeError), phases.forward:  # a phase that raised counts nothing
        raise RuntimeError
    own.steps += 1
    taken = own.take()
    assert 0.02 <= taken.data_s < 0.1 and 0.04 <= taken.compute_s < 0.15, taken  # no backward
    assert taken.steps == 1 and own.take() == RankTimes(0.0, 0.0, 0)


class Device:
    """A GPU's clock as CUDA events see it: kernels advance `now_ms`, the host returns at once;
    `done`: whether the device has reached the events recorded so far."""

    def __init__(self) -> None:
        self.now_ms, self.done, self.waits = 0.0, False, 0

    def event(self) -> "Event":
        return Event(self)


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.at_ms = device, device.now_ms

    def query(self) -> bool:
        return self.device.done

    def synchronize(self) -> None:
        self.device.waits += 1

    def elapsed_time(self, end: "Event") -> float:
        return end.at_ms - self.at_ms


def test_on_a_gpu_the_compute_phases_count_the_devices_time_read_at_the_sync(monkeypatch):
    import raytrain.instruments.phases as phases_module

    device = Device()
    monkeypatch.setattr(phases_module, "recorded_event", device.event)
    own = OwnTime(on_gpu=True)
    heartbeat = type("Beat", (), {"mark": lambda self, step, phase: None})()
    phases = StepPhases(heartbeat, 0, PhaseTimer(None, lambda: None), own)
    # The host queues each phase's kernels and returns: only the device's clock moves, as the
    # slow device's would, while its host runs ahead and waits wherever the others' wait too.
    for phase, device_ms, host_s in (
        ("data", 0, 0.02),
        ("forward", 300, 0),
        ("backward", 900, 0),
        ("optimizer", 100, 0),
    ):
        with getattr(phases, phase):
            device.now_ms += device_ms
            time.sleep(host_s)
    own.steps += 1
    assert own.compute_s == 0.0 and device.waits == 0  # nothing read, nothing waited for, in the step
    taken = own.take()
    assert taken.compute_s == pytest.approx(0.4) and 0.02 <= taken.data_s < 0.1, taken  # no backward
    assert device.waits == 2 and own.pending == []  # the two compute blocks, at the sync
    # Between syncs the blocks the device has done are read without waiting, so few stay held.
    for _ in range(phases_module.EVENTS_HELD):
        with phases.forward:
            device.now_ms += 1
    assert len(own.pending) == phases_module.EVENTS_HELD  # the device has not caught up: kept
    device.done = True
    with phases.forward:
        device.now_ms += 1
    assert own.pending == [] and own.compute_s == pytest.approx((phases_module.EVENTS_HELD + 1) / 1e3)
    assert device.waits == 2


@pytest.mark.parametrize("value", [0, 1, 2**64 - 1, 0x3F2A_0000_FFFF_1234])
def test_a_fingerprint_travels_exactly_in_a_float32_sum(value):
    world = 3
    vectors = [agreement.to_slots(value if rank == 1 else rank, rank, world) for rank in range(world)]
    summed = torch.tensor(vectors, dtype=torch.float32).sum(0).tolist()
    assert agreement.from_slots(summed, world) == [0, value, 2]


def test_odd_ranks_differ_from_their_shards_majority():
    assert agreement.odd_ranks([7, 7, 7], 1) == []
    assert agreement.odd_ranks([7, 9, 7], 1) == [1]
    assert agreement.odd_ranks([7, 9], 1) == [0, 1]  # two replicas: no majority, both named
    assert agreement.odd_ranks([5, 6, 7], 1) == [0, 1, 2]
    # Replica groups of 2 (HSDP): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1; 4 and 5 a third group.
    assert agreement.odd_ranks([10, 20, 10, 21, 10, 20], 2) == [3]
    assert agreement.odd_ranks([10, 20], 2) == []  # one sharded copy: nothing to compare


def test_replicas_are_compared_before_every_checkpoint_and_at_least_every_1000_steps():
    assert agreement.check_due(15, None, checkpoint_now=True)
    assert not agreement.check_due(999, None, checkpoint_now=False) and agreement.check_due(1000, None, False)
    assert agreement.check_due(50, 50, False) and agreement.check_due(7, 50, True)
    assert not agreement.check_due(15, 0, checkpoint_now=True)  # --replica-check-steps 0: off


def test_a_fingerprint_sees_one_weight_changed_and_the_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters())
    twin_optimizer.load_state_dict(optimizer.state_dict())
    same = fingerprint(held_tensors(model, optimizer))
    assert fingerprint(held_tensors(twin, twin_optimizer)) == same
    kept = twin[0].weight.view(-1)[0].item()
    with torch.no_grad():
        twin[0].weight.view(-1)[0] += 1.0
    assert fingerprint(held_tensors(twin, twin_optimizer)) != same
    with torch.no_grad():
        twin[0].weight.view(-1)[0] = kept
    assert fingerprint(held_tensors(twin, twin_optimizer)) == same
    twin_optimizer.state[twin[2].bias]["exp_avg"][0] += 1e-7  # the last bit of one moment
    assert fingerprint(held_tensors(twin, twin_optimizer)) != same
    assert fingerprint(held_tensors(model.to(torch.bfloat16), None)) != 0  # 16-bit weights too


def test_the_mismatch_line_names_the_ranks_their_hosts_and_where_the_run_goes_back_to():
    two = mismatch_line([0, 1], ["h0", "h1"], 15, 1, 2, "checkpoint_s000000010_x")
    assert "no majority" in two and "rank 1 (host h1)" in two and "goes back to checkpoint_s000000010_x" in two
    three = mismatch_line([2], ["h0", "h1", "h2"], 40, 1, 3, None)
    assert "rank 2 (host h2) differs from the other replicas" in three and "the start" in three
    again = mismatch_line([1], ["h0", "h1", "h2"], 15, 1, 3, "checkpoint_s000000010_x", recurred=True)
    assert "recurred at step 15 on rank 1 after a rollback to checkpoint_s000000010_x" in again
    assert "deterministic" in again and "the run stops here" in again and "goes back to" not in again


def test_a_mismatch_recurs_only_at_the_same_step_on_the_same_ranks_after_the_same_rollback():
    from raytrain.rundir.records import Event

    def met(step=15, ranks=(1,), checkpoint="checkpoint_s10", invocation="a", kind=Kind.REPLICA_MISMATCH):
        return Event(
            kind, "", extra={"step": step, "ranks": list(ranks), "checkpoint": checkpoint, "invocation": invocation}
        )

    assert agreement.recurs([met()], "a", 15, [1], "checkpoint_s10")
    assert agreement.recurs([met(checkpoint=None)], "a", 15, [1], None)  # no checkpoint yet: back to the start
    assert not agreement.recurs([], "a", 15, [1], "checkpoint_s10")  # the first time: retried
    for other in (met(step=20), met(ranks=(0, 1)), met(checkpoint="checkpoint_s15"), met(kind=Kind.STRAGGLER)):
        assert not agreement.recurs([other], "a", 15, [1], "checkpoint_s10"), other
    assert not agreement.recurs([met(invocation="b")], "a", 15, [1], "checkpoint_s10")  # a run resumed since


class _Ranks:
    """`world` ranks in threads; each one's all-reduce sums every rank's vector."""

    def __init__(self, world):
        self.world, self.barrier = world, threading.Barrier(world, timeout=30)
        self.vectors, self.sums = [None] * world, None

    def recovery(self, rank):
        ranks = self

        class Runtime:
            world_size, world_rank = ranks.world, rank

            def all_reduce_sum(self, values):
                ranks.vectors[rank] = list(values)
                if ranks.barrier.wait() == 0:
                    ranks.sums = [sum(column) for column in zip(*ranks.vectors)]
                ranks.barrier.wait()
                return list(ranks.sums)

        return type("Recovery", (), {"runtime": Runtime(), "shards_per_replica": 1})()

    def compare(self, models, files, invocation="a", step=15, back="checkpoint_s000000010_x"):
        """Every rank's `Watch.compare` of one attempt; what each raised."""
        from raytrain.instruments.watch import Watch

        raised = [None] * self.world

        def rank_compares(rank):
            watch = Watch(TrainConfig(), self.recovery(rank), invocation)
            watch._my_host = agreement.ipv4(f"10.0.0.{rank + 1}")  # its node's address; no log sync yet
            try:
                watch.compare(files[rank], models[rank], None, step, lambda: Path(back))
            except Exception as exc:
                raised[rank] = exc

        threads = [threading.Thread(target=rank_compares, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return raised


def test_the_same_mismatch_after_the_same_rollback_stops_every_rank_and_names_the_hosts_from_the_start(tmp_path):
    """The issue's case: a replica corrupted at every step from step 12 is caught at step 15, the run goes
    back to step 10's checkpoint and meets it at step 15 again: deterministic, so every rank raises the
    error the failure policy never retries (only rank 0 reads the events; the all-reduce tells rank 1)."""
    from raytrain.errors import DeterministicFault
    from raytrain.instruments.agreement import ReplicaMismatch, ReplicaMismatchRecurred
    from raytrain.rundir import RunDir
    from raytrain.rundir.writer import RunWriter

    torch.manual_seed(0)
    good = torch.nn.Linear(3, 2)
    odd = copy.deepcopy(good)
    with torch.no_grad():
        odd.weight.view(-1)[0] += 1.0
    ranks = _Ranks(3)
    files = [RunWriter(tmp_path, enabled=rank == 0) for rank in range(3)]
    first = ranks.compare([good, odd, good], files)
    assert all(type(exc) is ReplicaMismatch for exc in first), first  # the first time: retried
    assert "rank 1 (host 10.0.0.2) differs" in str(first[1]) and "goes back to checkpoint_s000000010_x" in str(first[0])
    assert ranks.compare([good, good, good], files) == [None] * 3  # the replicas agree: nothing said
    other = ranks.compare([good, odd, good], files, invocation="b")  # a run resumed since: its own
    assert all(type(exc) is ReplicaMismatch for exc in other), other
    again = ranks.compare([good, odd, good], files)
    assert all(type(exc) is ReplicaMismatchRecurred for exc in again), again  # rank 1 and 2 read no events
    assert isinstance(again[2], DeterministicFault) and str(again[2]) == str(again[0])
    assert "recurred at step 15 on rank 1 after a rollback to checkpoint_s000000010_x" in str(again[0])
    assert "goes back" not in str(again[0]) and "host ?" not in str(again[0])
    events = [e for e in RunDir(tmp_path).events() if e.kind == Kind.REPLICA_MISMATCH]
    assert [(e.get("recurred"), e.get("host"), e.get("invocation")) for e in events] == [
        (False, "10.0.0.2", "a"), (False, "10.0.0.2", "b"), (True, "10.0.0.2", "a"),
    ]  # fmt: skip
    moved = ranks.compare([good, odd, good], files, back="checkpoint_s000000015_y")  # a newer rollback
    assert all(type(exc) is ReplicaMismatch for exc in moved), moved


@pytest.mark.parametrize(
    "option, value, fix",
    [
        ("straggler_factor", 1.0, "above 1"),
        ("straggler_steps", 0, "straggler-steps"),
        ("replica_check_steps", -1, "0 (off)"),
    ],
)
def test_bad_watch_options_name_the_field_and_the_fix(option, value, fix):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**{option: value})
    assert option in str(error.value) and fix in str(error.value)


def test_a_rank_slow_for_the_evict_steps_is_evicted_only_when_asked():
    kept = StragglerWatch(factor=1.5, steps_needed=20)
    evicting = StragglerWatch(factor=1.5, steps_needed=20, evict_after=40)
    for watch in (kept, evicting):
        for _ in range(3):
            watch.observe(window([0.05, 0.35, 0.05, 0.5]), ["a", "b", "c", "d"])
        assert watch.to_evict() is None  # 30 slow steps
        watch.observe(window([0.05, 0.35, 0.05, 0.5]), ["a", "b", "c", "d"])
    assert kept.to_evict() is None  # without --evict-stragglers, never
    assert evicting.to_evict() == 3  # two at 40 steps: the slowest first


def test_the_elastic_policy_counts_no_worker_on_an_evicted_node(monkeypatch):
    from ray.train import ScalingConfig

    from raytrain.faults import evict
    from raytrain.faults.replacement import group_scaling_policy

    monkeypatch.setattr(evict, "evicted_nodes", lambda key: {"node-b"} if key == b"run" else set())
    reserved = {"node-a": {"CPU": 2.0}, "node-b": {"CPU": 2.0}, "node-c": {"CPU": 1.0}}
    config = ScalingConfig(num_workers=(1, 5), resources_per_worker={"CPU": 1})
    assert evict.evicting_policy(config, b"run")._count_possible_workers(reserved) == 3
    assert evict.evicting_policy(config, b"other")._count_possible_workers(reserved) == 5
    groups = group_scaling_policy(ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1}), 2, b"run")
    assert groups._count_possible_workers(reserved) == 2  # 3 workers' room: one whole group of 2


class _Writer:
    """The writing rank's files, in memory."""

    enabled = True

    def __init__(self):
        self.events = []

    def event(self, kind, message, **extra):
        self.events.append((kind, message, extra))

    def flush(self):
        pass


class _Eviction:
    """A restart-mode eviction's answers, without Ray (its eviction noted)."""

    shards_per_replica = 1

    def __init__(self, world_size):
        self.runtime = type("Runtime", (), {"world_size": world_size, "world_rank": 0})()
        self.evicted = []

    def workers_left(self, rank, hosts):
        return stragglers.workers_left(rank, hosts)

    def leave(self, ranks, error):
        self.evicted.extend(ranks)


@pytest.mark.parametrize("workers, evicts", [("2:4", True), ("3:4", False)])
def test_a_straggler_is_evicted_once_and_only_when_enough_workers_are_left(workers, evicts):
    from raytrain.instruments.watch import Watch

    cfg = TrainConfig(workers=workers, evict_stragglers=True, straggler_steps=10, straggler_evict_steps=20)
    files, eviction = _Writer(), _Eviction(4)
    watch = Watch(cfg, eviction)
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]  # ranks 2 and 3 share the slow host
    for step in (10, 20):
        watch.after_sync(files, window([0.05, 0.05, 0.4, 0.4]), hosts, step)
    decided = [extra for kind, _, extra in files.events if kind == "evicted"]
    assert len(decided) == 1 and decided[0]["host"] == "10.0.0.2" and decided[0]["evicted"] is evicts, files.events
    rank = decided[0]["rank"]
    assert eviction.evicted == ([rank] if evicts else [])  # 2 left on 10.0.0.1: enough for MIN 2, not for 3
    watch.after_sync(files, window([0.05, 0.05, 0.4, 0.4]), hosts, 30)
    assert eviction.evicted.count(rank) == (1 if evicts else 0)  # each rank decided once


@pytest.mark.parametrize(
    "hosts, group_size, left",
    [
        (["a", "a", "a"], 1, 0),  # one host: evicting it leaves nobody, whatever the mode
        (["a", "a", "a"], 3, 0),
        (["a", "a", "b", "b"], 1, 2),
        (["a", "a", "b", "b"], 2, 2),  # per-step groups of 2, each on one host
        (["a", "b", "a", "b"], 2, 0),  # every group has a worker on the evicted host
        (["a", "b", "c", "c"], 1, 3),
    ],
)
def test_an_eviction_leaves_only_the_workers_whose_group_has_none_on_the_evicted_host(hosts, group_size, left):
    assert stragglers.workers_left(0, hosts, group_size) == left


def test_a_straggler_on_the_only_host_is_not_evicted_in_per_step_mode():
    """The issue's case: every worker on one host, per-step replicas of one worker each; the slow
    rank's host is everyone's, so the run would be left with no worker: it trains on."""
    from raytrain.faults.per_step import GroupEviction
    from raytrain.instruments.watch import Watch

    cfg = TrainConfig(workers="2:3", fault_tolerance="per-step", evict_stragglers=True, straggler_steps=5,
                      straggler_evict_steps=10)  # fmt: skip
    files, eviction = _Writer(), GroupEviction(cfg, _Eviction(3).runtime, "run-1")  # per-step's own answers
    watch = Watch(cfg, eviction)
    for step in (5, 10, 15):
        watch.after_sync(files, window([0.05, 0.3, 0.05]), ["127.0.0.1"] * 3, step)
    decided = [(message, extra) for kind, message, extra in files.events if kind == "evicted"]
    assert len(decided) == 1 and decided[0][1]["evicted"] is False and not eviction.evicting, decided
    assert "0 worker(s) would be left" in decided[0][0]


def test_every_new_worker_group_is_placed_off_the_evicted_nodes(monkeypatch):
    from raytrain.faults import evict

    monkeypatch.setattr(evict, "evicted_nodes", lambda key: {"b" * 56, "a" * 56} if key == b"run" else set())
    selector = evict.KeepEvictedOut(b"run").on_controller_start_worker_group(scaling_config=None, num_workers=2)
    assert selector == {"ray.io/node-id": f"!in({'a' * 56}, {'b' * 56})"}
    assert evict.KeepEvictedOut(b"other").on_controller_start_worker_group(scaling_config=None, num_workers=2) is None


def test_the_sync_carries_every_ranks_own_time_and_host():
    from raytrain.instruments.window import LossWindow, sync

    world, vectors = 3, []

    class Runtime:
        world_size = world

        def __init__(self, rank):
            self.world_rank = rank

        def all_reduce_sum(self, values):
            vectors.append(values)
            return values

    beat = type("Beat", (), {"mark": lambda self, step, phase: None})()
    for rank in range(world):
        sync(Runtime(rank), beat, LossWindow.on(torch.device("cpu")), 10, own=OwnTime(0.1 * rank, 0.01, 10),
             host=agreement.ipv4(f"10.0.0.{rank + 1}"))  # fmt: skip
    summed = [sum(column) for column in zip(*vectors)]

    class Summed(Runtime):
        def all_reduce_sum(self, values):
            return summed

    synced = sync(Summed(0), beat, LossWindow.on(torch.device("cpu")), 10)
    assert synced.hosts == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert [t.compute_s for t in synced.times] == pytest.approx([0.0, 0.1, 0.2]) and synced.times[2].steps == 10
    assert agreement.address(agreement.ipv4("fe80::1")) == "?"
