"""Per-step fault tolerance, the pure parts: rows of a step over a changing quorum, retaken
steps, the plan and rate a quorum trains with, the stall watch, the mode's configuration."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from raytrain.config import TrainConfig
from raytrain.errors import ConfigError
from raytrain.faults.per_step import StallWatch
from raytrain.rules import replicas as rules
from raytrain.rules import steps
from raytrain.rules.batch import batch_plan_for
from raytrain.rules.schedule import run_schedule
from raytrain.rundir import Event, Kind


def split(step: steps.Step, size: int) -> list[tuple[int, int]]:
    return [steps.rank_rows(step, rank, size) for rank in range(size)]


@pytest.mark.parametrize("groups, group_size", [(1, 2), (2, 2), (3, 2), (2, 4), (3, 1)])
def test_groups_in_a_quorum_split_a_steps_rows_by_group_then_by_rank_exactly(groups, group_size):
    step = steps.Step(index=3, start=100, end=133)
    shares = {(g, r): rules.step_share(g, groups, r, group_size) for g in range(groups) for r in range(group_size)}
    assert sorted(shares.values()) == [(i, groups * group_size) for i in range(groups * group_size)]
    rows = [row for g, r in sorted(shares) for row in range(*steps.rank_rows(step, *shares[(g, r)]))]
    assert rows == list(range(100, 133))  # every row once, a group's rows together
    # A group's place is the step's quorum's, not the world's: a group left alone takes the
    # whole batch, split over its own ranks.
    assert [rules.step_share(0, 1, r, group_size) for r in range(group_size)] == [
        (r, group_size) for r in range(group_size)
    ]


def test_a_replaced_worker_starts_its_groups_next_generation_which_its_groups_others_join():
    generations = rules.GroupGenerations(group_size=2)
    assert generations.start_all(6) == {0: 0, 1: 0, 2: 0}
    # Worker 3 (group 1) is lost: its replacement starts generation 1; worker 2 leaves once it
    # sees the loss, and its replacement joins generation 1.
    assert generations.start_one(3) == (1, 1, True)
    assert generations.start_one(2) == (1, 1, False)
    # Lost again later: a worker that is a member of the current generation starts the next.
    assert generations.start_one(2) == (1, 2, True)
    assert generations.start_one(3) == (1, 2, False)
    assert generations.start_one(0) == (0, 1, True)  # the other groups are their own
    assert generations.start_all(6) == {0: 2, 1: 3, 2: 1}  # a restart of every worker: all anew


def test_a_group_is_consecutive_world_ranks():
    assert [rules.group_of(rank, 2) for rank in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [rules.group_of(rank, 1) for rank in range(3)] == [(0, 0), (1, 0), (2, 0)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_a_quorum_splits_a_steps_rows_among_its_members_exactly(size):
    step = steps.Step(index=0, start=40, end=71)
    pieces = split(step, size)
    assert [row for lo, hi in pieces for row in range(lo, hi)] == list(range(40, 71))
    assert max(hi - lo for lo, hi in pieces) - min(hi - lo for lo, hi in pieces) <= 1


@pytest.mark.parametrize("batch", ["global", "per_worker"])
@pytest.mark.parametrize("seed", range(6))
def test_committed_steps_train_every_row_once_whatever_the_quorum_does(batch, seed):
    """Quorums shrink and grow at random steps, and random steps are not committed (taken
    again from the same offset): the committed steps cover the epoch's rows exactly once."""
    rng = random.Random(seed)
    cfg = TrainConfig(
        workers="3", **({"global_batch_size": 48} if batch == "global" else {"batch_size_per_worker": 16})
    )
    rows, offset, trained, retaken = 1000, 0, [], 0
    while offset < rows:
        size = rng.choice([1, 2, 3])
        step = steps.next_step(rows, batch_plan_for(cfg, size).global_batch_size, offset)
        first_try = [r for lo, hi in split(step, size) for r in range(lo, hi)]
        if rng.random() < 0.2:  # a member died inside the step: not committed, taken again
            retaken += 1
            again = steps.next_step(rows, batch_plan_for(cfg, size).global_batch_size, offset)
            assert [r for lo, hi in split(again, size) for r in range(lo, hi)] == first_try  # the same rows
            continue
        trained += first_try
        offset = step.end
    assert sorted(trained) == list(range(rows)) and retaken > 0


