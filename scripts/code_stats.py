"""Lines per module and per layer, the longest functions, import cycles, names defined twice, and
the worker core's shape (its lines, `.local` branches, the runner/position/files/data bundle, the
fault-tolerance mode and the storage kind named outside their owners, its largest classes) in `raytrain/`.

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

Issue 46's targets, from the tokens and the syntax tree (comments and strings never count;
from Python 3.12, which tokenizes inside f-strings, a name in an f-string's braces does):
- the lines of `raytrain/worker/*.py` outside the per-step modules (`PER_STEP_MODULES`) that name
  the fault-tolerance mode: a NAME token among `FAULT_TOLERANCE_NAMES` (`per_step`, `via_ray`,
  `ReplicaRuntime`, `group_store`, `fault_tolerance`), listed as module:line when 10 or fewer;
- the storage-kind branches of `rundir/checkpoints.py`: `if`, `while` and conditional
  expressions whose test holds a call or an attribute named in `STORAGE_KIND_NAMES` (`remote(d)`,
  `.local_dir`, `.renames`...), or a name its function bound from one (`store = remote(d)`);
  and (issue 55) the branches on a `Store`'s kind, tests holding one of `STORE_KIND_NAMES`
  (`.local`, `.renames`, `.local_path()`, `LocalFileSystem`...), inside `rundir/storage.py` and
  outside it, listed as module:line when 10 or fewer;
- the lines of `raytrain/worker/*.py` with the NAME token `sharded`;
- the classes of the core's packages (`CLASS_PACKAGES`: `raytrain/worker/*.py`, `faults/*.py`,
  `instruments/*.py`) over `FIELD_LIMIT` (12) fields or `METHOD_LIMIT` (15) methods, each class
  definition on its own (inherited members not counted). Its fields: the names it assigns as
  `self.X = ...`, `self.X: T = ...` or in a tuple of targets in its methods, its class-level
  annotations but `ClassVar`s, and its class-level assignments to names (`per_step = False`;
  dunders such as `__slots__` left out). Its methods: every function directly in its body
  (properties, dunders, static and class methods included).

Issue 55's count of Ray's private surface: the private Ray names each module uses, as
tests/test_style.py counts them (`tests/ray_surface.py`, which reads the installed Ray), summed
over the modules (a name used in two modules counts twice).

Exit status 1 when there is an import cycle.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
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


# -- issue 46: the worker's modes and storage kinds named outside their owners, its large classes

# The modules of the per-step implementation, where naming the mode is their business.
PER_STEP_MODULES = ("faults.per_step", "faults.groups")
FAULT_TOLERANCE_NAMES = frozenset({"per_step", "via_ray", "ReplicaRuntime", "group_store", "fault_tolerance"})
CHECKPOINTS_MODULE = "rundir.checkpoints"
STORAGE_KIND_NAMES = frozenset(
    {"remote", "local_path", "local_dir", "renames", "LocalFileSystem", "is_local", "is_remote"}
)
# What tells a Store's kind: a test on one is a branch on the kind (`Store.of`, which picks it, asks `is_uri`).
STORE_KIND_NAMES = frozenset({"local", "renames", "local_path", "LocalFileSystem"})
FIELD_LIMIT, METHOD_LIMIT = 12, 15
CLASS_PACKAGES = ("worker", "faults", "instruments")  # whose classes are held to the limits


def _worker_file(module: str, packages: tuple[str, ...] = ("worker",)) -> bool:
    """A module of `raytrain/worker/*.py` (the package's __init__ included), or of `packages`'."""
    package = module.split(".")[0]
    return package in packages and (module == package or module.count(".") == 1)


def name_lines(text: str, names: frozenset[str] | set[str]) -> list[int]:
    """The lines holding a NAME token among `names` (code only: not comments, not strings)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return sorted({t.start[0] for t in tokens if t.type == tokenize.NAME and t.string in names})


def worker_name_lines(texts: dict[str, str], names: frozenset[str] | set[str], skip=()) -> list[str]:
    """module:line of every line of raytrain/worker/*.py (but the modules in `skip`) naming one of `names`."""
    return [
        f"{m}:{line}"
        for m, t in sorted(texts.items())
        if _worker_file(m) and m not in skip
        for line in name_lines(t, names)
    ]


def mode_lines(texts: dict[str, str]) -> list[str]:
    return worker_name_lines(texts, FAULT_TOLERANCE_NAMES, skip=PER_STEP_MODULES)


def storage_branches(tree: ast.Module | None, names: frozenset[str] = STORAGE_KIND_NAMES) -> list[int]:
    """The lines of the if/while tests and conditional expressions that hold a call or an
    attribute named in `names`, or a name their function bound from one
    (`store = remote(d)` ... `if store is not None`)."""

    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in names
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names

    if tree is None:
        return []
    lines: set[int] = set()
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
    for scope in scopes:
        bound = {
            target.id
            for node in ast.walk(scope)
            if isinstance(node, ast.Assign) and any(named(inner) for inner in ast.walk(node.value))
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(scope):
            if isinstance(node, ast.If | ast.IfExp | ast.While):
                test = list(ast.walk(node.test))
                if any(named(inner) for inner in test) or any(isinstance(n, ast.Name) and n.id in bound for n in test):
                    lines.add(node.lineno)
    return sorted(lines)


def store_kind_branches(trees: dict[str, ast.Module]) -> tuple[list[str], list[str]]:
    """module:line of the branches on a Store's kind inside rundir/storage.py, and outside it."""
    found = [(m, line) for m, t in sorted(trees.items()) for line in storage_branches(t, STORE_KIND_NAMES)]
    inside = [f"{m}:{line}" for m, line in found if m == STORAGE_MODULE]
    return inside, [f"{m}:{line}" for m, line in found if m != STORAGE_MODULE]


def _targets(target: ast.AST):
    """The single targets of an assignment's target (a tuple or list of them unpacked)."""
    if isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _targets(element)
    elif isinstance(target, ast.Starred):
        yield from _targets(target.value)
    else:
        yield target


def _within(node: ast.AST):
    """Every node under `node`, but not inside a class defined there."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.ClassDef):
            yield child
            yield from _within(child)


def _class_var(annotation: ast.AST) -> bool:
    if isinstance(annotation, ast.Subscript):
        annotation = annotation.value
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.split("[")[0].rpartition(".")[2] == "ClassVar"
    return (isinstance(annotation, ast.Name) and annotation.id == "ClassVar") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "ClassVar"
    )


def class_fields(node: ast.ClassDef) -> set[str]:
    """The names of a class's fields (the module's docstring says which)."""
    fields: set[str] = set()
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            if not _class_var(statement.annotation):
                fields.add(statement.target.id)
        elif isinstance(statement, ast.Assign):
            named = (t.id for target in statement.targets for t in _targets(target) if isinstance(t, ast.Name))
            fields.update(n for n in named if not (n.startswith("__") and n.endswith("__")))
        elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in _within(statement):
                if not isinstance(inner, ast.Assign | ast.AnnAssign):
                    continue
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                fields.update(
                    t.attr
                    for target in targets
                    for t in _targets(target)
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                )
    return fields


def class_shapes(trees: dict[str, ast.Module]) -> list[tuple[str, int, int]]:
    """(module.Class, fields, methods) of every class of the CLASS_PACKAGES' modules, nested ones too."""
    shapes = []
    for m, t in sorted(trees.items()):
        if not _worker_file(m, CLASS_PACKAGES):
            continue
        for node in (n for n in ast.walk(t) if isinstance(n, ast.ClassDef)):
            methods = sum(isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) for s in node.body)
            shapes.append((f"{m}.{node.name}", len(class_fields(node)), methods))
    return shapes


