"""docs/architecture.md says what is true (pure tier: the source is parsed, nothing imported).

- Its layer rule holds on the imports of every module of raytrain/: every import counts, at the
  top of a file, inside a function and under `if TYPE_CHECKING:`; and there are no import cycles.
- Every module of raytrain/ is named in the row of its layer in the doc's table.
- A reference in a docstring, a field's text (what `--help` shows), a comment, README.md or
  docs/*.md (outside their code examples) points at something that exists:
  - a full name, `raytrain.rules.resume.changes`, anywhere in the text;
  - a short one in backticks, `resume.changes` or `cli.commands.cmd_train`: its first parts are
    the end of a module's dotted path (`resume` is `raytrain.rules.resume`); where they fit
    several modules (`replicas`), it is fine when it resolves in one; and through a module or a
    package it may name a method of one of its classes (`runtime.prepare_model`, `data.batch`);
  - `Class.member`, for a class name defined once in raytrain (members of a base outside
    raytrain are not followed);
  - `x.name` where no module is `x` but a raytrain function or class is `name`: a module
    renamed under the text (`plan.epoch_order`);
  - a file of the repository, `docs/architecture.md`, or a document by its name, `DESIGN.md`.
  A dotted name ending in a file suffix (`config.yaml`) or in quotes (an MLflow tag
  "raytrain.run_dir") is not a reference.

Every failure says the file, the line and what is wrong.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from cycles import cycles

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "raytrain"
DOC = REPO / "docs" / "architecture.md"
# The last part of a file name a text mentions (`config.yaml`, `summary.json`): not a reference.
FILE_SUFFIXES = {"yaml", "yml", "json", "jsonl", "pt", "md", "py", "parquet", "csv", "txt", "toml", "log", "sh", "lock"}
FILE_SUFFIXES |= {"png", "svg", "html", "distcp"}


@dataclass
class Module:
    name: str  # raytrain.rules.batch; raytrain for the package's own __init__
    path: Path
    tree: ast.Module
    defined: dict[str, ast.AST] = field(default_factory=dict)  # top-level name -> its node
    aliases: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # imported name -> (module, name)

    @property
    def where(self) -> str:
        return self.path.relative_to(REPO).as_posix()


@cache
def modules() -> dict[str, Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = Module(name, path, ast.parse(path.read_text()))
    for module in found.values():
        for node in module.tree.body:
            for bound in _bound(node):
                module.defined[bound] = node
        _imports(module, found)
    return found


def _bound(node: ast.AST) -> list[str]:
    """The names a top-level statement binds (under `if`/`try` too)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, (ast.If, ast.Try, ast.With)):
        inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
        inner += [s for h in getattr(node, "handlers", []) for s in h.body]
        return [name for s in inner for name in _bound(s)]
    return []