def test_the_gradient_is_the_mean_over_the_steps_rows_whatever_the_quorum():
    step = steps.Step(index=0, start=0, end=31)
    losses = [float(r % 7) for r in range(31)]  # per-row losses
    for size in (1, 2, 3, 4):
        per_member = []
        for lo, hi in split(step, size):
            mean = sum(losses[lo:hi]) / (hi - lo)
            per_member.append(mean * steps.gradient_weight(hi - lo, size, step.size))
        assert sum(per_member) / size == pytest.approx(sum(losses) / len(losses))  # DDP's mean over members


def test_survivors_keep_the_global_batch_and_rate_or_follow_the_rule_with_a_per_worker_batch():
    fixed = TrainConfig(workers="3", global_batch_size=96, lr=1e-3, reference_batch_size=32)
    three, two = batch_plan_for(fixed, 3), batch_plan_for(fixed, 2)
    assert (three.global_batch_size, two.global_batch_size) == (96, 96) and two.per_worker_max == 48
    assert run_schedule(fixed, two, 1000).peak_lr == run_schedule(fixed, three, 1000).peak_lr == pytest.approx(3e-3)
    capped = batch_plan_for(TrainConfig(workers="3", global_batch_size=96, micro_batch_size=32), 2)
    assert (capped.global_batch_size, capped.accumulation_steps) == (96, 2)  # micro-batches for the larger share
    grow = TrainConfig(workers="3", batch_size_per_worker=32, lr=1e-3, reference_batch_size=32, lr_scaling="linear")
    assert batch_plan_for(grow, 2).global_batch_size == 64
    assert run_schedule(grow, batch_plan_for(grow, 2), 1000).peak_lr == pytest.approx(2e-3)


def test_the_stall_watch_ends_only_a_replica_stuck_in_one_step():
    now, stalled = [0.0], []
    watch = StallWatch(lambda step, seconds: stalled.append((step, seconds)), clock=lambda: now[0])
    assert not watch.check()  # between steps
    watch.enter(7, limit_s=10.0)
    now[0] = 9.0
    assert not watch.check()
    assert watch.leave() == 9.0
    now[0] = 50.0
    assert not watch.check() and stalled == []  # waiting for a quorum is not a step's work
    watch.enter(8, limit_s=10.0)
    now[0] = 61.0
    assert watch.check() and stalled == [(8, 11.0)]


def test_a_step_of_a_new_shape_gets_the_first_steps_grace():
    """An epoch's smaller last step compiles again under --compile: 0.3 s steps' 15 s limit would end it."""
    now, stalled = [0.0], []
    watch = StallWatch(lambda step, seconds: stalled.append((step, seconds)), clock=lambda: now[0])
    usual_s = rules.stall_after_s(5.0, [0.3] * 20)
    new_shape_s = rules.new_shape_stall_after_s(5.0, 600.0)
    assert usual_s == 15.0 and new_shape_s == 5.0 + 600.0
    for step in range(3):  # full steps of 256 rows over 2 replicas; the first is the first step of its shape
        watch.enter(step, usual_s)
        watch.shaped((256, 2, 0), new_shape_s)
        assert watch.limit_s == (new_shape_s if step == 0 else usual_s)
        watch.leave(committed=True)
    watch.enter(3, usual_s)
    watch.shaped((100, 2, 0), new_shape_s)  # the epoch's last step: 100 rows
    now[0] = 40.0  # compiling again
    assert not watch.check() and stalled == []
    watch.leave(committed=True)
    watch.enter(4, usual_s)
    watch.shaped((100, 2, 0), new_shape_s)  # the next epoch's last step: seen, compiled
    now[0] = 56.0
    assert watch.check() and stalled == [(4, 16.0)]
    watch.enter(5, usual_s)
    watch.shaped((256, 2, 1), new_shape_s)  # a new place in the quorum: another share of the rows
    assert watch.limit_s == new_shape_s
    watch.leave(committed=False)  # not committed: its shape is not yet compiled for sure
    watch.enter(6, usual_s)
    watch.shaped((256, 2, 1), new_shape_s)
    assert watch.limit_s == new_shape_s


