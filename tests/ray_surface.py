"""The private Ray names a module's source uses, and the Ray code it copies (the lists are in
tests/test_style.py).

A use of a private Ray name is any of:

- an import of a private name, or of any name from a private module (`from ray._private import
  worker`, `from ray.x._internal import Y`);
- an attribute chain through something bound to Ray (`ray._raylet.X`; `alias._X` where
  `alias` names a Ray module or object), a class's base included (`class B(alias._Backend)`);
- a private member of a Ray class that a class of ours defines again (an override), or reads
  or sets on itself (`self._x`, `super()._x`): named by the Ray class that defines it, an
  instance attribute its methods set included;
- a private attribute of any other object (`worker_group._state`, `ds._plan`,
  `getattr(error, "_base")`): an object Ray gave us, unless the module defines that name
  itself. It is named by the Ray class that defines it (each of them, when several unrelated
  ones do), looked for among the classes of the Ray modules the module imports from and their
  bases, then in the Ray packages it imports from (`ray.train`, `ray.data`), then in all of
  Ray, unless a library the module imports, or raytrain, defines that name: then it is not
  Ray's (torch's `module._apply`). A name reached through another library's module is that
  library's (`os._exit`).

A copy of Ray code is marked by a comment `# A copy of ray.<module>.<name>` inside the function
that holds it (`copies`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path

COPY_MARK = re.compile(r"#\s*A copy of (ray\.[\w.]+)")
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def private_ray_names(source: str) -> set[str]:
    """Every private Ray name `source` uses (see the module's docstring)."""
    scan = _Scan(ast.parse(source))
    scan.visit(scan.tree)
    return scan.names


def copies(source: str) -> dict[str, str]:
    """`Class.function` (or `function`) -> the Ray name it copies, by the marks in `source`."""
    spans = [
        (node.lineno, node.end_lineno, qualname)
        for node, qualname in _functions(ast.parse(source))
        if node.end_lineno is not None
    ]
    found = {}
    for lineno, line in enumerate(source.splitlines(), start=1):
        mark = COPY_MARK.search(line)
        if mark:
            holders = [(end - start, name) for start, end, name in spans if start <= lineno <= end]
            if not holders:
                raise ValueError(f"line {lineno}: a copy mark outside a function")
            found[min(holders)[1]] = mark.group(1)
    return found


def source_digest(name: str) -> str:
    """A digest of the installed Ray source of `name` (a function, method or class)."""
    return hashlib.sha256(inspect.getsource(ray_object(name)).encode()).hexdigest()[:16]


def ray_object(name: str):
    """What the dotted `name` names: its longest importable module, then attributes."""
    value = _import(name)
    if value is None:
        raise LookupError(f"{name}: nothing of that name in the installed Ray")
    return value


def defines(cls: type, member: str) -> bool:
    """Whether `cls` itself defines `member`: in its namespace, its annotations, or as an
    instance attribute one of its methods sets (`self.member = ...`)."""
    return member in vars(cls) or member in vars(cls).get("__annotations__", {}) or member in _instance_attributes(cls)


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, prefix + node.name
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


class _Scan(ast.NodeVisitor):
    def __init__(self, tree: ast.AST) -> None:
        self.tree = tree
        self.names: set[str] = set()
        self.bound = _bound_by_imports(tree)  # local name -> the dotted path it was imported as
        self.ray_modules = {path for path in _imported_modules(tree) if _is_ray(path)}
        self.own = _defined_here(tree)
        self.libraries = {path.split(".")[0] for path in _imported_modules(tree) if not _is_ray(path)} | {"raytrain"}
        self.local_classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        self.method: tuple[str, list[type]] | None = None  # (`self`'s name, its class's Ray classes)

    # -- imports, classes, methods ---------------------------------------------------------

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if not _is_ray(module):
            return
        for alias in node.names:
            if any(private(part) for part in module.split(".")) or private(alias.name):
                self.names.add(f"{module}.{alias.name}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_ray(alias.name) and any(private(part) for part in alias.name.split(".")):
                self.names.add(alias.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        ray_classes = self._ray_classes(node, set())
        for member in _members(node):
            owner = _owner(ray_classes, member) if private(member) else None
            if owner is not None:
                self.names.add(f"{_qualname(owner)}.{member}")
        outer, self.method = self.method, None
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_self(child):
                self.method = (child.args.args[0].arg, ray_classes)
            self.visit(child)
            self.method = None
        for expr in [*node.bases, *node.keywords, *node.decorator_list]:
            self.visit(expr)
        self.method = outer

    # -- attributes -------------------------------------------------------------------------

    def visit_Attribute(self, node: ast.Attribute) -> None:
        root, attrs = _chain(node)
        self._use(root, attrs)
        self.visit(root)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ACCESSORS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                root, attrs = _chain(node.args[0])
                self._use(root, [*attrs, name.value])
        self.generic_visit(node)

    def _use(self, root: ast.AST, attrs: list[str]) -> None:
        if isinstance(root, ast.Name) and root.id in self.bound:
            path = self.bound[root.id]
            if _is_ray(path) and any(private(part) for part in attrs):
                self.names.add(".".join([path, *attrs]))
            return  # through a module or object imported here: Ray's, named by its path, or not Ray's
        on_self = self.method is not None and (
            (isinstance(root, ast.Name) and root.id == self.method[0]) or _is_super_call(root)
        )
        if on_self and attrs:
            first, attrs = attrs[0], attrs[1:]
            owner = _owner(self.method[1], first) if private(first) else None
            if owner is not None:
                self.names.add(f"{_qualname(owner)}.{first}")
        for attr in attrs:
            if private(attr) and attr not in self.own:
                self.names.update(f"{_qualname(cls)}.{attr}" for cls in self._ray_owners(attr))

    def _ray_owners(self, member: str) -> list[type]:
        """The Ray classes that define `member` (the roots of those, not their subclasses): among
        the classes of the Ray modules imported here, else of the Ray packages imported from,
        else of all of Ray, unless a library imported here, or raytrain, defines it."""
        found = [cls for cls in _classes_of(frozenset(self.ray_modules)) if defines(cls, member)]
        if not found:
            packages = frozenset(".".join(path.split(".")[:2]) for path in self.ray_modules if path != "ray")
            found = _package_classes_defining(packages, member)
        if not found and not any(_library_defines(library, member) for library in self.libraries):
            found = _package_classes_defining(frozenset({"ray"}), member)
        return [cls for cls in found if not any(other is not cls and other in cls.__mro__ for other in found)]

    def _ray_classes(self, node: ast.ClassDef, seen: set[str]) -> list[type]:
        """The Ray classes among the bases of `node` and theirs, nearest first."""
        seen = seen | {node.name}
        found: list[type] = []
        for base in node.bases:
            root, attrs = _chain(base)
            if not isinstance(root, ast.Name):
                continue
            if root.id in self.bound:
                value = _import(".".join([self.bound[root.id], *attrs]))
                classes = list(value.__mro__) if isinstance(value, type) else []
            elif not attrs and root.id in self.local_classes and root.id not in seen:
                classes = self._ray_classes(self.local_classes[root.id], seen)
            else:
                classes = []
            found += [cls for cls in classes if _is_ray(cls.__module__) and cls not in found]
        return found


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def _is_ray(path: str) -> bool:
    return path.split(".")[0] == "ray"


def _is_super_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _takes_self(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    return bool(node.args.args) and not static


def _members(node: ast.ClassDef) -> list[str]:
    """The names a class body defines."""
    names = []
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(child.name)
        elif isinstance(child, ast.Assign):
            names += [target.id for target in child.targets if isinstance(target, ast.Name)]
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            names.append(child.target.id)
    return names


def _owner(ray_classes: list[type], member: str) -> type | None:
    return next((cls for cls in ray_classes if defines(cls, member)), None)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _bound_by_imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> what `import a.b as c`, `import a` or `from a import b [as c]` binds it to
    (anywhere in the module)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _imported_modules(tree: ast.AST) -> set[str]:
    """The modules imported or imported from, and what `from` imports when it is a module."""
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def _defined_here(tree: ast.AST) -> set[str]:
    """The names a module defines itself: its functions, classes, variables, parameters, and the
    attributes its classes set on their instances (`self.x = ...`; one set on another object,
    `indexer._x = ...`, is that object's)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


@functools.lru_cache(maxsize=None)
def _import(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # not a module, or one that cannot be imported here
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr, None)
            if value is None:
                return None
        return value
    return None


@functools.lru_cache(maxsize=None)
def _classes_of(modules: frozenset[str]) -> list[type]:
    """The Ray classes of these modules (or the class a path names), and their Ray bases."""
    found: list[type] = []
    for path in sorted(modules):
        value = _import(path)
        values = vars(value).values() if inspect.ismodule(value) else [value]
        for cls in values:
            if isinstance(cls, type) and _is_ray(cls.__module__):
                found += [base for base in cls.__mro__ if _is_ray(base.__module__) and base not in found]
    return found


@functools.lru_cache(maxsize=None)
def _package_classes_defining(packages: frozenset[str], member: str) -> list[type]:
    """The classes of the Ray packages `packages` (`ray.train`, `ray.data`, `ray`; their tests
    left out) that define `member` (those of a module that cannot be imported here left out)."""
    root = Path(importlib.util.find_spec("ray").origin).parent
    found = []
    for package in sorted(packages):
        for path, text in _sources(root.joinpath(*package.split(".")[1:])):
            if "tests" in path.relative_to(root).parts or member not in text:
                continue
            module = ".".join(["ray", *path.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    cls = _import(f"{module}.{node.name}")
                    if isinstance(cls, type) and defines(cls, member) and cls not in found:
                        found.append(cls)
    return found


@functools.lru_cache(maxsize=None)
def _library_defines(library: str, member: str) -> bool:
    """Whether the installed source of `library` (a top-level module or package) defines
    `member`: a function, class, assignment or `self.member = ...` of that name."""
    spec = importlib.util.find_spec(library)
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return False
    where = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
    pattern = re.compile(rf"(def|class)\s+{member}\b|(self\.|^\s*){member}\s*(:[^=\n]*)?=[^=]", re.MULTILINE)
    return any(member in text and pattern.search(text) for _, text in _sources(where))


@functools.lru_cache(maxsize=None)
def _sources(where: Path) -> list[tuple[Path, str]]:
    """Every Python file under `where` (or `where` itself), with its text."""
    paths = sorted(where.rglob("*.py")) if where.is_dir() else [where] if where.suffix == ".py" else []
    return [(path, path.read_text(errors="replace")) for path in paths]


@functools.lru_cache(maxsize=None)
def _instance_attributes(cls: type) -> frozenset[str]:
    """`name` for every `self.name = ...` in the source of `cls` (none when it has no source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )
