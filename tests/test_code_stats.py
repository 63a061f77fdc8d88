"""scripts/code_stats.py's measures of issue 46 on small sources (pure tier: parsed, never
imported): the fault-tolerance mode and `sharded` named in code, storage-kind branches, and
the fields and methods of a class; and its arguments refused with exit 2 (a copy outside git
runs in a process of its own: slow)."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "code_stats", Path(__file__).resolve().parents[1] / "scripts" / "code_stats.py"
)
code_stats = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(code_stats)

WORKER = '''"""per_step in a docstring does not count."""
import x  # nor per_step in a comment

def f(cfg, runtime):
    label = "fault_tolerance"
    if runtime.per_step:
        return cfg.fault_tolerance, sharded
    return label
'''


def test_the_mode_is_counted_in_code_lines_of_the_worker_outside_the_per_step_modules():
    texts = {"worker.loop": WORKER, "faults.per_step": WORKER, "driver.run": WORKER}
    assert code_stats.mode_lines(texts) == ["worker.loop:6", "worker.loop:7"]
    assert code_stats.worker_name_lines(texts, {"sharded"}) == ["worker.loop:7"]  # faults/ is not the worker


def test_a_storage_kind_branch_is_a_test_holding_a_named_call_or_attribute_or_a_name_bound_from_one():
    source = """
if remote(directory) is not None:
    pass
copy = a if store.local_dir else b
while self.store.renames:
    break
store = remote(directory)
if store is not None:
    pass
if remote:
    pass
if other(directory):
    pass
"""
    assert code_stats.storage_branches(ast.parse(source)) == [2, 4, 5, 8]  # 8: `store`, bound from remote()
    assert code_stats.storage_branches(None) == []


def test_a_branch_on_a_stores_kind_is_counted_inside_the_storage_module_and_outside_it():
    storage = """
def of(text):
    return ObjectStore(text) if is_uri(text) else LocalStore(text)  # the pick: is_uri is no kind name

def read(self):
    return self.path if self.local else self.fs
"""
    runtime = """
def latest(latest):
    if not isinstance(latest.filesystem, pyarrow.fs.LocalFileSystem):
        return None
    local = target.local_path()
    if local is not None:
        return local
    if state.remote or store.local_dir:  # neither tells a Store's kind
        return None
"""
    trees = {"rundir.storage": ast.parse(storage), "worker.runtime": ast.parse(runtime)}
    assert code_stats.store_kind_branches(trees) == (["rundir.storage:6"], ["worker.runtime:3", "worker.runtime:6"])


def test_a_class_counts_its_own_fields_and_methods():
    source = """
class Shape:
    size: int
    limit: ClassVar[int] = 3
    other: "typing.ClassVar[int]" = 4
    per_step = False
    __slots__ = ()

    def __init__(self, a):
        self.a = a
        self.b: int = 0
        self.c, (self.d, *self.e) = 1, (2, 3, 4)
        self.a = 5
        local = 6
        self.b += 1

    @property
    def f(self):
        def inner():
            self.g = 7
        return inner

    @staticmethod
    def h():
        class Nested:
            def m(self):
                self.not_shape = 8

    async def run(self):
        pass
