"""Which interface a worker's gloo and NCCL bind to (`raytrain.rules.network`; pure, no Ray)."""

from __future__ import annotations

import pytest
from ray.train import ControllerError

from raytrain.errors import exit_status, find_user_error
from raytrain.rules.network import WorkerNetwork, connect_failure, interface_env, interface_holding, is_loopback
from raytrain.worker.network import BindsInterfaces, ProcessGroupNetworkError, bind_to_node_interface

HOST_A = {"lo": ["127.0.0.1", "::1"], "ens5": ["10.77.0.1", "fe80::5c50:1bff:fecd:84fa%ens5"]}
# What Ray Train's controller got when host B's rank handed host A's its hostname's address (Debian's
# /etc/hosts: 127.0.1.1), as tests/test_hosts_ray.py's hosts gave it before raytrain bound the interfaces.
GLOO_REFUSED = (
    "\x1b[36mray::execute._setup_torch_process_group()\x1b[39m (pid=2076, ip=10.77.0.1, "
    "actor_id=974b92d89e355c43b8850a4801000000, repr=<...RayTrainWorker object at 0x7f50803c2e50>)\n"
    '  File ".../ray/train/torch/config.py", line 147, in _setup_torch_process_group\n'
    "RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[127.0.1.1]:4503$0"
)
HOST_B = {"lo": ["127.0.0.1", "::1"], "docker0": ["172.17.0.1"], "eth1": ["10.77.0.2"]}


def test_each_host_binds_the_interface_that_holds_its_node_address_whatever_its_name():
    assert interface_env("10.77.0.1", HOST_A, {}) == {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "=ens5"}
    assert interface_env("10.77.0.2", HOST_B, {}) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"}


def test_nccls_value_is_an_exact_name_not_a_prefix():
    # NCCL reads a bare name as a prefix: "eth1" would also take eth10.
    interfaces = {"eth10": ["10.0.0.9"], "eth1": ["10.0.0.1"]}
    assert interface_env("10.0.0.1", interfaces, {})["NCCL_SOCKET_IFNAME"] == "=eth1"


