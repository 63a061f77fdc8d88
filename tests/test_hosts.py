"""The test hosts of tests/hosts.py themselves: each its own address, interface name and /etc/hosts,
reaching the others over the bridge, and nothing left after them (no Ray: `ip` and a Python socket)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hosts import INTERFACE_NAMES, made_hosts, skip_reason

pytestmark = [
    pytest.mark.slow,  # starts processes (ip, python) in namespaces of its own
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]

LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 7000))
print("listening", flush=True)
connection, (peer, _) = server.accept()
print("from", peer, flush=True)
"""


def test_two_hosts_have_their_own_address_interface_and_loopback_hostname_and_reach_each_other(tmp_path):
    with made_hosts(tmp_path, 2) as hosts:
        names = []
        for host in hosts.hosts:
            addresses = host.run(["ip", "-br", "addr"], timeout=10).stdout
            assert host.address in addresses and host.interface in addresses, addresses
            resolved = host.run(["getent", "hosts", subprocess.getoutput("hostname")], timeout=10).stdout
            assert resolved.split()[0] == "127.0.1.1", resolved  # Debian's default /etc/hosts
            names.append(host.interface)
        assert names == list(INTERFACE_NAMES[:2]) and names[0] != names[1]

        server = hosts[1].popen([sys.executable, "-c", LISTEN, hosts[1].address], log=tmp_path / "server.log")
        try:
            connect = f"import socket, time; time.sleep(1); socket.create_connection(({hosts[1].address!r}, 7000), 10)"
            done = hosts[0].run([sys.executable, "-c", connect], timeout=30)
            assert done.returncode == 0, done.stderr
            server.wait(timeout=30)
        finally:
            server.kill()
        assert f"from {hosts[0].address}" in (tmp_path / "server.log").read_text()
        listed = [host.netns for host in hosts.hosts] + [hosts.switch]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(netns in left for netns in listed), left


def _link_up(host) -> bool:
    shown = subprocess.run(
        ["ip", "-n", host.netns, "-br", "link", "show", host.interface], capture_output=True, text=True
    )
    return shown.stdout.split()[1] == "UP"  # "eth1@if5  UP  ..." or "... DOWN ..."


def _state(pid: int, wanted: str | None = None) -> str:
    """The process's state (R, S, T: stopped, ...); with `wanted`, once it is that (a signal
    lands a moment after it is sent), or what it is after a second."""
    deadline = time.monotonic() + 1.0
    while True:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        if wanted is None or (state == "T") == (wanted == "T") or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


def test_the_faults_cut_heal_flap_freeze_thaw_slow_and_lose_a_host(tmp_path):
    """Each fault does to the host what it says, and undoes it (no Ray: a sleeping process)."""
    with made_hosts(tmp_path, 2) as hosts:
        host = hosts[1]
        assert _link_up(host)
        host.cut()
        assert not _link_up(host)
        host.heal()
        assert _link_up(host)
        with host.flap(period_s=1.0, down_s=0.5) as downs:
            seen = set()
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                seen.add(_link_up(host))
                time.sleep(0.05)
        assert seen == {True, False} and len(downs) >= 2, (seen, downs)
        assert _link_up(host)  # up again on leaving

        sleeper = host.popen([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "sleeper.log")
        deadline = time.monotonic() + 10
        pids = []
        while time.monotonic() < deadline and not pids:
            pids = [pid for pid in host.pids() if "time.sleep(60)" in open(f"/proc/{pid}/cmdline").read()]
            time.sleep(0.1)
        (pid,) = pids
        host.freeze()
        assert _state(pid, "T") == "T"
        host.thaw()
        assert _state(pid, "S") != "T"
        with host.slow(pid, duty=0.5, period_s=0.4):
            states = set()
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                states.add(_state(pid) == "T")
                time.sleep(0.03)
        assert states == {True, False}, states  # stopped part of each period, running the rest
        assert _state(pid, "S") != "T"  # continued on leaving
        host.lose()
        sleeper.wait(timeout=10)
        assert host.pids() == [] and not host.supervised