"""
    tree = ast.parse(source)
    shape = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    assert code_stats.class_fields(shape) == {"size", "per_step", "a", "b", "c", "d", "e", "g"}
    trees = {"worker.shape": tree, "driver.shape": tree, "faults.shape": tree, "instruments.a.shape": tree}
    assert code_stats.class_shapes(trees) == [
        ("faults.shape.Shape", 8, 4),
        ("faults.shape.Nested", 1, 1),
        ("worker.shape.Shape", 8, 4),
        ("worker.shape.Nested", 1, 1),
    ]  # the driver's are not held to the limits, nor a nested package's


def test_compare_prints_each_measure_before_and_after_with_the_classes_over_a_limit():
    wide = "class Wide:\n" + "".join(f"    f{i} = {i}\n" for i in range(13)) + "    def m(self):\n        pass\n"
    before = {"worker.loop": "x = 1\n", "rundir.checkpoints": "y = 2\n"}
    after = {"worker.loop": WORKER + wide, "rundir.checkpoints": "if remote(d):\n    pass\n"}
    lines = code_stats.compare(before, after).splitlines()
    assert lines[-9:] == [
        "Lines of raytrain/worker/ naming the fault-tolerance mode outside faults.per_step, faults.groups: "
        "0 before, 2 (worker.loop:6, worker.loop:7) after",
        "Lines of raytrain/ outside faults/ comparing the mode or testing its classes: 0 before, 0 after",
        "Storage-kind branches in rundir.checkpoints: 0 before, 1 after",
        "Branches on a Store's kind inside rundir.storage: 0 before, 0 after",
        "Branches on a Store's kind outside rundir.storage: 0 before, 0 after",
        "Lines of raytrain/worker/ with `sharded`: 0 before, 1 after",
        "Classes of raytrain/worker/, faults/, instruments/ over 12 fields or 15 methods: 0 before, "
        "1 (worker.loop.Wide (13 fields, 1 methods)) after",
        "Most fields: none before, worker.loop.Wide (13 fields, 1 methods) after",
        "Most methods: none before, worker.loop.Wide (13 fields, 1 methods) after",
    ]


def test_private_ray_names_are_counted_per_module_as_test_style_counts_them():
    texts = {
        "driver.a": "from ray.train.v2._internal.execution.controller import TrainController\n",
        "driver.b": "import ray\nnode = ray._private.worker._global_node\n",
        "driver.c": "from ray.train.v2._internal.execution.controller import TrainController\nx = 1\n",
        "worker.d": "import ray\nray.train.report({})\n",  # public: not counted
    }
    found = code_stats.private_ray_names(texts)
    assert found == {
        "driver.a": {"ray.train.v2._internal.execution.controller.TrainController"},
        "driver.b": {"ray._private.worker._global_node"},
        "driver.c": {"ray.train.v2._internal.execution.controller.TrainController"},
    }
    assert code_stats.private_count(found) == "3 in 3 modules"  # a name in two modules counts twice
    assert code_stats.private_count(None) == "not counted (no tests/ray_surface.py)"
    lines = code_stats.compare({"worker.d": texts["worker.d"]}, texts).splitlines()
    assert "Private Ray names: 0 in 0 modules before, 3 in 3 modules after" in lines


@pytest.mark.parametrize("given", ["-5", "0", "ten"])
def test_longest_takes_a_positive_count_of_functions(given, capsys):
    with pytest.raises(SystemExit) as done:
        code_stats.main(["--longest", given])
    assert done.value.code == 2
    assert f"argument --longest: got {given!r}; give a positive number of functions, e.g. 10" in capsys.readouterr().err


@pytest.mark.slow
def test_a_revision_outside_git_is_named_with_exit_2_not_a_traceback(tmp_path):
    """The script copied out of its clone (an unpacked archive): --rev has no history to read."""
    copy = tmp_path / "copy"
    (copy / "scripts").mkdir(parents=True)
    (copy / "raytrain").mkdir()
    (copy / "raytrain" / "__init__.py").write_text("x = 1\n")
    shutil.copy(_SPEC.origin, copy / "scripts" / "code_stats.py")
    done = subprocess.run(
        [sys.executable, str(copy / "scripts" / "code_stats.py"), "--rev", "HEAD"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)},  # no repository above the copy either
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: --rev HEAD: git cannot read it in {copy} (fatal: not a git repository" in done.stderr
    assert "it needs a git clone and a revision of its history: leave it out for the working tree" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_mode_compared_or_its_class_tested_outside_the_modes_package_is_counted():
    source = """
if cfg.fault_tolerance == "x":
    pass
if mode != "per-step":
    pass
ok = isinstance(recovery, (Recovery, int))
fine = isinstance(recovery, int) or name == "other"
"""
    trees = {m: ast.parse(source) for m in ("tune.space", "faults.per_step", "faults")}
    assert code_stats.mode_tests(trees) == ["tune.space:2", "tune.space:4", "tune.space:6"]
