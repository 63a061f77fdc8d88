"""Lines per module and per layer, the longest functions, import cycles, names defined twice, and
the worker core's shape (its lines, `.local` branches, the runner/position/files/data bundle) in `raytrain/`.

    python scripts/code_stats.py            # a Markdown report of the working tree
    python scripts/code_stats.py --rev REV  # the same for a git revision
    python scripts/code_stats.py --compare REV  # before (REV) and after (the working tree), side by side

Every import of a raytrain module counts, at the top of a file or inside a function: a cycle
deferred into a function is still two modules that cannot be understood one without the other.
The worker core's figures (issue 34's targets): the lines of `raytrain/worker/`; every `.local`
(a branch on the local vs object-store kind of a `Store`) outside `rundir/storage.py`, by module;
and every function that takes two or more of the bundle's parts as separate parameters: `runner`,
`position`, `files`, and the data (`data`, `train_data`, `val_data` or `source`); and, for two
options (`checkpoint_every_steps`, `precision`), every function that reads the field: the code
that acts on the option, one call from the config.

Exit status 1 when there is an import cycle.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = "raytrain"


def sources(rev: str | None, root: Path) -> dict[str, str]:
    """Module name -> source text, from the working tree or from `rev`."""
    if rev is None:
        return {_module(p.relative_to(root / PACKAGE)): p.read_text() for p in sorted((root / PACKAGE).rglob("*.py"))}
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, PACKAGE], cwd=root, check=True, capture_output=True, text=True
    ).stdout.split()
    return {
        _module(Path(n).relative_to(PACKAGE)): subprocess.run(
            ["git", "show", f"{rev}:{n}"], cwd=root, check=True, capture_output=True, text=True
        ).stdout
        for n in names
        if n.endswith(".py")
    }


def _module(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def imports_of(module: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The raytrain modules that `module` imports anywhere in its text."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level] if module != "__init__" else []
                base = ".".join([*package, base] if base else package)
            elif base == PACKAGE or base.startswith(PACKAGE + "."):
                base = base[len(PACKAGE) + 1 :]
            else:
                continue
            targets = [f"{base}.{a.name}" if base else a.name for a in node.names] + [base]
        else:
            continue
        for target in targets:
            name = target[len(PACKAGE) + 1 :] if target.startswith(PACKAGE + ".") else target
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method."""
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(tree, "")
    return out


def function_nodes(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(tree, "")
    return out


# The worker's bundle, by parameter name: each name stands for one part of it.
BUNDLE = {"runner": "runner", "position": "position", "files": "files"}
BUNDLE.update(dict.fromkeys(("data", "train_data", "val_data", "source"), "data"))
STORAGE_MODULE = "rundir.storage"


def worker_lines(texts: dict[str, str]) -> int:
    return sum(t.count("\n") for m, t in texts.items() if m == "worker" or m.startswith("worker."))


def local_branches(trees: dict[str, ast.Module]) -> dict[str, int]:
    """Module -> how many times it reads an attribute `.local`, outside `rundir/storage.py`."""
    counts = {
        m: sum(1 for n in ast.walk(t) if isinstance(n, ast.Attribute) and n.attr == "local")
        for m, t in trees.items()
        if m != STORAGE_MODULE
    }
    return {m: n for m, n in sorted(counts.items()) if n}


def bundle_functions(trees: dict[str, ast.Module]) -> list[tuple[str, list[str]]]:
    """(module.function, its bundle parameters) for every function taking two or more parts."""
    found = []
    for m, t in sorted(trees.items()):
        for name, node in function_nodes(t):
            a = node.args
            params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg in BUNDLE]
            if len({BUNDLE[p] for p in params}) >= 2:
                found.append((f"{m}.{name}", params))
    return found


# Options followed from the config field to the code that acts on it (issue 34).
TRACED_OPTIONS = ("checkpoint_every_steps", "precision")


