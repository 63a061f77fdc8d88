"""`raytrain doctor`: the report on this machine and its verdicts.

The CLI tests run the console script in a subprocess (marked `ray`): once on the embedded
local Ray a plain `raytrain train` would use (this machine's real CPU count), and, to spare a
Ray start each, joined with --address to the test session's Ray for the storage failures.
The verdict tests call `assess` and `assess_network` with made-up nodes and probe results
(multi-node storage, GPU nodes, the network between hosts) and need no Ray; two real hosts'
network is tests/test_hosts_ray.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.doctor import StorageState, assess, assess_network, describe_node, describe_reachability, inspect_storage
from raytrain.rules.network import Unreachable

_SCRIPT = Path(sys.executable).parent / "raytrain"  # the console script of this venv
RAYTRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "raytrain.cli"]


def doctor(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the embedded Ray, never another one
    return subprocess.run([*RAYTRAIN, "doctor", *args], capture_output=True, text=True, timeout=timeout, env=env)


def node_cpus() -> int:
    from ray._private.utils import get_num_cpus  # what Ray detects (cgroup-aware)

    return int(get_num_cpus())


@pytest.mark.ray
def test_doctor_reports_this_machine(tmp_path):
    run = doctor("--storage", str(tmp_path))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(rf"^\s+node \S+ .*: {node_cpus()} CPUs, no GPU, .*GiB", out, re.M), out
    assert "1 node(s)" in out
    assert "Backend a run will use: gloo" in out
    assert re.search(r"ray 2\.\d+\.\d+, torch \d", out), out
    assert f"Storage: {tmp_path} (writable" in out
    assert "OK: a run will work here." in out
    assert not list(tmp_path.iterdir()), "doctor left its probe files behind"


@pytest.fixture
def session_address(ray_session) -> str:
    """The GCS address of the test session's Ray (token auth: the same default token)."""
    return ray_session.get_runtime_context().gcs_address


@pytest.mark.ray
def test_doctor_missing_storage_names_the_fix(session_address):
    run = doctor("--address", session_address, "--storage", "/nonexistent/path")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert f"connected to {session_address}" in out
    assert "FAIL storage path /nonexistent/path does not exist" in out
    assert "mkdir -p /nonexistent/path" in out and "--storage" in out
    assert "Traceback" not in out
    assert "declares a silent node" not in out  # the session's Ray has raytrain's health checks


def _unwritable_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked
    # root ignores permission bits; sysfs refuses new files even to root.
    probe = Path("/sys/raytrain-doctor-probe")
    try:
        probe.write_text("x")
    except OSError:
        return Path("/sys")
    probe.unlink()
    pytest.skip("no directory here is unwritable for this user")


@pytest.mark.ray
def test_doctor_unwritable_storage(tmp_path, session_address):
    locked = _unwritable_dir(tmp_path)
    run = doctor("--address", session_address, "--storage", str(locked))
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert f"FAIL storage path {locked} is not writable" in out, out
    assert "pass another --storage" in out
    assert "Traceback" not in out


@pytest.mark.slow
def test_doctor_unreachable_address_fails_fast():
    port = _closed_port()
    run = doctor("--address", f"127.0.0.1:{port}", timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert f"FAIL cannot reach Ray at 127.0.0.1:{port}: nothing answers there (Connection refused)" in out, out
    assert "fix: start the head there" in out and "token" not in out  # no head answered, so none refused a token


def test_dashboard_url_is_not_a_ray_address():
    from raytrain.driver.session import address_problem as _unreachable

    assert "GCS address" in _unreachable("http://127.0.0.1:8265")[0]
    assert _unreachable("auto") is None


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- verdicts without Ray ------------------------------------------------------------------

LOCAL = {"torch": "2.13.0", "cuda": None, "cuda_usable": False, "nccl": False, "gloo": True}


def _node(i: int, gpus: int = 0) -> dict:
    return {
        "NodeID": f"n{i}",
        "NodeManagerAddress": f"10.0.0.{i}",
        "Alive": True,
        "Resources": {"CPU": 8.0, "GPU": float(gpus)},
    }


def _facts(**extra) -> dict:
    return {
        "hostname": "h",
        "torch": "2.13.0",
        "cuda": "12.8",
        "cuda_usable": True,
        "nccl": True,
        "gloo": True,
        "raytrain": "0.1.0",
        **extra,
    }


def test_file_as_storage_fails(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    report = assess([_node(1)], {}, inspect_storage(str(file)), LOCAL)
    assert any("is a file, not a directory" in p for p in report.problems), report


def test_writable_storage_passes_and_leaves_a_marker_for_the_nodes(tmp_path):
    state = inspect_storage(str(tmp_path))
    assert state.writable and state.marker and (tmp_path / state.marker).read_text() == state.token
    assert assess([_node(1)], {"n1": _facts()}, state, LOCAL).problems == []


def test_multi_node_storage_not_shared_fails(tmp_path):
    state = inspect_storage(str(tmp_path))
    nodes = [_node(1), _node(2, gpus=8)]
    probes = {
        "n1": _facts(sees_marker=True, storage_writable=True),
        "n2": _facts(sees_marker=False, storage_writable=True, hostname="gpu-2"),
    }
    problems = assess(nodes, probes, state, LOCAL).problems
    assert len(problems) == 1 and "is not shared: node 10.0.0.2 (gpu-2)" in problems[0]
    assert "NFS" in problems[0] and "--storage" in problems[0]
    probes["n2"]["sees_marker"] = True
    assert assess(nodes, probes, state, LOCAL).problems == []


def test_multi_node_default_storage_missing_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/raytrain_results does not exist there
    state = inspect_storage(None)
    assert not state.exists and not state.explicit
    problems = assess([_node(1), _node(2)], {}, state, LOCAL).problems
    assert any("multi-node cluster needs storage every node shares" in p for p in problems), problems
    assert assess([_node(1)], {}, state, LOCAL).problems == []  # one machine: created on the first run


def test_gpu_node_with_cpu_torch_fails(tmp_path):
    state = StorageState(path=str(tmp_path), explicit=True, exists=True, is_dir=True, writable=True)
    probes = {"n1": _facts(cuda=None, cuda_usable=False, nccl=False)}
    problems = assess([_node(1, gpus=1)], probes, state, LOCAL).problems
    assert len(problems) == 1 and "CPU-only torch" in problems[0] and "--no-gpu" in problems[0]


def test_node_without_raytrain_fails_and_silent_node_is_noted(tmp_path):
    state = StorageState(path=str(tmp_path), explicit=True, exists=True, is_dir=True, writable=True)
    probes = {
        "n1": _facts(raytrain_error="ModuleNotFoundError: No module named 'raytrain'"),
        "n2": {"error": "no answer within 90 s"},
    }
    report = assess([_node(1), _node(2)], probes, state, LOCAL)
    assert len(report.problems) == 1 and "raytrain does not import" in report.problems[0]
    assert "--working-dir" in report.problems[0]
    assert any("did not answer" in note for note in report.notes)


def _network_facts(i: int, interface: str, **extra) -> dict:
    """What the probe finds of a host of tests/hosts.py: Debian's /etc/hosts, its own interface name."""
    interfaces = {"lo": ["127.0.0.1", "::1"], interface: [f"10.0.0.{i}"]}
    return _facts(hostname="vm", node_address=f"10.0.0.{i}", interfaces=interfaces, resolves_to=["127.0.1.1"], **extra)


def test_the_network_between_hosts_is_read_from_the_probes_facts():
    nodes = [_node(1), _node(2)]
    probes = {"n1": _network_facts(1, "ens5"), "n2": _network_facts(2, "eth1")}
    report = assess_network(nodes, probes, {})
    assert report.problems == []
    assert [note.split(":")[0] for note in report.notes[:2]] == ["node 10.0.0.1 (vm)", "node 10.0.0.2 (vm)"]
    assert "interfaces named differently: ens5 on 10.0.0.1 (vm); eth1 on 10.0.0.2 (vm)" in report.notes[2]
    assert "interface ens5" in describe_node(nodes[0], probes["n1"])
    assert "no interface holds its address" in describe_node(nodes[0], {**probes["n1"], "node_address": "10.9.9.9"})

    # A variable set here (raytrain passes it on to every worker) that one host lacks; a node's own.
    probes["n2"]["interface_variables"] = {"NCCL_SOCKET_IFNAME": "=ens5"}
    report = assess_network(nodes, probes, {"GLOO_SOCKET_IFNAME": "ens5"})
    assert [problem.split(",")[0] for problem in report.problems] == [
        "GLOO_SOCKET_IFNAME=ens5",
        "NCCL_SOCKET_IFNAME==ens5",
    ]

    # A node whose probe failed, or found no network, is left out: one host alone says nothing.
    assert assess_network(nodes, {"n1": probes["n1"], "n2": {"error": "no answer within 90 s"}}, {}).notes == []


def test_pairs_that_cannot_connect_are_problems_and_the_line_counts_them():
    nodes = [_node(1), _node(2)]
    probes = {"n1": _network_facts(1, "eth0"), "n2": _network_facts(2, "eth0")}
    pairs = [
        Unreachable("10.0.0.2", "10.0.0.1", 40001, "no answer within 2.5 s (packets dropped: a firewall, or no route)")
    ]
    report = assess_network(nodes, probes, {}, pairs, {})
    assert report.problems == [
        "node 10.0.0.2 (vm) cannot reach node 10.0.0.1 (vm) on a free port (40001): no answer within 2.5 s (packets "
        "dropped: a firewall, or no route). gloo and NCCL connect between hosts on random ports, not only Ray's: "
        "allow all TCP between the cluster's nodes on their private network (a firewall rule for the subnet, or a "
        "security group that admits itself)"
    ]
    assert (
        describe_reachability(2, pairs, {})
        == "Between nodes: 1 of 2 node pairs could not connect on a free port (below)"
    )
    assert (
        describe_reachability(3, [], {})
        == "Between nodes: each of the 3 nodes reached every other's address on a free port"
    )
    assert describe_reachability(2, [], {"10.0.0.2": "x"}) == "Between nodes: 1 node(s) unchecked (below)"


def test_the_listener_dials_each_endpoint_and_says_why_one_did_not_connect():
    import socket

    from raytrain.doctor.network import _make_listener

    listener = object.__new__(_make_listener())  # its dialling only: no Ray, no node address
    with socket.create_server(("127.0.0.1", 0)) as server:
        errors = listener.dial([("127.0.0.1", server.getsockname()[1]), ("127.0.0.1", _closed_port())], 2.0)
    assert errors == [None, "Connection refused"]