def _shape(shape: tuple[str, int, int] | None) -> str:
    return f"{shape[0]} ({shape[1]} fields, {shape[2]} methods)" if shape else "none"


MODE_PACKAGE = "faults"  # the fault-tolerance modes' own package (issue 55)
MODE_VALUES = frozenset({"restart", "per-step"})
MODE_CLASSES = frozenset({"Recovery", "RestartMode", "PerStep", "PerStepMode", "ReplicaRuntime"})


def mode_tests(trees: dict[str, ast.Module]) -> list[str]:
    """module:line of every comparison with a mode's name or with a `fault_tolerance` value, and
    every isinstance/issubclass against a mode's class, outside the modes' own package."""
    found = set()
    for m, tree in trees.items():
        if m == MODE_PACKAGE or m.startswith(MODE_PACKAGE + "."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if (isinstance(side, ast.Constant) and side.value in MODE_VALUES) or (
                        getattr(side, "attr", getattr(side, "id", None)) == "fault_tolerance"
                    ):
                        found.add((m, node.lineno))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"isinstance", "issubclass"}:
                classes = node.args[1:2]
                classes = classes[0].elts if classes and isinstance(classes[0], ast.Tuple) else classes
                if any(getattr(c, "id", getattr(c, "attr", None)) in MODE_CLASSES for c in classes):
                    found.add((m, node.lineno))
    return [f"{m}:{line}" for m, line in sorted(found)]