def test_a_replica_is_stuck_past_the_others_timeout_and_its_grace_never_in_a_slow_healthy_step():
    timeout_s = 5.0
    first = rules.stall_after_s(timeout_s, [])
    assert first == timeout_s + rules.FIRST_STEP_GRACE_S  # a first step may compile
    assert rules.stall_after_s(600.0, []) == 1200.0  # ... and never less than the timeout again
    fast = rules.stall_after_s(timeout_s, [0.3] * 20)
    assert fast == timeout_s + rules.STALL_GRACE_MIN_S  # the others lose about 15 s, not 70
    slow = rules.stall_after_s(timeout_s, [0.3] * 5 + [20.0] * 20)  # the usual step, not the first ones
    assert slow == timeout_s + 4 * 20.0 and slow > 20.0 + timeout_s  # a healthy 20 s step is never stuck
    # Whoever waits for a quorum outlasts a stuck member's first step and the lighthouse's join wait.
    assert rules.quorum_wait_s(timeout_s, 30.0, 1.0) > first + 30.0


def test_replicas_start_with_their_group_only_when_the_controller_says_so():
    assert rules.starts_with_group({rules.START_ENV: rules.STARTS_WITH_GROUP})
    assert not rules.starts_with_group({rules.START_ENV: rules.REPLACES_ONE})
    assert not rules.starts_with_group({})  # unsaid: a replacement, which holds no quorum up


def test_per_step_configuration_is_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="needs Ray workers"):
        TrainConfig(workers="0", fault_tolerance="per-step")
    with pytest.raises(ConfigError, match="max-failures"):
        TrainConfig(workers="2", fault_tolerance="per-step", max_failures=0)
    with pytest.raises(ConfigError, match="did you mean 'per-step'"):
        TrainConfig(workers="2", fault_tolerance="perstep")
    assert TrainConfig(workers="3", fault_tolerance="per-step").fault_tolerance == "per-step"
    # Elastic, in whole replica groups: MIN and MAX are whole groups.
    elastic = TrainConfig(workers="2:4", fault_tolerance="per-step", strategy="fsdp", replica_group_size=2)
    assert (elastic.min_workers, elastic.max_workers) == (2, 4)


def test_an_elastic_per_step_run_counts_workers_in_whole_groups():
    assert [rules.whole_groups(n, 2) for n in range(6)] == [0, 0, 2, 2, 4, 4]
    assert rules.whole_groups(7, 1) == 7  # replicas of one worker: any count


def test_a_quorum_that_lost_a_replica_counts_as_a_recovered_failure():
    lost = Event(Kind.QUORUM, "Quorum 3 → 2", extra={"world_size": 2, "previous_world_size": 3, "step": 6})
    back = Event(Kind.QUORUM, "Quorum 2 → 3", extra={"world_size": 3, "previous_world_size": 2, "step": 34})
    assert (lost.recovers_a_failure, back.recovers_a_failure) == (True, False)


class FakeRunner:
    """What follow_quorum needs of an attempt's StepRunner."""

    def __init__(self, size: int):
        self.batch_plan = type("Plan", (), {"world_size": size})()
        self.runtime = type("Runtime", (), {"world_size": size, "group_size": 1})()

    def for_quorum(self, size: int, num_train_rows: int) -> "FakeRunner":
        return FakeRunner(size)

    def describe_plan(self) -> str:
        return f"global {32 * self.batch_plan.world_size}"

    @property
    def rate(self):
        return type("Rate", (), {"at": lambda _, samples_seen: 1e-3 * self.batch_plan.world_size})()


