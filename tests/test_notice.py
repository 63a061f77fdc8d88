"""Preemption notices (raytrain.instruments.notice): a node's drain or a SIGTERM, carried by the
sync, said once as a `preempted` event, and what each mode does with the ranks that leave —
restart: a checkpoint at that step, then a restart without their node that is not a failure;
per-step: their replica group leaves at the next step's start. Without Ray."""

from __future__ import annotations

import math
import signal
import time

import pytest
import torch
from test_watch import _Writer  # the writing rank's files, in memory

from raytrain.config import TrainConfig
from raytrain.instruments.notice import (
    Leaving,
    Notice,
    NoticeBoard,
    checkpoint_fits,
    leaving,
    notice_line,
    sigterm_grace_s,
    slots,
)
from raytrain.instruments.window import LossWindow, sync
from raytrain.rundir.records import Event, Kind

BEAT = type("Beat", (), {"mark": lambda self, step, phase: None})()


def synced_over(world: int, notices: dict[int, Notice]):
    """Every rank's sync vector summed, as the all-reduce would, read back on rank 0."""
    vectors = []

    class Runtime:
        world_size = world

        def __init__(self, rank):
            self.world_rank = rank

        def all_reduce_sum(self, values):
            vectors.append(values)
            return values

    for rank in range(world):
        sync(Runtime(rank), BEAT, LossWindow.on(torch.device("cpu")), 10, notice=notices.get(rank))
    summed = [sum(column) for column in zip(*vectors)]

    class Summed(Runtime):
        def all_reduce_sum(self, values):
            return summed

    return sync(Summed(0), BEAT, LossWindow.on(torch.device("cpu")), 10, notice=notices.get(0))


def test_the_sync_carries_each_ranks_notice_what_gave_it_and_its_seconds_left():
    assert synced_over(3, {}).leaving == {}
    now = time.time()
    leaving = synced_over(3, {1: Notice("drain", now + 25.0), 2: Notice("SIGTERM", math.inf)}).leaving
    assert sorted(leaving) == [1, 2] and leaving[1].source == "drain" and leaving[2].source == "SIGTERM"
    assert leaving[1].seconds_left == pytest.approx(25.0, abs=1) and leaving[2].seconds_left == math.inf
    (late,) = synced_over(2, {0: Notice("drain", now - 5)}).leaving.values()  # past its deadline: still a notice
    assert late.seconds_left == 0.0


def test_a_notice_without_a_deadline_survives_a_float32_reduction():
    """Per-step on a GPU sums in float32: the no-deadline mark and one more must stay exact."""
    shared = slots(Notice("drain", math.inf), 1, 2, time.time())
    assert leaving(torch.tensor(shared, dtype=torch.float32).tolist()) == {1: Leaving("drain", math.inf)}


def test_the_board_keeps_the_earliest_deadline_and_polls_only_its_own_node():
    board = NoticeBoard()
    assert board.notice is None
    board.post(Notice("SIGTERM", 130.0))
    board.post(Notice("drain", 120.0))
    board.post(Notice("drain", 150.0))
    assert board.notice == Notice("drain", 120.0) and board.notice.seconds_left(100.0) == 20.0
    drains = iter([{"other": 5_000}, {"mine": 0}])
    polled = NoticeBoard()
    polled.watch_drain("mine", lambda: next(drains, {"mine": 0}), poll_s=0.01)
    deadline = time.monotonic() + 5
    while polled.notice is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert polled.notice == Notice("drain", math.inf)  # this node, drained without a deadline


def test_sigterm_posts_a_notice_with_the_grace_and_a_second_one_ends_as_ray_would(monkeypatch):
    ended = []
    board = NoticeBoard()
    monkeypatch.setattr(signal, "getsignal", lambda sig: lambda *a: ended.append(a))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)
    board.catch_sigterm()
    monkeypatch.setenv("RAYTRAIN_SIGTERM_GRACE_S", "45")
    board.on_sigterm(signal.SIGTERM, None)
    assert board.notice.source == "SIGTERM" and 44 < board.notice.seconds_left(time.time()) <= 45 and not ended
    board.on_sigterm(signal.SIGTERM, None)
    assert len(ended) == 1
    drained = NoticeBoard()  # a drain first (a KubeRay preStop), then SIGTERM twice: the second ends it
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)
    drained.catch_sigterm()
    drained.post(Notice("drain", time.time() + 10))
    drained.on_sigterm(signal.SIGTERM, None)
    assert drained.notice.source == "drain"  # the earlier deadline kept
    with pytest.raises(SystemExit):
        drained.on_sigterm(signal.SIGTERM, None)
    assert sigterm_grace_s({}) == 30.0 and sigterm_grace_s({"RAYTRAIN_SIGTERM_GRACE_S": "x"}) == 30.0


