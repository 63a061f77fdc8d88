"""Which interface a worker's gloo and NCCL bind to (`raytrain.rules.network`; pure, no Ray)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from ray.train import ControllerError

from raytrain.errors import exit_status, find_user_error
from raytrain.rules import network
from raytrain.rules.network import (
    NodeNetwork,
    Unreachable,
    WorkerNetwork,
    connect_failure,
    host_problems,
    interface_env,
    interface_holding,
    is_loopback,
    network_findings,
    selected,
)
from raytrain.worker.network import (
    BindsInterfaces,
    ProcessGroupNetworkError,
    bind_to_node_interface,
    check_host_interfaces,
    connect_now,
    host_interfaces,
)

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


NAMES = ["lo", "eth0", "eth10", "docker0"]


@pytest.mark.parametrize(
    ("variable", "value", "taken", "lacking"),
    [
        ("GLOO_SOCKET_IFNAME", "eth0", ["eth0"], None),
        ("GLOO_SOCKET_IFNAME", "nosuch0", [], "nosuch0"),
        # gloo makes a device for every name of its list: one missing name fails it all.
        ("GLOO_SOCKET_IFNAME", "lo,nosuch0", ["lo"], "nosuch0"),
        ("GLOO_SOCKET_IFNAME", "eth", [], "eth"),  # gloo takes exact names, no prefixes
        ("NCCL_SOCKET_IFNAME", "eth", ["eth0", "eth10"], None),  # NCCL: prefixes
        ("NCCL_SOCKET_IFNAME", "=eth1", [], "eth1"),  # `=`: exact names, so eth10 is not eth1
        ("NCCL_SOCKET_IFNAME", "=eth0,nosuch0", ["eth0"], None),  # NCCL takes whichever of its list exist
        ("NCCL_SOCKET_IFNAME", "nosuch,ib", [], "named nosuch* or ib*"),
        ("NCCL_SOCKET_IFNAME", "^docker,lo", ["eth0", "eth10"], None),  # `^`: what the prefixes do not match
        ("NCCL_SOCKET_IFNAME", "^=eth1", NAMES, None),
        ("NCCL_SOCKET_IFNAME", "^lo,eth,docker", [], "other than lo*, eth*, docker*"),
        ("NCCL_SOCKET_IFNAME", "^=lo,eth0,eth10,docker0", [], "other than lo, eth0, eth10, docker0"),
        ("TP_SOCKET_IFNAME", "eth0", ["eth0"], None),
        ("TP_SOCKET_IFNAME", "eth0,lo", [], "eth0,lo"),  # tensorpipe looks the whole value up as one name
    ],
)
def test_which_interfaces_a_variable_names_and_what_of_them_a_host_lacks(variable, value, taken, lacking):
    assert selected(variable, value, NAMES) == (taken, lacking)


def test_a_variable_naming_an_interface_the_host_lacks_is_one_message_with_the_host_its_interfaces_and_the_fix():
    interfaces = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.1"]}
    assert host_problems({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^lo"}, "vm", interfaces) == []
    assert host_problems({"GLOO_SOCKET_IFNAME": ""}, "vm", interfaces) == []  # empty: unset, to gloo too
    env = {"GLOO_SOCKET_IFNAME": "lo,nosuch0", "NCCL_SOCKET_IFNAME": "=nosuch0", "TP_SOCKET_IFNAME": "eth0"}
    gloo, nccl = host_problems(env, "vm", interfaces)
    assert gloo == (
        "GLOO_SOCKET_IFNAME=lo,nosuch0 cannot work on host vm: it has no interface nosuch0 (its interfaces: lo, eth0). "
        "Fix: unset GLOO_SOCKET_IFNAME wherever it is set (where you run raytrain, the job's runtime_env, or before "
        "`ray start` on that host), and raytrain binds each worker to the interface that holds its node address; "
        "or set it to one of those."
    )
    assert nccl.startswith("NCCL_SOCKET_IFNAME==nosuch0 cannot work on host vm: it has no interface nosuch0 (")


def test_the_driver_of_an_embedded_ray_refuses_a_variable_naming_an_interface_this_host_lacks(monkeypatch):
    names = list(host_interfaces())
    assert names and all(host_interfaces().values())  # each with an IP address: loopback at least
    for variable in network.INTERFACE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    check_host_interfaces()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", names[0])
    check_host_interfaces()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ProcessGroupNetworkError) as raised:
        check_host_interfaces()
    message = str(raised.value)
    assert message.startswith(f"GLOO_SOCKET_IFNAME=nosuch0 cannot work on host {socket.gethostname()}: ")
    assert f"(its interfaces: {', '.join(names)})" in message and exit_status(raised.value) == 2


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


@pytest.mark.slow
def test_raytrain_train_with_a_variable_naming_no_interface_here_exits_2_before_ray_starts(tmp_path):
    """Issue 54: on one host, GLOO_SOCKET_IFNAME naming a missing interface was a ControllerError (exit 1)."""
    value = f"{next(iter(host_interfaces()))},nosuch0"  # one of this host's, then one it lacks
    script = "import sys, ray; from raytrain.cli import main; code = main(sys.argv[1:]); print(ray.is_initialized())"
    script += "; sys.exit(code)"
    env = {key: item for key, item in os.environ.items() if key != "RAY_ADDRESS"}
    args = ["train", "digits", "--workers", "2", "--storage", str(tmp_path / "runs")]
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**env, "GLOO_SOCKET_IFNAME": value},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        f"raytrain train: GLOO_SOCKET_IFNAME={value} cannot work on host {socket.gethostname()}: it has no interface "
        f"nosuch0 (its interfaces: {', '.join(host_interfaces())}). Fix: unset GLOO_SOCKET_IFNAME"
    )
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"  # Ray never started
    assert not (tmp_path / "runs").exists()  # nothing written


NODE_VARIABLE_RUN = """
import os, sys, time
import ray, raytrain
from raytrain.errors import exit_status
os.environ["GLOO_SOCKET_IFNAME"] = "nosuch0"  # the Ray node's environment: its workers inherit it
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
del os.environ["GLOO_SOCKET_IFNAME"]  # not the driver's: nothing refuses it before the workers start
started = time.monotonic()
try:
    raytrain.fit("digits", raytrain.TrainConfig(workers=2, epochs=1, storage=sys.argv[1]))