def option_readers(trees: dict[str, ast.Module], option: str) -> list[str]:
    """module.function of every function that reads the attribute `option` itself (not in a
    function nested in it), outside the config package that defines and checks it."""
    found = []
    for m, t in sorted(trees.items()):
        if m.startswith("config"):
            continue
        for name, node in function_nodes(t):
            nested = {
                id(n)
                for c in ast.walk(node)
                if c is not node and isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef)
                for n in ast.walk(c)
            }
            if any(isinstance(n, ast.Attribute) and n.attr == option and id(n) not in nested for n in ast.walk(node)):
                found.append(f"{m}.{name}")
    return found


def worker_core(texts: dict[str, str], trees: dict[str, ast.Module]) -> list[str]:
    local, bundle = local_branches(trees), bundle_functions(trees)
    readers = {option: option_readers(trees, option) for option in TRACED_OPTIONS}
    return [
        "",
        f"Lines of raytrain/worker/: {worker_lines(texts):,}",
        f"`.local` outside rundir/storage.py: {sum(local.values())} in {len(local)} modules"
        + "".join(f"\n- {m}: {n}" for m, n in local.items()),
        "Functions taking two or more of the runner/position/files/data bundle: "
        f"{len(bundle)}" + "".join(f"\n- {f}({', '.join(p)})" for f, p in bundle),
        *(
            f"Functions reading `{option}`: {len(found)}" + "".join(f"\n- {f}" for f in found)
            for option, found in readers.items()
        ),
    ]


def report(texts: dict[str, str], longest: int) -> tuple[str, int]:
    trees = {m: ast.parse(t) for m, t in texts.items()}
    known = set(trees)
    graph = {m: imports_of(m, t, known) for m, t in trees.items()}
    found = cycles(graph)
    total = sum(t.count("\n") for t in texts.values())
    lines = ["| module | lines | share |", "|---|---:|---:|"]
    for m in sorted(texts, key=lambda m: -texts[m].count("\n")):
        n = texts[m].count("\n")
        lines.append(f"| {m} | {n:,} | {100 * n / total:.0f} % |")
    lines.append(f"| **total** | **{total:,}** | |")
    funcs = sorted(((f"{m}.{name}", n) for m, t in trees.items() for name, n in functions(t)), key=lambda x: -x[1])
    lines += ["", f"Longest functions (top {longest}):", "", "| function | lines |", "|---|---:|"]
    lines += [f"| {name} | {n} |" for name, n in funcs[:longest]]
    top_level: dict[str, list[str]] = defaultdict(list)
    for m, t in trees.items():
        for node in t.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("__"):
                top_level[node.name.lstrip("_")].append(m)
    twice = {name: ms for name, ms in top_level.items() if len(ms) > 1}
    lines += ["", f"Import cycles: {len(found)}" + "".join(f"\n- {' ↔ '.join(c)}" for c in found)]
    lines += [
        f"Top-level names defined in more than one module: {len(twice)}"
        + "".join(f"\n- {n}: {', '.join(sorted(ms))}" for n, ms in sorted(twice.items()))
    ]
    lines += worker_core(texts, trees)
    return "\n".join(lines), len(found)


# The layers of the package (docs/architecture.md), with the flat modules of the older layout
# that each replaced, so that a comparison across the move reads layer by layer.
LAYERS = {
    "foundation": ("__init__", "config", "fields", "errors", "pipeline", "hooks", "sampled", "text"),
    "rules": ("rules", "plan", "order", "attempt", "position", "resume", "costmodel"),
    "data": ("data", "shards"),
    "parallel": ("parallel",),
    "worker": ("worker", "loop", "runtime", "replicas", "heartbeat", "phases", "optim"),
    "driver": ("driver", "trainer", "failfast", "interrupts"),
    "rundir": ("rundir", "checkpoint"),
    "observe": ("observe", "sinks", "progress", "tracking", "report", "render"),
    "commands": ("cli", "bench", "predict", "tune", "doctor", "check", "baselines"),
}


def layer(module: str) -> str:
    top = module.split(".")[0]
    return next((name for name, tops in LAYERS.items() if top in tops), top)