def modes_and_classes(texts: dict[str, str], trees: dict[str, ast.Module]) -> dict:
    """Issue 46's figures of one tree."""
    shapes = class_shapes(trees)
    inside, outside = store_kind_branches(trees)
    return {
        "mode": mode_lines(texts),
        "mode_tests": mode_tests(trees),
        "storage": storage_branches(trees.get(CHECKPOINTS_MODULE)),
        "kind_inside": inside,
        "kind_outside": outside,
        "sharded": worker_name_lines(texts, {"sharded"}),
        "large": [s for s in shapes if s[1] > FIELD_LIMIT or s[2] > METHOD_LIMIT],
        "most_fields": max(shapes, key=lambda s: s[1], default=None),
        "most_methods": max(shapes, key=lambda s: s[2], default=None),
    }


def _listed(items: list[str], limit: int = 10) -> str:
    return f" ({', '.join(items)})" if items and len(items) <= limit else ""


def modes_lines(before: dict | None, after: dict) -> list[str]:
    """Issue 46's lines of the report, "B before, A after" with a `before`, else the figures alone."""

    def pair(b: str | None, a: str) -> str:
        return a if b is None else f"{b} before, {a} after"

    b = before or {}
    large = f"over {FIELD_LIMIT} fields or {METHOD_LIMIT} methods"
    return [
        f"Lines of raytrain/worker/ naming the fault-tolerance mode outside {', '.join(PER_STEP_MODULES)}: "
        + pair(before and str(len(b["mode"])), f"{len(after['mode'])}{_listed(after['mode'])}"),
        f"Lines of raytrain/ outside {MODE_PACKAGE}/ comparing the mode or testing its classes: "
        + pair(before and str(len(b["mode_tests"])), f"{len(after['mode_tests'])}{_listed(after['mode_tests'])}"),
        f"Storage-kind branches in {CHECKPOINTS_MODULE}: "
        + pair(before and str(len(b["storage"])), str(len(after["storage"]))),
        *(
            f"Branches on a Store's kind {where} {STORAGE_MODULE}: "
            + pair(before and str(len(b[key])), f"{len(after[key])}{_listed(after[key])}")
            for where, key in (("inside", "kind_inside"), ("outside", "kind_outside"))
        ),
        "Lines of raytrain/worker/ with `sharded`: "
        + pair(before and str(len(b["sharded"])), str(len(after["sharded"]))),
        f"Classes of raytrain/{'/, '.join(CLASS_PACKAGES)}/ {large}: "
        + pair(
            before and f"{len(b['large'])}{_listed([_shape(s) for s in b['large']])}",
            f"{len(after['large'])}{_listed([_shape(s) for s in after['large']])}",
        ),
        "Most fields: " + pair(before and _shape(b["most_fields"]), _shape(after["most_fields"])),
        "Most methods: " + pair(before and _shape(b["most_methods"]), _shape(after["most_methods"])),
    ]


def private_ray_names(texts: dict[str, str]) -> dict[str, set[str]] | None:
    """Module -> the private Ray names it uses (tests/ray_surface.py), for the modules that use
    any; None where there is no tests/ray_surface.py to count them with (a copy of the script)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "ray_surface.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("ray_surface", path)
    surface = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(surface)
    found = {module: surface.private_ray_names(text) for module, text in texts.items()}
    return {module: names for module, names in found.items() if names}


def private_count(found: dict[str, set[str]] | None) -> str:
    if found is None:
        return "not counted (no tests/ray_surface.py)"
    return f"{sum(len(names) for names in found.values())} in {len(found)} modules"


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
        *modes_lines(None, modes_and_classes(texts, trees)),
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
    lines += [f"Private Ray names: {private_count(private_ray_names(texts))}"]
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
        return lines, modules, largest, longest, cycles(graph), twice, biggest, core, modes_and_classes(texts, trees)

    (lb, mb, gb, fb, cb, db, bb, kb, xb), (la, ma, ga, fa, ca, da, ba, ka, xa) = summary(before), summary(after)
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
        f"Private Ray names: {private_count(private_ray_names(before))} before, "
        f"{private_count(private_ray_names(after))} after",
        *modes_lines(xb, xa),
    ]
    return "\n".join(out)


def count(text: str) -> int:
    """--longest: a positive number of functions."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; give a positive number of functions, e.g. 10")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision instead of the working tree")
    parser.add_argument("--compare", metavar="REV", help="a before (REV) / after (working tree) table")
    parser.add_argument("--longest", type=count, default=10, help="how many of the longest functions to list")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    try:
        if args.compare:
            print(compare(sources(args.compare, root), sources(None, root)))
            return 0
        text, n_cycles = report(sources(args.rev, root), args.longest)
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or "").strip().splitlines() or [str(exc)]
        flag = "--compare" if args.compare else "--rev"
        parser.error(
            f"{flag} {args.compare or args.rev}: git cannot read it in {root} ({said[0]}); it needs a git clone and a "
            "revision of its history: leave it out for the working tree"
        )
    print(text)
    return 1 if n_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