def test_every_change_of_the_quorums_size_is_one_event_line_with_the_new_plan(tmp_path, monkeypatch):
    from raytrain.faults.per_step import PerStep
    from raytrain.rules.position import Position
    from raytrain.rundir import RunDir
    from raytrain.rundir.writer import RunWriter
    from raytrain.worker import epoch
    from raytrain.worker.epoch import Training

    monkeypatch.setattr(epoch, "plan_line", lambda runner: runner.describe_plan())

    def attempt(files, position, runner):
        recovery = PerStep.__new__(PerStep)  # no Ray Train context: its line only
        recovery.group_size = 1
        training = SimpleNamespace(
            files=files, position=position, runner=runner, train_data=range(1000), recovery=recovery
        )
        return training

    files, position, runner = RunWriter(tmp_path, enabled=True), Position(), FakeRunner(3)
    training = attempt(files, position, runner)
    for step, size in [(0, 3), (5, 3), (6, 2), (7, 2), (30, 3)]:
        position.step = step
        Training.follow_quorum(training, size)
        assert training.runner.batch_plan.world_size == size
    # A replacement healed with the survivors' position (sizes 3, 2) joins a quorum of 3: the same line.
    healed, other = Position(step=30, world_sizes=[3, 2]), tmp_path / "other"
    other.mkdir()
    Training.follow_quorum(attempt(RunWriter(other, enabled=True), healed, FakeRunner(3)), 3)
    events = RunDir(tmp_path).events()
    assert [(e.extra["previous_world_size"], e.extra["world_size"], e.step) for e in events] == [(3, 2, 6), (2, 3, 30)]
    assert (
        "global 64" in events[0].message
        and "a replica was lost" in events[0].message
        and position.world_sizes == [3, 2, 3]
    )
    assert [e.message.split(":")[0] for e in RunDir(other).events()] == [events[1].message.split(":")[0]]


def test_a_replica_holds_no_collective_outside_a_step_and_a_group_member_does():
    """Per-step, no collective outside a step (no quorum guards it there): validation over all
    of the set by itself, its own value gathered, a whole checkpoint written by one process,
    the model left to torchft's DDP. A restarting group's worker does each with every rank."""
    import torch

    from raytrain.config import TrainConfig
    from raytrain.faults.groups import Solo
    from raytrain.faults.per_step import PerStep, ReplicaRuntime
    from raytrain.faults.restart import Recovery
    from raytrain.worker.runtime import Runtime

    def runtime(kind: type[Runtime]) -> Runtime:
        worker = kind.__new__(kind)  # no Ray Train context: the policy only
        worker.world_rank, worker.world_size, worker.distributed = 1, 2, True
        worker.device, worker.replica = torch.device("cpu"), Solo(1)
        return worker

    replica, member = runtime(ReplicaRuntime), runtime(Runtime)
    assert replica.evaluation_share() == (0, 1) and member.evaluation_share() == (1, 2)
    assert replica.all_gather_object("mine") == ["mine"]
    per_step = PerStep.__new__(PerStep)
    per_step.runtime = replica
    assert not per_step.distributed_checkpoints and Recovery(TrainConfig(), ".", member).distributed_checkpoints
    model = torch.nn.Linear(2, 2)
    assert replica.prepare_model(model, {}) is model  # torchft's DDP wraps it when the replica joins


def test_workers_taken_out_with_their_group_count_once_and_a_later_failure_of_theirs_counts():
    from raytrain.faults.replacement import ReplicaGroups

    groups = ReplicaGroups(group_size=2)
    groups.generations.start_all(4)
    assert groups.generations.taken_out({1}) == {0, 1}  # worker 1 lost: its group goes with it
    groups.taken = {0}  # shut down with it (`before_controller_execute_resize_decision`)
    assert groups.counted_already({0})  # found failed later: part of the loss already counted
    assert not groups.counted_already({0})  # once only: its next failure is its own
    groups.taken = {0}
    assert not groups.counted_already({0, 3}) and groups.taken == set()  # with a failure of another: counted


def test_ray_is_asked_for_whole_groups_only():
    from ray.train import ScalingConfig

    from raytrain.faults.replacement import group_scaling_policy

    policy = group_scaling_policy(ScalingConfig(num_workers=(2, 6), resources_per_worker={"CPU": 1}), 2)
    assert policy._count_possible_workers({"node-a": {"CPU": 3.0}}) == 2  # 3 workers fit: 1 group
    assert policy._count_possible_workers({"node-a": {"CPU": 2.0}, "node-b": {"CPU": 3.0}}) == 4
    assert policy._count_possible_workers({"node-a": {"CPU": 16.0}}) == 6  # never past MAX


