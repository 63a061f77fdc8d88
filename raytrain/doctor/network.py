"""Whether every node reaches every other's node address on a free port, as gloo and NCCL
connect between hosts: one small actor pinned to each node listens on its node address on a
port the kernel picks, then each dials every other's. Bounded in time: an actor that is not
placed within `PLACE_TIMEOUT_S`, or a node whose dialling does not return, is left unchecked
(said as such), never waited for; the actors are killed after."""

from __future__ import annotations

from typing import Any

from raytrain.rules.network import Unreachable

PLACE_TIMEOUT_S = 8.0  # for every actor to start and say where it listens
CONNECT_TIMEOUT_S = 2.5  # one connection attempt; a node dials all of the others at once
DIAL_SLACK_S = 3.0  # beyond CONNECT_TIMEOUT_S, for the dialling's answers to come back


def _make_listener() -> type:
    """A self-contained actor class (pickled by value: it runs where raytrain does not import)."""

    class Listener:
        def __init__(self) -> None:
            import errno
            import socket

            import ray

            self.address = ray.util.get_node_ip_address()
            family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
            self.server = socket.socket(family, socket.SOCK_STREAM)
            try:
                self.server.bind((self.address, 0))
            except OSError as exc:  # a node address the host does not hold (NAT): every interface
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                self.server.bind(("", 0))
            self.server.listen(1024)  # the kernel completes each handshake; nothing need accept

        def endpoint(self) -> tuple[str, int]:
            return self.address, self.server.getsockname()[1]

        def dial(self, targets: list[tuple[str, int]], timeout_s: float) -> list[str | None]:
            """For each (address, port): None when a connection opened, else why not."""
            import socket
            from concurrent.futures import ThreadPoolExecutor

            def attempt(target: tuple[str, int]) -> str | None:
                try:
                    with socket.create_connection(target, timeout=timeout_s):
                        return None
                except TimeoutError:
                    return f"no answer within {timeout_s:g} s (packets dropped: a firewall, or no route)"
                except OSError as exc:
                    return exc.strerror or type(exc).__name__

            with ThreadPoolExecutor(max_workers=min(32, max(1, len(targets)))) as pool:
                return list(pool.map(attempt, targets))

    return Listener


def check_reachability(nodes: list[dict]) -> tuple[list[Unreachable], dict[str, str]]:
    """The pairs of nodes that could not connect on a free port, and the nodes left unchecked
    (node address -> why). Nothing to check on one node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if len(nodes) < 2:
        return [], {}
    listener = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(_make_listener())
    addresses = {node["NodeID"]: node.get("NodeManagerAddress", node["NodeID"]) for node in nodes}
    pinned = {node_id: NodeAffinitySchedulingStrategy(node_id=node_id, soft=False) for node_id in addresses}
    actors = {node_id: listener.options(scheduling_strategy=strategy).remote() for node_id, strategy in pinned.items()}
    try:
        endpoints, unchecked = _endpoints(actors)
        unreachable, silent = _dial(actors, endpoints, addresses)
        return unreachable, {addresses[node_id]: why for node_id, why in {**unchecked, **silent}.items()}
    finally:
        for actor in actors.values():
            ray.kill(actor)


def _endpoints(actors: dict[str, Any]) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:
    """Node id -> where its actor listens; and the nodes whose actor did not start, and why."""
    import ray

    refs = {node_id: actor.endpoint.remote() for node_id, actor in actors.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PLACE_TIMEOUT_S)
    endpoints, unchecked = {}, {}
    for node_id, ref in refs.items():
        if ref not in ready:
            unchecked[node_id] = f"its listener did not start within {PLACE_TIMEOUT_S:g} s"
            continue
        try:
            endpoints[node_id] = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the node's, said as unchecked
            unchecked[node_id] = f"its listener failed: {_last_line(exc)}"
    return endpoints, unchecked


def _dial(
    actors: dict[str, Any], endpoints: dict[str, tuple[str, int]], addresses: dict[str, str]
) -> tuple[list[Unreachable], dict[str, str]]:
    """Each listening node dials every other's endpoint, all at once."""
    import ray

    wait_s = CONNECT_TIMEOUT_S + DIAL_SLACK_S
    targets = {source: [node_id for node_id in endpoints if node_id != source] for source in endpoints}
    refs = {
        source: actors[source].dial.remote([endpoints[node_id] for node_id in dialled], CONNECT_TIMEOUT_S)
        for source, dialled in targets.items()
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
    unreachable, silent = [], {}
    for source, ref in refs.items():
        if ref not in ready:
            silent[source] = f"its connection attempts did not return within {wait_s:g} s"
            continue
        try:
            errors = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the node's, said as unchecked
            silent[source] = f"its connection attempts failed: {_last_line(exc)}"
            continue
        for target, error in zip(targets[source], errors):
            if error is not None:
                unreachable.append(Unreachable(addresses[source], addresses[target], endpoints[target][1], error))
    return unreachable, silent


def _last_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
