"""Import cycles in a graph of modules (module -> the modules it imports), for the tests that
keep raytrain/ and benchmarks/ free of them."""

from __future__ import annotations


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle found by a depth-first walk, as `a -> b -> a`."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found