def test_a_variable_the_user_set_is_kept_and_only_the_other_one_is_set():
    assert interface_env("10.77.0.1", HOST_A, {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": "=ens5"}
    assert interface_env("10.77.0.1", HOST_A, {"NCCL_SOCKET_IFNAME": "^docker"}) == {"GLOO_SOCKET_IFNAME": "ens5"}
    both = {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "ens"}
    assert interface_env("10.77.0.1", HOST_A, both) == {}
    assert interface_env("10.77.0.1", HOST_A, {"GLOO_SOCKET_IFNAME": ""}) == {"NCCL_SOCKET_IFNAME": "=ens5"}


def test_an_address_no_interface_holds_sets_nothing():
    # A node address behind NAT, or one given to `ray start --node-ip-address` that the host does not hold.
    assert interface_holding("203.0.113.5", HOST_A) is None
    assert interface_env("203.0.113.5", HOST_A, {}) == {}
    assert interface_env("10.77.0.1", {}, {}) == {}


def test_a_single_machine_node_on_loopback_binds_loopback():
    assert interface_env("127.0.0.1", HOST_A, {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}


def test_ipv6_addresses_match_in_any_spelling_and_without_their_zone():
    assert interface_holding("fe80:0::5c50:1bff:fecd:84fa", HOST_A) == "ens5"
    assert interface_holding("[::1]", HOST_A) == "lo"


def test_the_first_interface_in_the_kernels_order_wins_when_several_hold_the_address():
    assert interface_holding("10.0.0.1", {"bond0": ["10.0.0.1"], "eth0": ["10.0.0.1"]}) == "bond0"


def test_loopback_addresses():
    assert is_loopback("127.0.1.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.77.0.1") and not is_loopback("vm")


def workers(gloo_b: str | None = None) -> list[WorkerNetwork]:
    a = WorkerNetwork("vm", "10.77.0.1", "ens5", {"GLOO_SOCKET_IFNAME": "ens5"}, ("GLOO_SOCKET_IFNAME",))
    chosen_b = {"GLOO_SOCKET_IFNAME": gloo_b} if gloo_b else {}
    b = WorkerNetwork("vm", "10.77.0.2", "eth1", chosen_b, ())
    return [a, a, b, b]


def test_a_group_that_cannot_connect_across_hosts_names_the_host_the_address_it_tried_and_the_fix():
    failure = connect_failure(GLOO_REFUSED, workers(gloo_b="lo"))
    assert failure is not None and failure.deterministic
    message = failure.message
    assert "on host vm (10.77.0.1) tried 127.0.1.1" in message and "loopback" in message
    assert "GLOO_SOCKET_IFNAME per host: vm (10.77.0.1) ens5, set by raytrain; " in message
    assert "vm (10.77.0.2) lo, set by the user, but 10.77.0.2 is on eth1." in message
    assert "Fix: unset GLOO_SOCKET_IFNAME wherever it is set" in message and "firewall" in message
    assert message.endswith("SO_ERROR: Connection refused, remote=[127.0.1.1]:4503$0")


def test_the_address_tried_is_the_one_dialled_not_a_time_or_a_line_number():
    text = "[E1204 16:47:05.204] pair.cc:152] connect [10.77.0.9]:4567: Connection timed out (pid=1, ip=10.77.0.2)"
    failure = connect_failure(text, workers())
    assert failure is not None and "a worker on host vm (10.77.0.2) tried 10.77.0.9." in failure.message
    assert not failure.deterministic  # a node's own address refused or timed out: a firewall, or a host cut off
    unset = [WorkerNetwork("vm", "10.77.0.1", None, {}, ()), WorkerNetwork("vm", "10.77.0.2", "eth1", {}, ())]
    failure = connect_failure("ncclSystemError: socketStartConnect: Connection refused", unset)
    assert failure is not None and not failure.deterministic
    message = failure.message
    assert "could not connect." in message and "NCCL_SOCKET_IFNAME per host" in message
    assert "vm (10.77.0.1) unset (no interface holds 10.77.0.1); vm (10.77.0.2) unset (the hostname decides)" in message


def test_other_failures_and_groups_on_one_host_are_left_as_they_are():
    assert connect_failure("RuntimeError: CUDA out of memory", workers()) is None
    one_host = [WorkerNetwork("vm", "10.77.0.1", "ens5", {}, ())] * 2
    assert connect_failure(GLOO_REFUSED, one_host) is None


class FakeGroup:
    def __init__(self, found: list[WorkerNetwork]):
        self.found = found

    def execute(self, fn):
        assert fn is bind_to_node_interface
        return self.found


class RaysBackend:
    """Stands for Ray's backend: its on_start creates the process group."""

    def __init__(self, error: Exception | None = None):
        self.error, self.started = error, False

    def on_start(self, worker_group, backend_config):
        self.started = True
        if self.error is not None:
            raise self.error


class Backend(BindsInterfaces, RaysBackend):
    pass


def test_the_backend_binds_every_worker_before_rays_on_start_and_names_a_failure_to_connect():
    backend = Backend()
    backend.on_start(FakeGroup(workers()), None)
    assert backend.started

    with pytest.raises(ProcessGroupNetworkError, match=r"on host vm \(10\.77\.0\.1\) tried 127\.0\.1\.1") as raised:
        Backend(RuntimeError(GLOO_REFUSED)).on_start(FakeGroup(workers()), None)
    # Inside Ray's ControllerError it is still the user's to fix: exit 2, never retried.
    assert find_user_error(ControllerError(raised.value)) is raised.value
    assert exit_status(raised.value) == 2

    # A node's own address refused (a firewall, a host cut off): said the same way, left to Ray's retries.
    firewalled = GLOO_REFUSED.replace("127.0.1.1", "10.77.0.2")
    with pytest.raises(RuntimeError, match=r"tried 10\.77\.0\.2\. GLOO_SOCKET_IFNAME per host") as raised:
        Backend(RuntimeError(firewalled)).on_start(FakeGroup(workers()), None)
    assert find_user_error(raised.value) is None

    with pytest.raises(ValueError, match="unrelated"):
        Backend(ValueError("unrelated")).on_start(FakeGroup(workers()), None)