except Exception as exc:
    print(f"{exit_status(exc)} after {time.monotonic() - started:.1f} s: {exc}")
"""


@pytest.mark.ray
@pytest.mark.scenario
def test_a_nodes_variable_naming_an_interface_it_lacks_stops_the_run_as_its_workers_start(tmp_path):
    """On a cluster the driver's environment is not the nodes': each worker checks its own host."""
    done = subprocess.run(
        [sys.executable, "-c", NODE_VARIABLE_RUN, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    print(done.stdout[-2000:], done.stderr[-2000:])
    said = done.stdout.strip().splitlines()[-1]
    assert said.startswith("2 after "), said
    assert f"GLOO_SOCKET_IFNAME=nosuch0 cannot work on host {socket.gethostname()}: it has no interface nosuch0" in said
    assert said.count("GLOO_SOCKET_IFNAME=nosuch0 cannot work") == 1  # once for the host's two workers


class FakeGroup:
    def __init__(self, found: list[WorkerNetwork]):
        self.found, self.ran = found, []

    def execute(self, fn):
        self.ran.append(fn)
        return self.found if fn is bind_to_node_interface else [None] * len(self.found)


class RaysBackend:
    """Stands for Ray's backend: its on_start creates the process group."""

    def __init__(self, error: Exception | None = None):
        self.error, self.started = error, False

    def on_start(self, worker_group, backend_config):
        self.started = True
        if self.error is not None:
            raise self.error

    def on_shutdown(self, worker_group, backend_config):
        import os

        self.shutdown_wait_s = os.environ.get("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S")


class Nccl:
    backend = "nccl"


class Backend(BindsInterfaces, RaysBackend):
    pass


def test_ray_waits_3_s_not_30_for_the_workers_to_destroy_their_process_group(monkeypatch):
    """After a host was cut off its workers never answer: Ray's 30 s wait was most of a restart."""
    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "0")
    monkeypatch.delenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S")
    backend = Backend()
    backend.on_shutdown(FakeGroup(workers()), None)
    assert backend.shutdown_wait_s == "3"
    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "45")  # one the user gave wins
    backend.on_shutdown(FakeGroup(workers()), None)
    assert backend.shutdown_wait_s == "45"


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