def test_a_running_per_step_group_is_never_shrunk_by_rays_resource_count():
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    from raytrain.faults.replacement import group_scaling_policy

    policy = group_scaling_policy(ScalingConfig(num_workers=(2, 6), resources_per_worker={"CPU": 1}), 2)
    state = SimpleNamespace(num_workers=4, start_time=0.0)
    policy._maybe_send_resource_request = lambda: None  # no autoscaler here
    policy._get_reserved_resources = lambda: {"node-a": {"CPU": 2.0}}  # a node's room not counted (yet)
    assert isinstance(policy.make_decision_for_running_worker_group(state, None), NoopDecision)
    policy._latest_monitor_time = 0.0
    policy._get_reserved_resources = lambda: {"node-a": {"CPU": 6.0}}  # room for more: a growth
    grown = policy.make_decision_for_running_worker_group(state, None)
    assert isinstance(grown, ResizeDecision) and grown.num_workers == 6


def test_survivors_training_below_min_are_polled_while_the_lost_groups_wait_for_room(monkeypatch):
    """The issue's hang: a lost (or evicted) group leaves room for fewer than MIN workers; Ray's
    elastic policy would wait for room polling no one, and a run the survivors finish would never
    end. With survivors live, the lost groups wait in place (GroupController), the others polled."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    from raytrain.faults import replacement

    policy = replacement.group_scaling_policy(ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}), 1)
    policy._maybe_send_resource_request = lambda: None
    policy._get_reserved_resources = lambda: {}  # the only node evicted: room for no worker

    def poll(failing, every):
        return SimpleNamespace(failing_replica_group_indices=failing, all_replica_group_indices=every)

    live = SimpleNamespace(get_workers=lambda: [0, 1, 2], get_latest_poll_status=lambda: poll({1}, {0, 1, 2}))
    monkeypatch.setattr(replacement, "_RUNNING", SimpleNamespace(worker_group=live))
    in_place = policy.make_decision_for_non_running_worker_group()
    assert isinstance(in_place, ResizeDecision) and in_place.num_workers == 3
    live.get_latest_poll_status = lambda: poll({0, 1, 2}, {0, 1, 2})  # every group lost: wait for room, as Ray
    assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
    monkeypatch.setattr(replacement, "_RUNNING", SimpleNamespace(worker_group=None))  # no group yet
    assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)


def test_each_fault_tolerance_choice_is_one_mode_with_its_two_halves():
    """The driver picks the mode once from `MODES`; its worker half rides in the payload."""
    from raytrain.config import TrainConfig
    from raytrain.config.checks import FAULT_TOLERANCE_MODES
    from raytrain.faults import MODES, mode_of
    from raytrain.faults.per_step import PerStep, PerStepMode
    from raytrain.faults.restart import Recovery, RestartMode
    from raytrain.worker.network import BoundTorchConfig

    assert list(MODES) == list(FAULT_TOLERANCE_MODES)  # each choice has its mode and its config rules
    assert all(issubclass(MODES[m].recovery, Recovery) for m in FAULT_TOLERANCE_MODES)
    restart = mode_of(TrainConfig(collective_timeout_s=7))
    assert type(restart) is RestartMode and restart.recovery is Recovery
    assert isinstance(restart.torch_config(False), BoundTorchConfig) and restart.torch_config(False).timeout_s == 7
    assert restart.on_worker_failure("/tmp/x") is not None  # the driver names a stalled rank from the heartbeats
    per_step = mode_of(TrainConfig(fault_tolerance="per-step", max_failures=1, workers="2:4"))
    assert type(per_step) is PerStepMode and per_step.recovery is PerStep and per_step.on_worker_failure("/x") is None
    assert per_step.torch_config(False).lighthouse_kwargs["min_replicas"] == 2  # an elastic run's MIN


def test_survivors_give_up_on_a_silent_peer_after_a_few_usual_steps_not_the_collective_timeout():
    """A host lost, frozen or cut off: the others' all-reduce gives up after the peer wait, then
    their next quorum forms without it (issue 47: their extra wait ≤ 10 s)."""
    assert rules.peer_wait_s(600.0, []) == 600.0  # before a first commit: a compile may run
    assert rules.peer_wait_s(600.0, [0.5] * 20) == rules.PEER_WAIT_MIN_S  # short steps: the floor
    assert rules.PEER_WAIT_MIN_S + 2 * 1.0 < 10.0  # with the lighthouse's heartbeat timeout, twice
    assert rules.peer_wait_s(600.0, [0.5] * 5 + [3.0] * 20) == 12.0  # four usual steps of a slow model
    assert rules.peer_wait_s(8.0, [3.0] * 20) == 8.0  # never more than the collective timeout
    # A peer merely slower than the wait is waited for longer on each retry, never given up forever.
    waits = [rules.peer_wait_s(600.0, [0.5] * 20, uncommitted_in_a_row=n) for n in range(4)]
    assert waits == [5.0, 10.0, 20.0, 40.0]
    assert rules.peer_wait_s(600.0, [0.5] * 20, uncommitted_in_a_row=10_000) == 600.0
    # A stuck replica leaves after the others' wait and its grace.
    assert rules.stall_after_s(5.0, [0.5] * 20) == 5.0 + rules.STALL_GRACE_MIN_S


def test_a_replica_hands_the_others_its_store_by_node_address_and_waits_the_peer_wait_in_each_collective():
    """torchft's handle names the store by the hostname, which resolves to loopback on many hosts:
    replicas on other hosts then never joined the process group (issue 47)."""
    import json
    from datetime import timedelta

    from torchft import ProcessGroupGloo

    from raytrain.faults.groups import replica_process_group

    pg = replica_process_group(ProcessGroupGloo, "10.77.0.2")(timeout=timedelta(seconds=5))
    handle = json.loads(pg.get_reconfigure_handle())
    assert handle["store"].startswith("10.77.0.2:") and int(handle["store"].rsplit(":", 1)[1]) > 0
    assert isinstance(pg, ProcessGroupGloo)
    # Each collective waits the peer wait for a missing peer, not the group's timeout.
    from torch.distributed import AllreduceOptions

    assert pg._opts_hook(AllreduceOptions()).timeout < timedelta(0)  # unset: the group's
    pg.set_peer_wait(timedelta(seconds=5))
    assert pg._opts_hook(AllreduceOptions()).timeout == timedelta(seconds=5)


def test_on_nccl_the_peer_wait_is_torchfts_abort_timer_and_torchs_watchdog_stays_off(monkeypatch):
    """torchft's NCCL group clears each collective's timeout (torch's NCCL watchdog would race its
    own abort of the communicator) and times the work itself: the peer wait goes there. No GPU
    needed: the group is only built, not configured."""
    from datetime import timedelta

    import torch
    from torch.distributed import AllreduceOptions
    from torchft import ProcessGroupNCCL

    from raytrain.faults.groups import replica_process_group

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26, 0))  # an NCCL that can abort
    monkeypatch.setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", "600")
    pg = replica_process_group(ProcessGroupNCCL, "10.77.0.2")(timeout=timedelta(seconds=600))
    pg.set_peer_wait(timedelta(seconds=5))
    opts = pg._opts_hook(AllreduceOptions())
    assert opts.timeout < timedelta(0)  # unset: torch's watchdog does not time it
    timed = pg._wrap_work(object(), opts)  # torchft's timer, which aborts the communicator
    assert timed._timeout == timedelta(seconds=5)


def test_per_step_retries_a_replacement_a_second_loss_failed_within_max_failures_and_says_what_its_runs_need():
    """A replica lost while another was being replaced fails that replacement with a controller
    error Ray never retries: the per-step mode retries it, --max-failures times; anything else is
    Ray's policy's to decide (None)."""
    from ray.exceptions import RayActorError
    from ray.train import ControllerError
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    from raytrain.config import TrainConfig
    from raytrain.faults import mode_class, mode_of

    mode = mode_of(TrainConfig(fault_tolerance="per-step", max_failures=2, workers=2))
    lost = ControllerError(RayActorError())
    limit = SimpleNamespace(max_failures=2)
    assert [mode.failure_decision(lost, limit) for _ in range(3)] == [
        FailureDecision.RETRY,
        FailureDecision.RETRY,
        FailureDecision.RAISE,
    ]
    assert mode.failure_decision(RuntimeError("worker died"), limit) is None
    assert mode_of(TrainConfig()).failure_decision(lost, limit) is None  # restart: Ray's policy decides
    assert (mode_class("per-step").min_failures, mode_class(None).min_failures) == (1, 0)
    assert not mode_class("per-step").reports_each_epoch and mode_class("restart").reports_each_epoch
