"""An elastic run's view of the cluster kept fresh, so that it shrinks off a lost node and grows
onto a new one within seconds.

Ray Train 2.60's elastic policy sizes a worker group from the resources Ray Data's
AutoscalingCoordinator reserves for it, and the coordinator reads the cluster's nodes only on
its tick, every 20 s (`_AutoscalingCoordinatorActor.TICK_INTERVAL_S`). After a node dies the
controller's next decision may still count it: it asks for the old size, waits out the
placement group's start timeout (`launch.ELASTIC_START_TIMEOUT_S`), and only
then tries the size the cluster has. Measured on two real hosts with one cut off
(benchmarks/real_hosts.py): 58 s from the cut to training again, of which 30 s was that wait
(the timeout was 30 s then). A new node waits for the tick the same way before the run grows onto it.

`FreshResources`, a controller callback, asks the coordinator to read the nodes again (a
`recompute` of its reservations, one `ray.nodes()` on the head) before the controller acts on a
failure, and every `REFRESH_S` while the group runs. The request is sent, not awaited: the
coordinator is an actor that takes its calls in order, so the policy's next query, sent after
it, is answered from the fresh view.
"""

from __future__ import annotations

import time
from typing import Any

from raytrain.faults.ray_internals import ControllerCallback, WorkerGroupCallback, get_or_create_autoscaling_coordinator

REFRESH_S = 5.0  # the view's age at most while the group runs: a new node is seen within this
REQUESTER = "raytrain-fresh-resources"  # asks for nothing: its reservation is always empty


class FreshResources(ControllerCallback, WorkerGroupCallback):
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.last = float("-inf")
        self.coordinator: Any = None

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        self.refresh()

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        if self.clock() - self.last >= REFRESH_S:
            self.refresh()

    def refresh(self) -> None:
        self.last = self.clock()
        try:
            if self.coordinator is None:
                self.coordinator = get_or_create_autoscaling_coordinator()
            self.coordinator.get_reserved_resources.remote(REQUESTER, recompute=True)
        except Exception:  # noqa: BLE001 - a stale view costs time, never the run
            self.coordinator = None