def test_a_checkpoint_is_tried_only_when_the_deadline_leaves_room_for_one():
    assert checkpoint_fits(30.0, None)  # none saved yet: tried
    assert checkpoint_fits(30.0, 5.0) and checkpoint_fits(math.inf, 100.0)
    assert not checkpoint_fits(10.0, 5.0)  # twice the slowest save and a second: 11 s
    line = notice_line([2], ["10.0.0.2"], 10.0, 40, False, True, 5.0)
    assert "too little time to checkpoint (the slowest save took 5.0 s)" in line and "last checkpoint" in line
    assert "checkpointed at step 40" in notice_line([2], ["10.0.0.2"], 28.0, 40, True, True, None)
    assert "replica group leaves" in notice_line([1], ["b"], math.inf, 40, False, False, None)


class _Runtime:
    world_size, world_rank = 4, 0


class _Eviction:
    checkpoints_first, shards_per_replica = True, 1

    def __init__(self, summed=None):
        self.left = []
        self.runtime = _Runtime()
        self.runtime.all_reduce_sum = summed

    def leave(self, ranks, error):
        self.left.append((ranks, error))


@pytest.mark.parametrize("left_s, saves", [(28.0, True), (3.0, False)])
def test_a_notice_is_said_once_checkpointed_if_it_fits_and_its_ranks_leave_once(monkeypatch, left_s, saves):
    from raytrain.instruments import watch as watching
    from raytrain.instruments.watch import Preempted, Watch

    monkeypatch.setattr(watching, "_node_ids", lambda: {"10.0.0.2": "node-b"})
    # Rank 2, on the same node, sees the drain only when it looks at the notice (a node goes
    # whole); rank 1's slowest save is 2 s (this rank's: none yet): every rank decides on 2 s.
    on_the_notice = slots(Notice("drain", time.time() + left_s), 2, 4, time.time()) + [0.0, 2.0, 0.0, 0.0]
    files, eviction = _Writer(), _Eviction(lambda values: on_the_notice)
    watch = Watch(TrainConfig(workers="2:4"), eviction)
    watch.after_sync(files, [], ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"], 40)
    leaving = {3: Leaving("drain", left_s)}
    assert watch.on_notice(files, leaving, 40, save_s=None) is saves
    assert watch.on_notice(files, leaving, 41, save_s=None) is False  # decided once
    ((kind, line, extra),) = files.events  # one per node
    assert kind == Kind.PREEMPTED and extra["ranks"] == [2, 3] and extra["host"] == "10.0.0.2"
    assert extra["node"] == "node-b" and extra["reason"] == "drain"
    assert extra["deadline"] == pytest.approx(time.time() + left_s, abs=1)
    assert extra["checkpoint_step"] == (40 if saves else None)
    watch.leave()
    watch.leave()
    [(ranks, error)] = eviction.left
    assert ranks == [2, 3] and isinstance(error, Preempted) and str(error) == line


def test_restart_mode_holds_the_leaving_nodes_out_then_every_rank_ends_the_attempt(monkeypatch):
    from raytrain.faults import restart
    from raytrain.instruments.watch import Preempted

    held, reduced = [], []
    monkeypatch.setattr(restart, "hold_out_this_node", lambda key: held.append(key))
    runtime = type("R", (), {"world_size": 4, "all_reduce_sum": lambda self, v: reduced.append(v) or v})()
    for rank in range(4):
        runtime.world_rank = rank
        eviction = restart.Eviction(TrainConfig(workers="2:4"), runtime, "run-1")
        with pytest.raises(Preempted):
            eviction.leave([2, 3], Preempted("notice"))
    assert len(held) == 2 and len(reduced) == 4  # the two leaving ranks' node, and a barrier on every rank


def test_a_preempted_attempt_is_restarted_whatever_max_failures():
    from raytrain.faults import mode_of
    from raytrain.faults.ray_internals import FailureDecision
    from raytrain.instruments.watch import Preempted

    mode = mode_of(TrainConfig(max_failures=0))
    wrapped = RuntimeError("a worker group error")
    wrapped.__cause__ = Preempted("notice")
    assert mode.failure_decision(wrapped, None) is FailureDecision.RETRY
    assert mode.failure_decision(RuntimeError("a worker died"), None) is None  # Ray's policy decides


def test_per_step_the_leaving_ranks_groups_leave_at_the_next_steps_start(monkeypatch):
    from raytrain.faults import per_step

    exits = []
    monkeypatch.setattr(per_step.os, "_exit", lambda status: exits.append(status))
    monkeypatch.setattr(per_step, "hold_out_this_node", lambda key: exits.append("held"))
    cfg = TrainConfig(workers="2:4", fault_tolerance="per-step", replica_group_size=2, max_failures=3,
                      strategy="fsdp")  # fmt: skip
    for rank, leaves in [(0, False), (1, False), (2, True), (3, True)]:
        runtime = type("R", (), {"world_size": 4, "world_rank": rank})()
        eviction = per_step.GroupEviction(cfg, runtime, "run-1")
        eviction.leave([2], Exception("notice"))  # nothing happens inside the step
        assert exits == []
        eviction.leave_if_evicted()
        assert exits == ([*(["held"] if rank == 2 else []), 1] if leaves else []), (rank, exits)
        exits.clear()
        eviction.leave_if_evicted()  # once: the next quorum's ranks are others
        assert exits == []


def event(kind, t, step, **extra):
    return Event.from_json({"kind": kind, "message": kind, "time": t, "step": step, **extra})


def test_a_restart_after_a_notice_is_a_preemption_not_a_failure():
    from raytrain.rules.attempt import tally

    events = [
        event(Kind.PLAN, 0.0, 0, world_size=3),
        event(Kind.PREEMPTED, 10.0, 40),
        event(Kind.RESIZE, 20.0, 40, world_size=2, previous_world_size=3),
        event(Kind.RESIZE, 60.0, 80, world_size=3, previous_world_size=2),  # grown back: neither
        event(Kind.RESIZE, 90.0, 96, world_size=2, previous_world_size=3),  # a loss without notice
    ]
    counts = tally(events)
    assert (counts.failures_recovered, counts.preemptions) == (1, 1)


def test_goodput_counts_preemptions_on_their_own_line():
    from raytrain.rules.accounting import account, shares
    from raytrain.rundir.records import MetricsRow, Progress

    events = [
        event(Kind.PLAN, 100.0, 0, world_size=3),
        event(Kind.PREEMPTED, 140.0, 40),
        event(Kind.RESIZE, 150.0, 40, world_size=2, previous_world_size=3),
    ]
    rows = [MetricsRow.from_json({"epoch": 1, "time_s": 100.0 + s, "step": s}) for s in (10, 20, 30, 40, 41 + 10, 60)]
    progress = Progress(step=60, steady_steps=50, extra={"steady_time_s": 50.0})
    goodput = account(wall_s=70.0, started=100.0, events=events, rows=rows, progress=progress)
    assert goodput.failures == 0 and goodput.recovery_s == 0.0
    assert goodput.preemptions == 1 and goodput.preemption_s > 0 and goodput.redone_s == 0.0
    assert ("preemptions", goodput.preemption_s) in [(name, seconds) for name, seconds, _ in shares(goodput)]


def test_a_silent_workers_node_is_suspected_held_out_and_let_back_once_it_answers(monkeypatch):
    """Restart mode: a worker whose poll hung past raytrain's limit fails the attempt, and its
    node is held out of the restart until it runs a task again (or the head declares it dead)."""
    from types import SimpleNamespace

    from raytrain.faults import evict
    from raytrain.faults.ray_internals import WorkerHealthCheckTimeoutError

    store: dict[bytes, bytes] = {}
    monkeypatch.setattr(evict, "_internal_kv_put", lambda k, v, overwrite, namespace: store.__setitem__(k, v))

    def delete(key, del_by_prefix=False, namespace=None):
        for k in [k for k in store if k == key or (del_by_prefix and k.startswith(key))]:
            store.pop(k)

    monkeypatch.setattr(evict, "_internal_kv_del", delete)
    monkeypatch.setattr(
        evict, "_internal_kv_list", lambda prefix, namespace: [k for k in store if k.startswith(prefix)]
    )
    monkeypatch.setattr(evict.ray, "is_initialized", lambda: True)
    suspects = evict.Suspects(b"run")
    monkeypatch.setattr(suspects, "_probe", lambda: None)  # the thread's loop: probed below, once at a time
    workers = [SimpleNamespace(distributed_context=SimpleNamespace(world_rank=r), metadata=SimpleNamespace(node_id=n))
               for r, n in enumerate(["a", "a", "b", "b"])]  # fmt: skip
    suspects.after_worker_group_start(SimpleNamespace(get_workers=lambda: workers))
    ok, hung = SimpleNamespace(error=None), SimpleNamespace(error=WorkerHealthCheckTimeoutError("hung 10 s"))
    suspects.after_worker_group_poll_status(SimpleNamespace(worker_statuses={0: ok, 1: ok, 2: ok, 3: ok}))
    assert evict.evicted_nodes(b"run") == set()
    suspects.after_worker_group_poll_status(SimpleNamespace(worker_statuses={0: ok, 1: ok, 2: hung, 3: hung}))
    assert evict.evicted_nodes(b"run") == {"b"}  # the restart is placed off it
    selector = evict.KeepEvictedOut(b"run").on_controller_start_worker_group(scaling_config=None, num_workers=2)
    assert selector == {"ray.io/node-id": "!in(b)"}

    answers = iter([False, True])
    monkeypatch.setattr(evict, "_answers", lambda node, timeout_s: next(answers))
    monkeypatch.setattr(evict.ray, "nodes", lambda: [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": True}])
    suspects.probe_once()  # silent: still held out
    assert evict.evicted_nodes(b"run") == {"b"}
    suspects.probe_once()  # it answers: no longer held out
    assert evict.evicted_nodes(b"run") == set()
    store[b"run/c"] = b"1"  # an evicted straggler's node stays out whatever answers
    store[b"other/d"] = b"1"
    assert evict.evicted_nodes(b"run") == {"c"}
    evict.forget_run(b"run")  # the driver ends: the run's entries go, another run's stay
    assert list(store) == [b"other/d"]


def test_restart_mode_takes_a_worker_silent_for_10_s_as_gone_and_ray_trains_watcher_is_off(monkeypatch):
    from raytrain.driver import launch

    keys = ("RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")
    for key in keys:
        monkeypatch.setenv(key, "0")  # restored after the test, as apply_train_timers writes them
        monkeypatch.delenv(key)
    monkeypatch.setattr(launch, "_TIMERS_SET_HERE", set())
    launch.apply_train_timers(TrainConfig(workers="2:4"))
    assert [launch.os.environ.get(k) for k in keys] == ["10.0", "0"]
    launch.apply_train_timers(TrainConfig(workers="2:4", fault_tolerance="per-step", max_failures=3))
    assert keys[0] not in launch.os.environ  # per-step: the peers' wait finds a silent replica


@pytest.mark.slow  # starts two Python processes
def test_one_process_per_node_polls_the_drain_whatever_the_address_several_nodes_share(tmp_path, monkeypatch):
    """Ray Train's local rank counts workers by address; the poller is chosen by node id instead."""
    import subprocess
    import sys

    from raytrain.instruments import notice

    monkeypatch.setattr(notice, "_NODE_LOCK", None)
    assert notice.first_on_node("node-a", str(tmp_path))  # this process holds node-a's lock from here on
    ask = "import sys; from raytrain.instruments import notice; print(notice.first_on_node(*sys.argv[1:]))"
    other = [subprocess.run([sys.executable, "-c", ask, node, str(tmp_path)], capture_output=True, text=True)
             for node in ("node-a", "node-b")]  # fmt: skip
    assert [o.stdout.strip() for o in other] == ["False", "True"], [o.stderr[-500:] for o in other]
    notice._NODE_LOCK.close()
