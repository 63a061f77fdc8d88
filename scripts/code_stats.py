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
import io
import subprocess
import sys
import tokenize
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


# Issue 46's measures: the worker's kinds (fault-tolerance mode, sharded or not, storage kind)
# each in one place, and no class in worker/ that holds too much.
PER_STEP_MODULES = ("worker.replicas", "worker.groups")  # the per-step implementation's own modules
MODE_NAMES = {"per_step", "via_ray", "ReplicaRuntime", "group_store", "fault_tolerance"}
STORAGE_KIND_NAMES = {"remote", "local_path", "local_dir", "renames", "LocalFileSystem", "is_local", "is_remote"}
MAX_FIELDS, MAX_METHODS = 12, 15


def name_lines(texts: dict[str, str], names: set[str], skip: tuple[str, ...] = ()) -> list[str]:
    """`module:line` of every line of worker/'s code (comments and strings left out) that holds
    one of `names` as a name."""
    found = []
    for m, text in texts.items():
        if not m.startswith("worker.") or m in skip:
            continue
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        rows = sorted({t.start[0] for t in tokens if t.type == tokenize.NAME and t.string in names})
        found += [f"{m}:{row}" for row in rows]
    return found


def storage_kind_branches(trees: dict[str, ast.Module], module: str = "rundir.checkpoints") -> int:
    """Branches (if, ternary, while) of `module` on the storage kind: whose test names a storage
    kind's mark (`remote(...)`, `.local_path()`, `.renames`, ...), or a name its function bound
    from one (`store = remote(directory)` ... `if store is not None`)."""
    tree = trees.get(module)
    if tree is None:
        return 0

    def names(node: ast.AST) -> set[str]:
        found = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        return found | {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}

    count = 0
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        marks = set(STORAGE_KIND_NAMES)
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and names(node.value) & STORAGE_KIND_NAMES:
                marks |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        inner = {id(n) for s in scopes if s is not scope for n in ast.walk(s) if s in ast.walk(scope)}
        for node in ast.walk(scope):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and id(node) not in inner:
                count += bool(names(node.test) & marks)
    return count


def class_sizes(trees: dict[str, ast.Module]) -> list[tuple[str, int, int]]:
    """(module.Class, fields, methods) of every class in worker/. Fields: the names assigned as
    `self.x` in its methods, and its class-level names (annotated, ClassVar left out, or
    assigned); methods: the functions of its body. Per class definition: inherited members
    are not counted."""
    sizes = []
    for m, tree in trees.items():
        if not m.startswith("worker."):
            continue
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            fields: set[str] = set()
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if "ClassVar" not in ast.unparse(item.annotation):
                        fields.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    for target in item.targets:
                        fields |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            for method in methods:
                for sub in ast.walk(method):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                        sub, (ast.AnnAssign, ast.AugAssign)) else []  # fmt: skip
                    for target in targets:
                        for n in ast.walk(target):
                            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                                fields.add(n.attr)
            sizes.append((f"{m}.{node.name}", len(fields), len(methods)))
    return sizes


def kinds(texts: dict[str, str], trees: dict[str, ast.Module]) -> tuple[list[str], int, list[str], list]:
    """Issue 46's four measures: mode lines outside the per-step modules, storage-kind branches
    of rundir/checkpoints.py, lines naming `sharded` in worker/, and the classes over a limit."""
    over = [c for c in class_sizes(trees) if c[1] > MAX_FIELDS or c[2] > MAX_METHODS]
    return (
        name_lines(texts, MODE_NAMES, PER_STEP_MODULES),
        storage_kind_branches(trees),
        name_lines(texts, {"sharded"}),
        over,
    )


def _listed(items: list[str], limit: int = 10) -> str:
    return f" ({', '.join(items)})" if items and len(items) <= limit else ""


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
        *kinds_lines(kinds(texts, trees)),
    ]


def kinds_lines(measured: tuple, before: tuple | None = None) -> list[str]:
    """Issue 46's measures as lines (`before`: a revision's, side by side)."""
    mode, storage, sharded, over = measured
    was = (lambda i, f: f"{f(before[i])} before, ") if before is not None else (lambda i, f: "")
    return [
        f"Lines of worker/ naming the fault-tolerance mode outside {', '.join(PER_STEP_MODULES)}: "
        f"{was(0, len)}{len(mode)}{' after' if before is not None else ''}{_listed(mode)}",
        f"Storage-kind branches in rundir/checkpoints.py: {was(1, int)}{storage}"
        f"{' after' if before is not None else ''}",
        f"Lines of worker/ naming `sharded`: {was(2, len)}{len(sharded)}{' after' if before is not None else ''}"
        f"{_listed(sharded)}",
        f"Classes of worker/ over {MAX_FIELDS} fields or {MAX_METHODS} methods: {was(3, len)}{len(over)}"
        f"{' after' if before is not None else ''}"
        + "".join(f"\n- {name} ({fields} fields, {methods} methods)" for name, fields, methods in over),
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
        return lines, modules, largest, longest, cycles(graph), twice, biggest, core, kinds(texts, trees)

    (lb, mb, gb, fb, cb, db, bb, kb, sb), (la, ma, ga, fa, ca, da, ba, ka, sa) = summary(before), summary(after)
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
        *kinds_lines(sa, sb),
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