def _imports(module: Module, known: dict[str, Module]) -> list[tuple[str, int]]:
    """(raytrain module imported, line) for every import in the module's text; records what
    each imported name stands for in `module.aliases`."""
    found = []
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "raytrain":
                    target = _known_prefix(alias.name, known)
                    found.append((target, node.lineno))
                    if alias.asname:
                        module.aliases[alias.asname] = (target, None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "raytrain":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    found.append((submodule, node.lineno))
                    module.aliases[alias.asname or alias.name] = (submodule, None)
                else:
                    target = _known_prefix(base, known)
                    found.append((target, node.lineno))
                    module.aliases[alias.asname or alias.name] = (target, alias.name)
    return sorted({(target, line) for target, line in found if target != module.name}, key=lambda x: x[1])


def _known_prefix(dotted: str, known: dict[str, Module]) -> str:
    while dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted


# -- the table --------------------------------------------------------------------------------


@dataclass
class Row:
    layer: str
    line: int
    folders: list[str]  # `rules/`, `fields.py`, `rundir/records.py`, `__init__.py`
    names: list[str]  # every backticked text in the row


@cache
def table() -> list[Row]:
    rows, inside = [], False
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        if line.startswith("| layer | folder |"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append(Row(cells[0], number, re.findall(r"`([^`]+)`", cells[1]), re.findall(r"`([^`]+)`", line)))
    return rows


def layers() -> list[str]:
    return list(dict.fromkeys(row.layer for row in table()))


def _relative(module: Module) -> str:
    return module.path.relative_to(PACKAGE).as_posix()


def row_of(module: Module) -> tuple[Row | None, str]:
    """The module's row, and the text a row must name it by ('' when its folder cell does)."""
    relative = _relative(module)
    for row in table():  # a file named in a folder cell is more specific than its folder
        if relative in row.folders:
            return row, ""
    for row in table():
        for folder in row.folders:
            if folder.endswith("/") and relative.startswith(folder):
                inner = relative[len(folder) :].removesuffix(".py")
                return row, "" if inner == "__init__" else inner
    return None, relative


def _names(row: Row, inner: str, folder: str) -> bool:
    dotted, spellings = inner.replace("/", "."), set()
    for text in row.names:
        text = text.removesuffix(".py").replace("/", ".").split("(")[0]
        spellings |= {text, *(text[: i.start()] for i in re.finditer(r"\.", text))}
    return dotted in spellings or f"{folder.rstrip('/').replace('/', '.')}.{dotted}" in spellings


def layer_of(module: Module) -> str | None:
    row, _ = row_of(module)
    return row.layer if row else None


# -- the tests --------------------------------------------------------------------------------


def test_every_module_is_named_in_the_row_of_its_layer():
    problems = [
        f"docs/architecture.md:{row.line}: `{folder}`: no such folder or file in raytrain/"
        for row in table()
        for folder in row.folders
        if not (PACKAGE / folder).exists()
    ]
    for module in modules().values():
        row, inner = row_of(module)
        if row is None:
            problems.append(f"{module.where}: in no row of the table in docs/architecture.md (its folder or file)")
        elif inner and not any(_names(row, inner, f) for f in row.folders if f.endswith("/")):
            problems.append(
                f"{module.where}: not named in the {row.layer!r} row (docs/architecture.md:{row.line}); "
                f"name it there as `{inner}`"
            )
    assert not problems, "\n".join(problems)


def test_every_import_keeps_the_layer_rule():
    order, problems = layers(), []
    for module in modules().values():
        mine = layer_of(module)
        if mine is None:
            continue  # reported by the test above
        for target, line in _imports(module, modules()):
            theirs = layer_of(modules()[target])
            if theirs is not None and order.index(theirs) > order.index(mine):
                allowed = ", ".join(order[: order.index(mine) + 1])
                problems.append(
                    f"{module.where}:{line}: imports {target} ({theirs} layer); the {mine} layer imports only {allowed}"
                )
    assert not problems, "the layer rule of docs/architecture.md is broken:\n" + "\n".join(problems)


def test_no_import_cycles():
    graph = {name: {t for t, _ in _imports(m, modules())} for name, m in modules().items()}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(found)


# -- references ---------------------------------------------------------------------------------


def texts(module: Module) -> list[tuple[int, str]]:
    """(line, text) of every docstring, field text and other string statement, and every comment."""
    found = [
        (node.lineno, node.value.value)
        for node in ast.walk(module.tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(module.path.read_text()).readline)
    found += [(token.start[0], token.string) for token in tokens if token.type == tokenize.COMMENT]
    return found


# A name in quotes is a value (an MLflow tag "raytrain.run_dir"), not a reference.
FULL = re.compile(r"(?<![\w./'\"-])raytrain(?:\.[A-Za-z_]\w*)+")
CHAIN = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
REPO_FILE = re.compile(
    r"(?<![\w./-])((?:[A-Z][A-Z_]*\.md)|(?:(?:docs|tests|scripts|benchmarks|examples)/[\w./-]+\.\w+))"
)


def references(text: str) -> list[tuple[int, str, bool]]:
    """(line within the text, dotted reference, whether it is a full one) in a text."""
    found = [(m.start(), m.group(0), True) for m in FULL.finditer(text)]
    for span in re.finditer(r"`([^`]+)`", text):
        chains = CHAIN.finditer(span.group(1))
        found += [
            (span.start(1) + m.start(), m.group(1), False) for m in chains if not m.group(1).startswith("raytrain.")
        ]
    found += [(m.start(), m.group(1), None) for m in REPO_FILE.finditer(text)]
    return [
        (text.count("\n", 0, at), ref, full)
        for at, ref, full in found
        if ref.split(".")[-1] not in FILE_SUFFIXES or full is None
    ]


def problems_in(where: str, line: int, text: str) -> list[str]:
    """What is wrong with each reference of a text that starts at `line` of `where`."""
    problems = []
    for offset, reference, full in references(text):
        if full is None:
            wrong = None if _in_repository(reference) else "no such file in the repository"
        else:
            wrong = resolve(reference, full)
        if wrong:
            problems.append(f"{where}:{line + offset}: `{reference}`: {wrong}")
    return problems


def resolve(reference: str, full: bool) -> str | None:
    """None when the reference names something that exists, or is not a raytrain name;
    else what is wrong with it."""
    parts, known = reference.split("."), modules()
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if full:
            candidates = [prefix] if prefix in known else []
        else:
            candidates = [n for n in known if n.endswith("." + prefix)]
        if candidates:
            rest = parts[cut:]
            if any(_has(known[c], rest, loose=not full) for c in candidates):
                return None
            where = " or ".join(candidates)
            return f"{'.'.join(rest)} is not defined in {where}"
    if full:
        return f"no module {reference}"
    owners = classes().get(parts[0], [])  # `Runtime.prepare_model`: a class of raytrain by its own name
    if owners:
        if len(owners) == 1 and not _class_has(owners[0][1], parts[1]):
            return f"{parts[1]} is not a member of {owners[0][0]}.{parts[0]}"
        return None
    # `plan.epoch_order`, where no module is `plan` but a raytrain function is `epoch_order`: a
    # module renamed under the text (a variable's attribute, `cfg.lr`, names no such function)
    homes = [m.name for m in known.values() if isinstance(m.defined.get(parts[-1]), DEFINITIONS)]
    if len(parts) == 2 and parts[0].islower() and homes and not _installed(parts[0]):
        return f"no module {parts[0]}; {parts[1]} is in {' and '.join(homes)}"
    return None


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _installed(name: str) -> bool:
    """Whether `name` is a package of its own (`torch.save` is torch's, not a renamed module of raytrain)."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


@cache
def classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Class name -> (module, class) for every top-level class of raytrain."""
    found: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for module in modules().values():
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((module.name, node))
    return found


def _class_has(node: ast.ClassDef, name: str) -> bool:
    """`name` is defined in the class or in a base; a base outside raytrain is not followed."""
    if name in _members(node):
        return True
    for base in node.bases:
        owners = classes().get(base.id, []) if isinstance(base, ast.Name) else []
        if len(owners) != 1 or _class_has(owners[0][1], name):
            return True
    return False


def _has(module: Module, names: list[str], loose: bool) -> bool:
    if not names:
        return True
    first, rest = names[0], names[1:]
    if f"{module.name}.{first}" in modules():
        return _has(modules()[f"{module.name}.{first}"], rest, loose)
    if first in module.aliases:
        target, name = module.aliases[first]
        return _has(modules()[target], [name, *rest] if name else rest, loose)
    node = module.defined.get(first)
    if node is None:  # a short one may name a method through its module or package: `data.batch`
        within = [m for m in modules().values() if m.name == module.name or m.name.startswith(module.name + ".")]
        return loose and any(first in _members(c) for m in within for c in m.tree.body if isinstance(c, ast.ClassDef))
    if isinstance(node, ast.ClassDef) and rest:
        return _class_has(node, rest[0])
    return True  # an attribute of a function's result or of a constant: not followed


def _members(node: ast.ClassDef) -> set[str]:
    names = {name for statement in node.body for name in _bound(statement)}
    for inner in ast.walk(node):  # attributes set on the instance
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self":
            if isinstance(inner.ctx, ast.Store):
                names.add(inner.attr)
    return names


def test_every_reference_in_a_docstring_help_or_comment_exists():
    problems = [p for m in modules().values() for line, text in texts(m) for p in problems_in(m.where, line, text)]
    assert not problems, "references to names or files that do not exist:\n" + "\n".join(problems)


def _in_repository(name: str) -> bool:
    """A path from the repository's root, or a document's own name (`RESULTS.md`) at the root or
    in a top-level folder."""
    if "/" in name:
        return (REPO / name).exists()
    folders = [REPO, *(p for p in REPO.iterdir() if p.is_dir() and not p.name.startswith("."))]
    return any((folder / name).exists() for folder in folders)


DOCS = [DOC, REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_reference_in_the_docs_exists():
    problems = []
    for path in dict.fromkeys(DOCS):
        text = path.read_text()
        if path == DOC:  # its code block, the path from `raytrain train` on, names modules unquoted
            text = re.sub(r"```\n(.*?)```", lambda m: "\n" + CHAIN.sub(r"`\1`", m.group(1)), text, flags=re.S)
        else:  # code blocks elsewhere are examples: `run.events()` is a variable's
            text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
        problems += problems_in(path.relative_to(REPO).as_posix(), 1, text)
    assert not problems, "references to names or files that do not exist:\n" + "\n".join(problems)


def test_the_reference_check_tells_a_dangling_name_from_a_real_one():
    dangling = {  # each once named in a docstring, a --help or a comment of raytrain
        ("raytrain.rules.stall.stall_after_s", True): "stall_after_s is not defined in raytrain.rules.stall",
        ("loop._restore_rank_rng", False): "_restore_rank_rng is not defined in raytrain.worker.loop",
        ("resume.resumed_values", False): "resumed_values is not defined in raytrain.rules.resume",
        ("costmodel.DEVICE_PEAK_TFLOPS", False): "DEVICE_PEAK_TFLOPS is not defined in raytrain.rules.costmodel",
        ("shuffle.epoch_order", False): "no module shuffle; epoch_order is in raytrain.rules.steps",
        ("Store.no_such_method", False): "no_such_method is not a member of raytrain.rundir.storage.Store",
    }
    assert {key: resolve(*key) for key in dangling} == dangling
    real = ["raytrain.rules.flops.DEVICE_PEAK_TFLOPS", "raytrain.rundir.Store.of", "raytrain.config.merge_layers"]
    short = ["flops.DEVICE_PEAK_TFLOPS", "storage.Store.of", "rundir.Store", "cli.run_command", "hooks.HOOKS", "cfg.lr"]
    assert [resolve(r, True) for r in real] + [resolve(r, False) for r in short] == [None] * 9
    assert [r for _, r, _ in references('`config.yaml`, tag "raytrain.run_dir", `cfg.lr` and DESIGN.md')] == [
        "cfg.lr",
        "DESIGN.md",
    ]
