"""Which network interface a worker's gloo and NCCL bind to.

Left to itself, gloo takes the address the hostname resolves to, and NCCL the first interface
it likes. A hostname that resolves to loopback (Debian's and Ubuntu's default /etc/hosts,
127.0.1.1; many containers) makes a rank on one host hand its peers a loopback address, and
they dial themselves: `Gloo connectFullMesh failed ... remote=[127.0.1.1]`. Every worker binds
instead to the interface that holds its own Ray node address, the address the other nodes
already reach it at; interfaces may be named differently on every host (`ens5` here, `eth1`
there). A variable the user set, on the host or in the run's environment, is kept as it is.

An interface variable (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME) naming an
interface a host lacks fails on that host whatever the number of hosts: gloo when its group forms,
NCCL only at its first collective. `host_problems` says so, naming the host's interfaces and the
fix, before a run: on the driver for an embedded Ray (its workers are this host and inherit its
environment), and in each worker's backend start on a cluster.

`raytrain doctor` says what it finds of the network before a run (`network_findings`, from each
node's `NodeNetwork` and the pairs of nodes that could not connect): a hostname on loopback and
interface names that differ between hosts are notes (raytrain binds around them; torchrun and
other tools do not), a variable some host cannot use and a pair of nodes that cannot connect on
a free port are problems.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from raytrain.text import first_line

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
TP_SOCKET_IFNAME = "TP_SOCKET_IFNAME"  # tensorpipe's (torch RPC): one exact name
INTERFACE_VARIABLES = (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME)


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


def with_host(url: str, host: str) -> str:
    """`url` (`http://vm:29510`) with its host replaced by `host`, an address (an IPv6 one in
    brackets): `http://10.0.0.1:29510`."""
    scheme, sep, rest = url.rpartition("://")
    netloc, slash, path = rest.partition("/")
    port = netloc.rsplit(":", 1)[1] if ":" in netloc and not netloc.endswith("]") else ""
    bare = _normal(host)
    shown = f"[{bare}]" if ":" in bare else bare
    return f"{scheme}{sep}{shown}{':' + port if port else ''}{slash}{path}"


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(_normal(address)).is_loopback
    except ValueError:
        return address == "localhost"


def selected(variable: str, value: str, names: Iterable[str]) -> tuple[list[str], str | None]:
    """The interfaces `variable=value` selects among a host's `names` (those with an IP address),
    and what it names that the host lacks, worded to follow "no interface" (None: nothing).
    gloo makes a device for each name of its comma list, each of which must exist; tensorpipe
    looks its value up as one name; NCCL takes the interfaces its comma list's prefixes match
    (exact names after `=`), or after `^` those they do not match, and fails when none is left."""
    names = list(names)
    if variable == TP_SOCKET_IFNAME:
        return ([value], None) if value in names else ([], value)
    exclude = variable == NCCL_SOCKET_IFNAME and value.startswith("^")
    listed = value[1:] if exclude else value
    exact = variable != NCCL_SOCKET_IFNAME or listed.startswith("=")
    wanted = [part.strip() for part in listed.lstrip("=").split(",") if part.strip()]
    if variable == GLOO_SOCKET_IFNAME:
        return [w for w in wanted if w in names], ", ".join(w for w in wanted if w not in names) or None
    patterns = wanted if exact else [w + "*" for w in wanted]
    matched = [name for name in names if any(name == w if exact else name.startswith(w) for w in wanted)]
    taken = [name for name in names if name not in matched] if exclude else matched
    if taken:
        return taken, None
    if exclude:
        return [], f"other than {', '.join(patterns)}"
    return [], ", ".join(patterns) if exact else f"named {' or '.join(patterns)}"


def host_problems(env: Mapping[str, str], host: str, interfaces: Mapping[str, Sequence[str]]) -> list[str]:
    """For each interface variable set in `env` that names an interface this host lacks
    (`interfaces`: each interface with an IP address, in the kernel's order), one message naming
    the variable, the host, its interfaces and the fix."""
    problems = []
    for variable in INTERFACE_VARIABLES:
        value = env.get(variable)
        lacking = selected(variable, value, interfaces)[1] if value else None
        if lacking:
            problems.append(
                f"{variable}={value} cannot work on host {host}: it has no interface {lacking} (its interfaces: "
                f"{', '.join(interfaces) or 'none with an IP address'}). Fix: unset {variable} wherever it is set "
                "(where you run raytrain, the job's runtime_env, or before `ray start` on that host), and raytrain "
                "binds each worker to the interface that holds its node address; or set it to one of those."
            )
    return problems


# What gloo and NCCL say when a rank cannot reach another while the process group forms.
CONNECT_FAILURES = (
    "connectFullMesh",
    "Connection refused",
    "Connection reset",
    "Connection timed out",
    "No route to host",
    "Network is unreachable",
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
    problems: tuple[str, ...] = ()  # a variable naming an interface this host lacks (`host_problems`)


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
    deterministic = bool(dialled and is_loopback(dialled[0])) or misnamed
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


# -- what `raytrain doctor` says of the network between hosts ------------------------------


@dataclass(frozen=True)
class NodeNetwork:
    """One node's network, as `raytrain doctor`'s probe found it on that host."""

    hostname: str
    node_address: str  # its Ray node address: the one the other nodes reach it at
    interfaces: Mapping[str, Sequence[str]]  # each interface's IP addresses, in the kernel's order
    resolves_to: tuple[str, ...] = ()  # what its hostname resolves to, in the resolver's order
    variables: Mapping[str, str] = field(default_factory=dict)  # the interface variables its Ray node has

    @property
    def interface(self) -> str | None:
        return interface_holding(self.node_address, self.interfaces)

    @property
    def name(self) -> str:
        return f"{self.node_address} ({self.hostname})"


@dataclass(frozen=True)
class Unreachable:
    """A node that could not open a TCP connection to another's node address on a free port."""

    source: str  # node addresses
    target: str
    port: int
    error: str


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)  # a run across hosts will fail: what, and the fix
    notes: list[str] = field(default_factory=list)  # worth knowing: raytrain runs work, other tools may not


