"""Two real hosts (tests/hosts.py): a network stack each, interfaces named differently, a hostname
that resolves to loopback. With nothing set by hand, `raytrain train --address` trains across
them; with an interface variable that cannot work, the run stops at once with one message (exit 2);
`raytrain doctor --address` names both hostnames on loopback, the differing interface names and
the head's health checks (a bare `ray start --head`: Ray's), as notes (exit 0)."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest
from hosts import Hosts, made_hosts, skip_reason

pytestmark = [
    pytest.mark.ray,  # a Ray node on each of two hosts of its own (not the session's Ray)
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]

CLI = "import sys; from raytrain.cli import main; sys.exit(main())"


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Two hosts (ens5 on the first, eth1 on the second; the hostname resolves to 127.0.1.1 on
    both; GLOO_SOCKET_IFNAME set nowhere), one CPU each: a run of two one-CPU workers has one on
    each host, so its process group spans both."""
    started = time.monotonic()
    with made_hosts(tmp_path_factory.mktemp("hosts"), 2) as hosts:
        hosts.start_ray(num_cpus=1)
        print(f"hosts and their Ray nodes up after {time.monotonic() - started:.1f} s")
        yield hosts


def train_on_first_host(hosts: Hosts, storage, name: str, **env: str):
    args = ["train", "digits", "--workers", "2", "--epochs", "1", "--address", hosts.head_address]
    args += ["--storage", str(storage), "--name", name]
    started = time.monotonic()
    done = hosts[0].run([sys.executable, "-c", CLI, *args], timeout=240, cwd=storage, env={**hosts.env, **env})
    print(f"{name}: exit {done.returncode} after {time.monotonic() - started:.1f} s")
    return done


def test_two_hosts_with_differently_named_interfaces_train_with_nothing_set_by_hand(two_hosts, tmp_path):
    done = train_on_first_host(two_hosts, tmp_path, "two-hosts")
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # A bare `ray start --head`: Ray's health checks, said once after the plan line.
    assert done.stdout.count("raytrain: note: the Ray head declares a silent node (cut off or frozen) dead 62–65") == 1
    summary = json.loads((tmp_path / "two-hosts" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["world_sizes"] == [2], summary


def test_an_interface_variable_that_cannot_work_is_one_message_naming_the_host_the_address_and_the_fix(
    two_hosts, tmp_path
):
    # Exported where raytrain runs, it reaches every worker: each hands its peers 127.0.0.1.
    done = train_on_first_host(two_hosts, tmp_path, "loopback", GLOO_SOCKET_IFNAME="lo")
    assert done.returncode == 2, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    message = done.stderr.strip()
    assert message.startswith("raytrain train: The workers' process group could not connect across 2 hosts: ")
    assert "a worker on host " in message and "tried 127.0.0.1, a loopback address" in message
    assert f"({two_hosts[0].address}) lo, set by the user, but {two_hosts[0].address} is on ens5" in message
    assert f"({two_hosts[1].address}) lo, set by the user, but {two_hosts[1].address} is on eth1" in message
    assert "Fix: unset GLOO_SOCKET_IFNAME" in message
    assert "Traceback" not in done.stderr and "ControllerError" not in done.stderr
    assert len(message.splitlines()) == 1


def test_doctor_names_each_hostname_on_loopback_and_the_differing_interfaces_as_notes(two_hosts, tmp_path):
    args = ["doctor", "--address", two_hosts.head_address, "--storage", str(tmp_path)]
    started = time.monotonic()
    done = two_hosts[0].run([sys.executable, "-c", CLI, *args], timeout=240, cwd=tmp_path)
    print(f"doctor: exit {done.returncode} after {time.monotonic() - started:.1f} s\n{done.stdout}{done.stderr}")
    out = done.stdout + done.stderr
    # Notes, not failures: raytrain binds each host's own interface, so a run works (exit 0).
    assert done.returncode == 0, out
    assert "OK: a run will work here." in out and "Traceback" not in out
    name = socket.gethostname()
    for host in two_hosts.hosts:
        assert f"note: node {host.address} ({name}): its hostname {name} resolves to 127.0.1.1, a loopback" in out
        assert f'map the hostname to the node address ("{host.address} {name}" in place of "127.0.1.1 {name}")' in out
        assert f"raytrain binds its workers to {host.interface}, which holds {host.address}" in out
    first, second = two_hosts.hosts
    assert (
        "note: the node addresses are on interfaces named differently: "
        f"{first.interface} on {first.address} ({name}); {second.interface} on {second.address} ({name})"
    ) in out
    assert "Between nodes: each of the 2 nodes reached every other's address on a free port" in out
    assert (
        "note: the Ray head declares a silent node (cut off or frozen) dead 62–65 s after it goes silent (Ray's" in out
    )


def test_joins_from_another_host_and_after_another_driver_and_a_refused_token_is_named(two_hosts, tmp_path):
    """Issue 47's `InvalidAuthToken`: a driver whose token differs from the head's is refused,
    and Ray retries for 20 s, logging InvalidAuthToken once a second, before it gives up with
    "Failed to connect". Drivers on the other host with the head's token join, one after the
    other; one with another token is told which token it sent and how to fix it."""
    args = ["doctor", "--address", two_hosts.head_address, "--storage", str(tmp_path)]
    for _ in range(2):  # a join from the second host, then another one after it
        done = two_hosts[1].run([sys.executable, "-c", CLI, *args], timeout=240, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    other = tmp_path / "other_token"
    other.write_text("0" * 64)
    env = {**two_hosts.env, "RAY_AUTH_TOKEN_PATH": str(other)}
    done = two_hosts[1].run([sys.executable, "-c", CLI, *args], timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"FAIL cannot reach Ray at {two_hosts.head_address}" in done.stdout
    assert "most likely it refused this process's token (Ray logs InvalidAuthToken)" in done.stdout
    assert f"this process sends the token in {other} (last changed " in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
