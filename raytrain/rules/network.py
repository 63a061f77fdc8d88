"""Which network interface a worker's gloo and NCCL bind to.

Left to itself, gloo takes the address the hostname resolves to, and NCCL the first interface
it likes. A hostname that resolves to loopback (Debian's and Ubuntu's default /etc/hosts,
127.0.1.1; many containers) makes a rank on one host hand its peers a loopback address, and
they dial themselves: `Gloo connectFullMesh failed ... remote=[127.0.1.1]`. Every worker binds
instead to the interface that holds its own Ray node address, the address the other nodes
already reach it at; interfaces may be named differently on every host (`ens5` here, `eth1`
there). A variable the user set, on the host or in the run's environment, is kept as it is.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from raytrain.text import first_line

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
INTERFACE_VARIABLES = (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)


def _normal(address: str) -> str:
    """`address` in one spelling: an IPv6 address without its zone (`fe80::1%eth0`), compressed."""
    bare = address.split("%", 1)[0].strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare


def interface_holding(address: str, interfaces: Mapping[str, Iterable[str]]) -> str | None:
    """The interface that holds `address`, given each interface's addresses (the kernel's
    order, as `psutil.net_if_addrs()` lists them); the first if several do; None if none does
    (a node address behind NAT, or one the host does not hold)."""
    wanted = _normal(address)
    for name, addresses in interfaces.items():
        if any(_normal(held) == wanted for held in addresses):
            return name
    return None


def interface_env(address: str, interfaces: Mapping[str, Iterable[str]], env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set in a worker whose Ray node address is `address`: each of
    GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME the environment `env` does not already hold, set
    to the interface holding the address (NCCL's with `=`, an exact name: a bare `eth1` would
    also match `eth10`). Nothing when no interface holds it: gloo and NCCL then choose as
    they would without raytrain."""
    name = interface_holding(address, interfaces)
    if name is None:
        return {}
    values = {GLOO_SOCKET_IFNAME: name, NCCL_SOCKET_IFNAME: f"={name}"}
    return {variable: value for variable, value in values.items() if variable not in env}


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(_normal(address)).is_loopback
    except ValueError:
        return address == "localhost"


# What gloo and NCCL say when a rank cannot reach another while the process group forms.
CONNECT_FAILURES = (
    "connectFullMesh",
    "Connection refused",
    "Connection reset",
    "Connection timed out",
    "No route to host",
    "Network is unreachable",
    "Unable to find address for",
    "Socket Timeout",
    "socketStartConnect",
    "ncclRemoteError",
    "ncclSystemError",
)
# Where a message names the address dialled (gloo: `remote=[127.0.1.1]:4503`; others:
# `connect [10.0.0.2]:4567`, `connecting to 10.0.0.2:4567`), and the node of the task that
# failed, as Ray writes it: `(pid=2076, ip=10.77.0.1, ...)`.
_DIALLED = (
    re.compile(r"remote=\[([^\]\s]+)\]"),
    re.compile(r"connect(?:ing)?(?: to)? \[?([0-9A-Fa-f.:]+?)\]?:\d+\b"),
)
_FAILED_ON = re.compile(r"\bip=([0-9A-Fa-f.:]+?)[,)\s]")


def _addresses(error: str) -> list[str]:
    """The addresses `error` says were dialled, in order, each once."""
    found: list[str] = []
    for pattern in _DIALLED:
        for candidate in pattern.findall(error):
            try:
                address = str(ipaddress.ip_address(candidate))
            except ValueError:
                continue
            if address not in found:
                found.append(address)
    return found


@dataclass(frozen=True)
class WorkerNetwork:
    """What a worker's process group binds to, as the worker found it."""

    hostname: str
    node_address: str
    interface: str | None  # the interface holding node_address; None if none does
    chosen: dict[str, str]  # the interface variables as the worker has them, set by raytrain or the user
    set_here: tuple[str, ...] = ()  # those raytrain set


@dataclass(frozen=True)
class ConnectFailure:
    """A process group that could not connect across hosts, said in one message."""

    message: str
    # The interfaces are wrong (an address dialled on loopback, a variable naming an interface
    # that does not hold the host's node address, or none at all): every attempt fails alike.
    # Otherwise (a refused or timed-out connection to a node's own address: a firewall, or a
    # host cut off while the group formed) another attempt may connect.
    deterministic: bool


def connect_failure(error: str, workers: list[WorkerNetwork]) -> ConnectFailure | None:
    """A process group that could not connect across hosts: the host that failed, the address it
    tried, what each host binds to, and the fix. None when `error` is not a failure to connect,
    or the workers are all on one node (nothing across hosts to fix)."""
    nodes = {worker.node_address: worker for worker in workers}
    if len(nodes) < 2 or not any(marker in error for marker in CONNECT_FAILURES):
        return None
    variable = NCCL_SOCKET_IFNAME if "NCCL" in error or "nccl" in error else GLOO_SOCKET_IFNAME
    failed_on = _FAILED_ON.search(error)
    where = nodes.get(_normal(failed_on.group(1))) if failed_on else None
    host = f"on host {where.hostname} ({where.node_address})" if where else f"on one of the hosts {', '.join(nodes)}"
    dialled = _addresses(error)
    tried = f"tried {dialled[0]}" if dialled else "could not connect"
    if dialled and is_loopback(dialled[0]):
        tried += (
            ", a loopback address (a host handed its peers an address on its own loopback: its hostname resolves "
            f"to loopback, or {variable} names a loopback interface)"
        )
    bindings = "; ".join(f"{w.hostname} ({address}) {_binding(w, variable)}" for address, w in sorted(nodes.items()))
    misnamed = any(variable in w.chosen and w.chosen[variable].lstrip("=") != w.interface for w in nodes.values())
    deterministic = bool(dialled and is_loopback(dialled[0])) or misnamed or "Unable to find address for" in error
    message = (
        f"The workers' process group could not connect across {len(nodes)} hosts: a worker {host} {tried}. "
        f"{variable} per host: {bindings}. "
        f"Fix: unset {variable} wherever it is set (where you run raytrain, the job's runtime_env, or before "
        "`ray start` on a host), and raytrain binds each worker to the interface that holds its node address; or "
        "set it on each host to that interface (`ip -br addr` there; names may differ between hosts). If it still "
        "fails, check that every host reaches the others' node addresses on any TCP port (a firewall between them). "
        f"The error: {_first_line(error)}"
    )
    return ConnectFailure(message, deterministic)


def _binding(worker: WorkerNetwork, variable: str) -> str:
    value = worker.chosen.get(variable)
    if value is None:
        why = f"no interface holds {worker.node_address}" if worker.interface is None else "the hostname decides"
        return f"unset ({why})"
    origin = "set by raytrain" if variable in worker.set_here else "set by the user"
    named = value.lstrip("=")
    holds = (
        "" if named == worker.interface else f", but {worker.node_address} is on {worker.interface or 'no interface'}"
    )
    return f"{value}, {origin}{holds}"


def _first_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if any(marker in line for marker in CONNECT_FAILURES)]
    return (lines[0] if lines else first_line(error))[:300]