def network_findings(
    nodes: Sequence[NodeNetwork],
    driver_env: Mapping[str, str],
    unreachable: Sequence[Unreachable] = (),
    unchecked: Mapping[str, str] | None = None,
) -> Findings:
    """What `raytrain doctor` says of the network: an interface variable some host cannot use
    (on one node too), and between the nodes: hostnames on loopback, node addresses no interface
    holds, interface names that differ between hosts, and pairs of nodes that cannot connect on a
    free port (`unreachable`; `unchecked`: node address -> why it was not tried)."""
    found = Findings()
    for node in nodes if len(nodes) > 1 else ():
        gloo_set = GLOO_SOCKET_IFNAME in driver_env or GLOO_SOCKET_IFNAME in node.variables
        if node.interface is None and _on_loopback(node) and not gloo_set:
            found.problems.append(_loopback_and_unheld(node))
        elif node.interface is None:
            found.notes.append(_unheld(node))
        elif _on_loopback(node):
            found.notes.append(_loopback_hostname(node))
    names = differing_interfaces(nodes)
    if names:
        found.notes.append(names)
    found.problems += variable_problems(nodes, driver_env)
    hostnames = {node.node_address: node.hostname for node in nodes}
    found.problems += [_unreachable(pair, hostnames) for pair in unreachable]
    for address, why in sorted((unchecked or {}).items()):
        found.notes.append(f"node {address}: whether it reaches the other nodes on a free port is unchecked ({why})")
    return found


def _on_loopback(node: NodeNetwork) -> bool:
    """The hostname resolves first to a loopback address (the one gloo and torchrun take)."""
    return bool(node.resolves_to) and is_loopback(node.resolves_to[0]) and not is_loopback(node.node_address)


def _resolved(node: NodeNetwork) -> str:
    return ", ".join(dict.fromkeys(node.resolves_to))


def _hosts_line(node: NodeNetwork) -> str:
    loopback = next(address for address in node.resolves_to if is_loopback(address))
    return f'"{node.node_address} {node.hostname}" in place of "{loopback} {node.hostname}"'


def _loopback_hostname(node: NodeNetwork) -> str:
    return (
        f"node {node.name}: its hostname {node.hostname} resolves to {_resolved(node)}, a loopback address "
        "(Debian's and Ubuntu's default /etc/hosts; many containers). raytrain binds its workers to "
        f"{node.interface}, which holds {node.node_address}, so raytrain runs work; torchrun and other tools "
        "that take the hostname's address hand their peers loopback. Fix for them: in /etc/hosts on that host, "
        f"map the hostname to the node address ({_hosts_line(node)}), or set GLOO_SOCKET_IFNAME={node.interface} "
        f"and NCCL_SOCKET_IFNAME=={node.interface} where they run"
    )