def compare(before: dict[str, str], after: dict[str, str]) -> str:
    """Lines per layer, each layer's largest module and longest function, the largest module,
    cycles and names defined twice: before and after."""

    def summary(texts: dict[str, str]):
        trees = {m: ast.parse(t) for m, t in texts.items()}
        lines: dict[str, int] = defaultdict(int)
        modules: dict[str, int] = defaultdict(int)
        largest: dict[str, tuple[str, int]] = {}
        longest: dict[str, tuple[str, int]] = {}
        for m, t in texts.items():
            n, group = t.count("\n"), layer(m)
            lines[group] += n
            modules[group] += 1
            if n > largest.get(group, ("", 0))[1]:
                largest[group] = (m, n)
            for name, size in functions(trees[m]):
                if size > longest.get(group, ("", 0))[1]:
                    longest[group] = (f"{m}.{name}", size)
        graph = {m: imports_of(m, t, set(trees)) for m, t in trees.items()}
        top_level: dict[str, set[str]] = defaultdict(set)
        for m, t in trees.items():
            for node in t.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("__"):
                    top_level[node.name.lstrip("_")].add(m)
        biggest = max(((m, t.count("\n")) for m, t in texts.items()), key=lambda x: x[1])
        twice = sorted(n for n, ms in top_level.items() if len(ms) > 1)
        local = local_branches(trees)
        core = (worker_lines(texts), sum(local.values()), len(local), len(bundle_functions(trees)))
        return lines, modules, largest, longest, cycles(graph), twice, biggest, core

    (lb, mb, gb, fb, cb, db, bb, kb), (la, ma, ga, fa, ca, da, ba, ka) = summary(before), summary(after)
    out = [
        "| layer | lines before | after | modules before | after | largest module before | after "
        "| longest function before | after |",
        "|---|---:|---:|---:|---:|---|---|---|---|",
    ]
    for group in [*LAYERS, *sorted((set(lb) | set(la)) - set(LAYERS))]:
        gb_, ga_ = gb.get(group, ("—", 0)), ga.get(group, ("—", 0))
        fb_, fa_ = fb.get(group, ("—", 0)), fa.get(group, ("—", 0))
        out.append(
            f"| {group} | {lb.get(group, 0):,} | {la.get(group, 0):,} | {mb.get(group, 0)} | {ma.get(group, 0)} "
            f"| {gb_[0]} ({gb_[1]}) | {ga_[0]} ({ga_[1]}) | {fb_[0]} ({fb_[1]}) | {fa_[0]} ({fa_[1]}) |"
        )
    total_b, total_a = sum(lb.values()), sum(la.values())
    out.append(f"| **total** | **{total_b:,}** | **{total_a:,}** | {sum(mb.values())} | {sum(ma.values())} | | | | |")
    out += [
        "",
        f"Largest module: {bb[0]} ({bb[1]} lines) before, {ba[0]} ({ba[1]} lines) after",
        f"Import cycles: {len(cb)} before ({'; '.join(' ↔ '.join(c) for c in cb) or 'none'}), {len(ca)} after "
        f"({'; '.join(' ↔ '.join(c) for c in ca) or 'none'})",
        f"Top-level names defined in more than one module: {len(db)} before ({', '.join(db) or 'none'}), {len(da)} "
        f"after ({', '.join(da) or 'none'})",
        f"Lines of raytrain/worker/: {kb[0]:,} before, {ka[0]:,} after",
        f"`.local` outside rundir/storage.py: {kb[1]} in {kb[2]} modules before, {ka[1]} in {ka[2]} modules after",
        f"Functions taking two or more of the runner/position/files/data bundle: {kb[3]} before, {ka[3]} after",
    ]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision instead of the working tree")
    parser.add_argument("--compare", metavar="REV", help="a before (REV) / after (working tree) table")
    parser.add_argument("--longest", type=int, default=10, help="how many of the longest functions to list")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    if args.compare:
        print(compare(sources(args.compare, root), sources(None, root)))
        return 0
    text, n_cycles = report(sources(args.rev, root), args.longest)
    print(text)
    return 1 if n_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
