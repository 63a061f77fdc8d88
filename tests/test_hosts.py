"""The test hosts of tests/hosts.py themselves: each its own address, interface name and /etc/hosts,
reaching the others over the bridge, and nothing left after them (no Ray: `ip` and a Python socket)."""

from __future__ import annotations

import subprocess
import sys

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