def _loopback_and_unheld(node: NodeNetwork) -> str:
    return (
        f"node {node.name}: no interface holds its node address (NAT?), so raytrain sets no GLOO_SOCKET_IFNAME "
        f"there, and its hostname {node.hostname} resolves to {_resolved(node)}, a loopback address: gloo hands "
        "its peers loopback and a run on gloo (CPU workers, or per-step mode's groups) cannot connect across "
        f"hosts. Fix: in /etc/hosts on that host, map the hostname to an address the other nodes reach it at "
        f"({_hosts_line(node)}), or set GLOO_SOCKET_IFNAME before `ray start` there to the interface the other "
        "nodes reach it through"
    )


def _unheld(node: NodeNetwork) -> str:
    return (
        f"node {node.name}: no interface of that host holds its node address (a node behind NAT, or a "
        "--node-ip-address the host does not hold), so raytrain leaves gloo and NCCL to choose there (gloo takes "
        f"the address the hostname resolves to: {_resolved(node) or 'it does not resolve'}); if a run cannot "
        "connect across hosts, set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME before `ray start` there to the "
        "interface the other nodes reach it through"
    )


def differing_interfaces(nodes: Sequence[NodeNetwork]) -> str | None:
    """The note when the interfaces holding the node addresses are named differently."""
    by_name: dict[str, list[str]] = {}
    for node in nodes:
        if node.interface is not None:
            by_name.setdefault(node.interface, []).append(node.name)
    if len(by_name) < 2:
        return None
    where = "; ".join(f"{name} on {', '.join(names)}" for name, names in sorted(by_name.items()))
    return (
        f"the node addresses are on interfaces named differently: {where}. raytrain binds each host's workers to "
        "its own, so raytrain runs work; a GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME set to one name for every host "
        "(for torchrun, or exported where raytrain runs) fails on the others: leave them unset for raytrain, and "
        "for other tools set them on each host to its own interface"
    )


def _unusable(variable: str, value: str, node: NodeNetwork, hosts: int) -> str | None:
    """Why `variable=value` cannot work on `node` (None when it can, or cannot be told): it names
    an interface the host lacks (`selected`), or, across `hosts` > 1, only loopback."""
    names = [name for name, held in node.interfaces.items() if held]  # gloo and NCCL take no other
    taken, lacking = selected(variable, value, names)
    where = f"its node address is on {node.interface}" if node.interface else "no interface holds its node address"
    if lacking:
        return f"{node.name} has no interface {lacking} (its interfaces: {', '.join(names)}; {where})"
    loopback = all(held and all(is_loopback(address) for address in held) for held in map(node.interfaces.get, taken))
    if hosts > 1 and taken and loopback:
        return f"on {node.name} it names loopback ({where}): its ranks hand their peers a loopback address"
    return None


def variable_problems(nodes: Sequence[NodeNetwork], driver_env: Mapping[str, str]) -> list[str]:
    """An interface variable some node cannot use: set where doctor runs (a run started there
    passes it on to every worker, on every host, over what a node has), or in one node's
    environment (set before `ray start` there)."""
    problems = []
    for variable in INTERFACE_VARIABLES:
        value = driver_env.get(variable)
        if value:
            why = [reason for node in nodes if (reason := _unusable(variable, value, node, len(nodes)))]
            origin = "set where doctor runs (a run started here passes it on to every worker, on every host)"
            problems += [_variable_problem(variable, value, origin, why)] if why else []
            continue
        for node in nodes:
            value = node.variables.get(variable)
            reason = _unusable(variable, value, node, len(nodes)) if value else None
            if reason:
                origin = f"set on node {node.node_address} (in its Ray node's environment)"
                problems.append(_variable_problem(variable, value or "", origin, [reason]))
    return problems


def _variable_problem(variable: str, value: str, origin: str, why: list[str]) -> str:
    return (
        f"{variable}={value}, {origin}, cannot work: {'; '.join(why)}. A run's workers cannot form their process "
        f"group. Fix: unset {variable} (raytrain binds each worker to the interface that holds its node "
        "address, whatever its name on that host), or set it on each host, before `ray start` there, to that "
        "host's own interface (`ip -br addr`)"
    )


def _unreachable(pair: Unreachable, hostnames: Mapping[str, str]) -> str:
    def name(address: str) -> str:
        return f"{address} ({hostnames[address]})" if address in hostnames else address

    return (
        f"node {name(pair.source)} cannot reach node {name(pair.target)} on a free port ({pair.port}): "
        f"{pair.error}. gloo and NCCL connect between hosts on random ports, not only Ray's: allow all TCP between "
        "the cluster's nodes on their private network (a firewall rule for the subnet, or a security group that "
        "admits itself)"
    )
