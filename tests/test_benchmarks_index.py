"""benchmarks/ is a suite (pure tier: files read and parsed, nothing imported or run):
benchmarks/README.md indexes every script there, names none that is gone (but under
*Retired*, which names only scripts that are gone), and the scripts import one another
without a cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from cycles import cycles

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SCRIPT = re.compile(r"`((?:[\w-]+/)*[\w-]+\.(?:py|sh))`")
COMMAND = re.compile(r"(?:python3?|bash) benchmarks/((?:[\w-]+/)*[\w-]+\.(?:py|sh))")


def scripts(folder: Path) -> set[str]:
    """The scripts of a folder, by their names there (its subfolders' are not required)."""
    return {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh")}


def index(readme: str) -> tuple[set[str], set[str], set[str]]:
    """(the scripts the index's rows name, those its *Retired* rows name, those its commands run)."""
    current, retired, ran = set(), set(), set()
    section = current
    for line in readme.splitlines():
        if line.startswith("## "):
            section = retired if line[3:].strip().lower() == "retired" else current
        if line.startswith("|"):
            first = line.split("|")[1]
            section.update(SCRIPT.findall(first))
            ran.update(COMMAND.findall(line))
    return current, retired, ran


def index_problems(readme: str, folder: Path) -> list[str]:
    current, retired, ran = index(readme)
    problems = [f"{name}: not in benchmarks/README.md" for name in sorted(scripts(folder) - current)]
    problems += [
        f"{name}: in benchmarks/README.md, not in benchmarks/"
        for name in sorted(current | ran)
        if not (folder / name).is_file()
    ]
    problems += [
        f"{name}: retired in benchmarks/README.md, still in benchmarks/"
        for name in sorted(retired)
        if (folder / name).exists()
    ]
    return problems


def test_the_index_names_every_script_and_only_scripts_that_exist():
    assert index_problems((BENCH / "README.md").read_text(), BENCH) == []


def test_the_index_check_tells_a_missing_row_a_dangling_one_and_a_retired_script_still_there(tmp_path):
    for name in ("kept.py", "new.sh", "old.py"):
        (tmp_path / name).write_text("")
    readme = """| script | command |
|---|---|
| `kept.py` | `python benchmarks/kept.py` |
| `gone.py` | `python benchmarks/other.py --x` |

## Retired

| `old.py` | |
"""
    assert index_problems(readme, tmp_path) == [
        "new.sh: not in benchmarks/README.md",
        "old.py: not in benchmarks/README.md",
        "gone.py: in benchmarks/README.md, not in benchmarks/",
        "other.py: in benchmarks/README.md, not in benchmarks/",
        "old.py: retired in benchmarks/README.md, still in benchmarks/",
    ]


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module name -> the modules of the same folder it imports, anywhere in the file: as
    `benchmarks.x` or, the folder on sys.path as the scripts put it, as `x`."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                if node.module == "benchmarks":
                    found.update(alias.name for alias in node.names)
        found = {m.removeprefix("benchmarks.").split(".")[0] for m in found}
        graph[name] = (found & set(sources)) - {name}
    return graph


def test_the_benchmarks_import_one_another_without_a_cycle():
    sources = {p.stem: p.read_text() for p in BENCH.glob("*.py")}
    assert cycles(import_graph(sources)) == []


def test_the_cycle_check_sees_each_way_a_script_imports_another():
    sources = {
        "a": "def f():\n    from benchmarks import b\n",
        "b": "from benchmarks.c import x\n",
        "c": "import a\n",
        "d": "import benchmarks.a\nimport json\n",
    }
    assert import_graph(sources) == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(import_graph(sources)) == ["a -> b -> c -> a"]