def test_a_worker_whose_host_lacks_the_named_interface_stops_the_group_before_it_forms():
    lacking = "GLOO_SOCKET_IFNAME=nosuch0 cannot work on host vm: it has no interface nosuch0 (its interfaces: lo)."
    found = [WorkerNetwork("vm", "10.77.0.1", "ens5", {"GLOO_SOCKET_IFNAME": "nosuch0"}, (), (lacking,))] * 2
    backend = Backend()
    with pytest.raises(ProcessGroupNetworkError) as raised:
        backend.on_start(FakeGroup(found), None)
    assert str(raised.value) == lacking  # said once for the host's two workers
    assert not backend.started  # before Ray creates the process group: whatever the number of hosts
    assert find_user_error(ControllerError(raised.value)) is raised.value  # exit 2, never retried


def test_on_nccl_the_backend_connects_at_once_with_a_one_element_all_reduce():
    from raytrain.instruments.notice import catch_notices

    group = FakeGroup(workers())
    Backend().on_start(group, Nccl())
    assert group.ran == [catch_notices, bind_to_node_interface, connect_now]
    group = FakeGroup(workers())
    Backend().on_start(group, None)  # gloo connects as the group forms
    assert group.ran == [catch_notices, bind_to_node_interface]  # notices caught in each worker's main thread


def test_a_failure_to_connect_at_ncclss_first_all_reduce_is_named_like_one_while_the_group_forms():
    class FailsToConnect(FakeGroup):
        def execute(self, fn):
            if fn is connect_now:
                raise RuntimeError(GLOO_REFUSED.replace("Gloo connectFullMesh failed", "ncclSystemError"))
            return super().execute(fn)

    with pytest.raises(ProcessGroupNetworkError, match=r"tried 127\.0\.1\.1.*NCCL_SOCKET_IFNAME per host"):
        Backend().on_start(FailsToConnect(workers()), Nccl())


def test_connect_now_all_reduces_one_element_over_the_process_group(one_rank_group):
    connect_now()  # gloo, one rank on the CPU: the call a GPU worker makes on NCCL


# -- what `raytrain doctor` says of the network between hosts ------------------------------

DEBIAN = ("127.0.1.1",)  # Debian's default /etc/hosts: the hostname on 127.0.1.1


def debian_hosts(**b) -> list[NodeNetwork]:
    """The two hosts of tests/hosts.py: ens5 on one, eth1 on the other, the hostname on loopback."""
    a = NodeNetwork("vm", "10.77.0.1", HOST_A, DEBIAN)
    return [a, NodeNetwork(**{"hostname": "vm", "node_address": "10.77.0.2", "interfaces": HOST_B, **b})]


def test_a_hostname_on_loopback_is_a_note_per_host_with_the_hosts_line_that_fixes_it():
    found = network_findings(debian_hosts(resolves_to=DEBIAN), {})
    assert found.problems == []
    loopback = [note for note in found.notes if "resolves to 127.0.1.1, a loopback address" in note]
    assert len(loopback) == 2
    assert loopback[0].startswith("node 10.77.0.1 (vm): its hostname vm resolves to 127.0.1.1")
    assert "raytrain binds its workers to ens5, which holds 10.77.0.1, so raytrain runs work" in loopback[0]
    assert '"10.77.0.1 vm" in place of "127.0.1.1 vm"' in loopback[0] and "torchrun" in loopback[0]
    assert "GLOO_SOCKET_IFNAME=eth1 and NCCL_SOCKET_IFNAME==eth1" in loopback[1]
    assert '"10.77.0.2 vm" in place of "127.0.1.1 vm"' in loopback[1]


def test_interfaces_named_differently_are_a_note_that_one_name_for_every_host_would_fail():
    found = network_findings(debian_hosts(resolves_to=("10.77.0.2",)), {})
    assert found.problems == [] and len(found.notes) == 2  # host A's hostname on loopback; the names
    assert found.notes[1].startswith(
        "the node addresses are on interfaces named differently: ens5 on 10.77.0.1 (vm); eth1 on 10.77.0.2 (vm). "
        "raytrain binds each host's workers to its own, so raytrain runs work"
    )
    assert "set to one name for every host" in found.notes[1] and "fails on the others" in found.notes[1]
    same = [NodeNetwork("a", "10.0.0.1", {"eth0": ["10.0.0.1"]}), NodeNetwork("b", "10.0.0.2", {"eth0": ["10.0.0.2"]})]
    assert network_findings(same, {}).notes == []


def test_one_node_alone_has_nothing_to_say_but_a_variable_naming_an_interface_it_lacks():
    alone = debian_hosts()[:1]
    assert network_findings(alone, {"GLOO_SOCKET_IFNAME": "lo"}) == network_findings([], {})  # loopback: one host
    assert network_findings([], {}).problems == [] and network_findings([], {}).notes == []
    found = network_findings(alone, {"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert found.notes == [] and found.problems == [
        "GLOO_SOCKET_IFNAME=nosuch0, set where doctor runs (a run started here passes it on to every worker, on "
        "every host), cannot work: 10.77.0.1 (vm) has no interface nosuch0 (its interfaces: lo, ens5; its node "
        "address is on ens5). A run's workers cannot form their process group. Fix: unset GLOO_SOCKET_IFNAME "
        "(raytrain binds each worker to the interface that holds its node address, whatever its name on that host), "
        "or set it on each host, before `ray start` there, to that host's own interface (`ip -br addr`)"
    ]
    on_node = network_findings([NodeNetwork("vm", "10.77.0.1", HOST_A, variables={"TP_SOCKET_IFNAME": "eth0"})], {})
    assert len(on_node.problems) == 1 and on_node.problems[0].startswith(
        "TP_SOCKET_IFNAME=eth0, set on node 10.77.0.1 (in its Ray node's environment), cannot work: 10.77.0.1 (vm) "
        "has no interface eth0"
    )


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("GLOO_SOCKET_IFNAME", "ens5", ["10.77.0.2 (vm) has no interface ens5 (its interfaces: lo, docker0, eth1; "]),
        ("NCCL_SOCKET_IFNAME", "=eth1", ["10.77.0.1 (vm) has no interface eth1 (its interfaces: lo, ens5; its node"]),
        ("NCCL_SOCKET_IFNAME", "eth", ["10.77.0.1 (vm) has no interface named eth* (its interfaces: lo, ens5; its"]),
        (
            "GLOO_SOCKET_IFNAME",
            "ens5,eth1",
            ["10.77.0.1 (vm) has no interface eth1", "10.77.0.2 (vm) has no interface ens5"],
        ),
        ("GLOO_SOCKET_IFNAME", "lo", ["on 10.77.0.1 (vm) it names loopback", "on 10.77.0.2 (vm) it names loopback"]),
        ("NCCL_SOCKET_IFNAME", "e", []),  # a prefix of ens5 and eth1
        ("NCCL_SOCKET_IFNAME", "=ens5,eth1", []),  # each host uses the one it has
        ("NCCL_SOCKET_IFNAME", "^docker,lo", []),  # an exclusion: nothing to check
    ],
)
def test_a_variable_set_where_doctor_runs_is_a_problem_when_some_host_cannot_use_it(variable, value, says):
    problems = network_findings(debian_hosts(), {variable: value}).problems
    if not says:
        assert problems == []
        return
    assert len(problems) == 1
    assert problems[0].startswith(f"{variable}={value}, set where doctor runs (a run started here passes it on")
    assert all(part in problems[0] for part in says), problems[0]
    assert (
        f"Fix: unset {variable} (raytrain binds each worker to the interface that holds its node address"
        in (problems[0])
    )


def test_a_variable_in_one_nodes_environment_is_checked_against_that_host_only():
    assert network_findings(debian_hosts(variables={"GLOO_SOCKET_IFNAME": "eth1"}), {}).problems == []
    problems = network_findings(debian_hosts(variables={"GLOO_SOCKET_IFNAME": "ens5"}), {}).problems
    assert len(problems) == 1 and problems[0].startswith(
        "GLOO_SOCKET_IFNAME=ens5, set on node 10.77.0.2 (in its Ray node's environment), cannot work: "
        "10.77.0.2 (vm) has no interface ens5 (its interfaces: lo, docker0, eth1; its node address is on eth1)"
    )
    # Set where the run starts, it reaches every worker over the node's own.
    problems = network_findings(debian_hosts(variables={"GLOO_SOCKET_IFNAME": "ens5"}), {"GLOO_SOCKET_IFNAME": "lo"})
    assert len(problems.problems) == 1 and "lo, set where doctor runs" in problems.problems[0]


def test_a_node_address_no_interface_holds_is_a_note_and_with_a_hostname_on_loopback_a_problem():
    behind_nat = {"hostname": "vm", "node_address": "203.0.113.5", "interfaces": HOST_B}
    found = network_findings(debian_hosts(**behind_nat, resolves_to=("10.77.0.2",)), {})
    assert found.problems == []
    assert any(
        note.startswith("node 203.0.113.5 (vm): no interface of that host holds its node address (a node behind NAT")
        and "gloo takes the address the hostname resolves to: 10.77.0.2" in note
        for note in found.notes
    ), found.notes
    # raytrain then sets nothing there, and gloo takes the hostname's address: loopback.
    found = network_findings(debian_hosts(**behind_nat, resolves_to=DEBIAN), {})
    assert len(found.problems) == 1 and found.problems[0].startswith(
        "node 203.0.113.5 (vm): no interface holds its node address (NAT?), so raytrain sets no GLOO_SOCKET_IFNAME "
        "there, and its hostname vm resolves to 127.0.1.1, a loopback address: gloo hands its peers loopback"
    )
    assert '"203.0.113.5 vm" in place of "127.0.1.1 vm"' in found.problems[0]
    # GLOO_SOCKET_IFNAME set by hand on that host decides instead of the hostname: a note again.
    hand_set = {**behind_nat, "variables": {"GLOO_SOCKET_IFNAME": "eth1"}}
    found = network_findings(debian_hosts(**hand_set, resolves_to=DEBIAN), {})
    assert found.problems == [] and any("no interface of that host holds" in note for note in found.notes)


def test_a_pair_that_cannot_connect_on_a_free_port_is_a_problem_naming_both_nodes_and_the_fix():
    refused = Unreachable("10.77.0.1", "10.77.0.2", 41234, "Connection refused")
    found = network_findings(debian_hosts(resolves_to=("10.77.0.2",)), {}, [refused], {"10.77.0.3": "no answer"})
    assert found.problems == [
        "node 10.77.0.1 (vm) cannot reach node 10.77.0.2 (vm) on a free port (41234): Connection refused. "
        "gloo and NCCL connect between hosts on random ports, not only Ray's: allow all TCP between the cluster's "
        "nodes on their private network (a firewall rule for the subnet, or a security group that admits itself)"
    ]
    assert "node 10.77.0.3: whether it reaches the other nodes on a free port is unchecked (no answer)" in found.notes


@pytest.mark.parametrize(
    "url, host, expected",
    [
        ("http://vm:33383", "10.77.0.1", "http://10.77.0.1:33383"),  # torchft's lighthouse, by hostname
        ("http://[::1]:5/status", "10.0.0.2", "http://10.0.0.2:5/status"),
        ("http://vm:33383", "fe80::1%eth0", "http://[fe80::1]:33383"),
        ("vm:80", "1.2.3.4", "1.2.3.4:80"),
    ],
)
def test_an_address_given_by_hostname_is_given_by_the_node_address_instead(url, host, expected):
    assert network.with_host(url, host) == expected


def test_a_driver_says_which_token_it_sends(tmp_path):
    from raytrain.driver.session import token_source

    home = tmp_path
    token = home / ".ray" / "auth_token"
    assert token_source({}, home) == f"RAY_AUTH_MODE is not `token` here and {token} does not exist: it sends no token"
    assert token_source({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x"}, home) == "the token in RAY_AUTH_TOKEN"
    assert token_source({"RAY_AUTH_MODE": "token"}, home) == f"no token: {home}/.ray/auth_token does not exist"
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("t")
    assert token_source({"RAY_AUTH_MODE": "token"}, home).startswith(f"the token in {token} (last changed ")
    named = tmp_path / "mine"
    named.write_text("t")
    sent = token_source({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(named)}, home)
    assert sent.startswith(f"the token in {named} (")
