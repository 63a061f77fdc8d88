"""scripts/test.sh, the staged runner CI calls: every CI test once, cheapest stage first, stopping
at the first stage that fails; the scenario stage only with --all; each stage's time and slowest
tests, a line that compares the CI stages with their budget, and a last line that sums the stages."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # starts pytest three or four times

CONFTEST = """
def pytest_configure(config):
    for mark in ("ray", "slow", "gpu", "scenario"):
        config.addinivalue_line("markers", mark)
"""


def suite(root: Path, pure: str = "pass", slow: str = "pass", ray: str = "pass") -> Path:
    root.mkdir()
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_it.py").write_text(
        "import pytest\n"
        f"def test_pure():\n    {pure}\n"
        "def test_pure_too():\n    pass\n"
        "@pytest.mark.skip\ndef test_skipped():\n    pass\n"
        f"@pytest.mark.slow\ndef test_slow():\n    {slow}\n"
        f"@pytest.mark.ray\ndef test_ray():\n    {ray}\n"
        f"@pytest.mark.ray\n@pytest.mark.slow\ndef test_ray_and_slow():\n    {ray}\n"
        "@pytest.mark.ray\n@pytest.mark.scenario\ndef test_scenario():\n    pass\n"
    )
    return root


def run(root: Path, *extra: str) -> tuple[int, list[str]]:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh"), *extra, "-p", "no:cacheprovider", str(root)],
        cwd=REPO,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout.splitlines()


def test_every_ci_test_runs_once_in_three_stages_and_the_last_line_sums_them(tmp_path):
    status, lines = run(suite(tmp_path / "green"))
    assert status == 0, "\n".join(lines[-30:])
    stages = [line.split()[3] for line in lines if re.match(r"test: stage \d", line)]
    assert stages == ["quick", "slow", "ray"]  # the scenario stage only with --all
    assert not any("test_scenario" in line for line in lines)
    assert lines[-1].startswith("5 passed, 0 failed, 1 skipped in "), lines[-1]
    assert lines[-1].endswith("(stages: quick, slow, ray)")
    # Each stage says its time and its slowest tests; the line before the last, the budget.
    assert [line.split()[2] for line in lines if re.match(r"test: stage \w+ took \d+ s$", line)] == stages
    assert sum("slowest 10 durations" in line for line in lines) == 3
    assert re.fullmatch(
        r"test: budget quick \d+ s/120 s (ok|OVER), slow \d+ s/480 s (ok|OVER), ray \d+ s/1500 s (ok|OVER)", lines[-2]
    ), lines[-2]


def test_all_adds_the_scenario_stage_and_every_test_runs_once(tmp_path):
    status, lines = run(suite(tmp_path / "all"), "--all")
    assert status == 0, "\n".join(lines[-30:])
    stages = [line.split()[3] for line in lines if re.match(r"test: stage \d", line)]
    assert stages == ["quick", "slow", "ray", "scenario"]
    assert lines[-1].startswith("6 passed, 0 failed, 1 skipped in "), lines[-1]
    assert lines[-1].endswith("(stages: quick, slow, ray, scenario)")
    assert re.search(r", ray \d+ s/1500 s (ok|OVER); scenario \d+ s \(no budget: not in CI\)$", lines[-2]), lines[-2]


def test_a_failing_stage_stops_the_later_ones_with_its_status(tmp_path):
    status, lines = run(suite(tmp_path / "red", slow="assert False"))
    assert status == 1
    assert not any(line.startswith("test: stage 3/3") for line in lines)
    assert "test: stage slow failed (pytest exit status 1); later stages not run" in lines
    assert re.fullmatch(r"test: budget quick \d+ s/120 s ok, slow \d+ s/480 s ok, ray not run/1500 s", lines[-2])
    assert lines[-1].startswith("2 passed, 1 failed, 1 skipped in "), lines[-1]
    assert lines[-1].endswith("(stages: quick, slow)")


def test_arguments_that_select_nothing_in_every_stage_exit_5_but_one_empty_stage_passes(tmp_path):
    root = suite(tmp_path / "typo")
    status, lines = run(root, "-k", "test_no_such_name")
    assert status == 5, "\n".join(lines[-30:])
    assert (
        "test: no stage selected a test (pytest's exit status 5 in each of the 3 stages): check the arguments, "
        "a -k or a path that matches nothing"
    ) in lines
    assert lines[-1].startswith("0 passed, 0 failed in "), lines[-1]
    # Only the quick stage selects a test: the other two select none, and the run passes.
    status, lines = run(root, "-k", "test_pure")
    assert status == 0, "\n".join(lines[-30:])
    assert lines[-1].startswith("2 passed, 0 failed in "), lines[-1]


def stage_marks() -> dict[str, str]:
    """Each stage's marker expression, as scripts/test.sh writes them."""
    script = (REPO / "scripts" / "test.sh").read_text()
    names = re.search(r"^names=\((.*)\)$", script, re.M).group(1).split()
    marks = re.findall(r'"([^"]*)"', re.search(r"^marks=\((.*)\)$", script, re.M).group(1))
    return dict(zip(names, marks, strict=True))


MARKS_PLUGIN = """
def pytest_collection_modifyitems(items):
    for item in items:
        print("MARKS", item.nodeid, ",".join(sorted({mark.name for mark in item.iter_markers()})))
"""


def collected_marks(tmp_path: Path) -> dict[str, set[str]]:
    """Every test of the suite with its marks, from one collection (one per stage took 50 s in CI)."""
    (tmp_path / "rt_marks_plugin.py").write_text(MARKS_PLUGIN)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-p",
            "rt_marks_plugin",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split(" ") for line in done.stdout.splitlines() if line.startswith("MARKS ")]
    return {row[1]: set(filter(None, row[2].split(","))) for row in rows}


class _Marked(dict):
    """A test's marks as the names of a -m expression: a mark it lacks is False."""

    def __missing__(self, name: str) -> bool:
        return False


def selects(expression: str, marks: set[str]) -> bool:
    """Whether pytest's -m `expression` (names, and, or, not, parentheses) selects a test with `marks`."""
    return bool(eval(expression, {"__builtins__": {}}, _Marked({mark: True for mark in marks})))  # noqa: S307


def test_a_mark_expression_selects_as_pytest_does():
    assert selects("not ray and not slow and not scenario", set()) and not selects("not ray", {"ray", "slow"})
    assert selects("slow and not ray and not scenario", {"slow", "parametrize"})
    assert selects("ray and not scenario", {"ray"}) and not selects("ray and not scenario", {"ray", "scenario"})


def test_the_suites_own_tests_are_each_in_exactly_one_stage(tmp_path):
    """On this repository's tests: the stages' selections are disjoint and together the whole
    suite; the ray stage holds no scenario test; every scenario test is a Ray test."""
    marks = stage_marks()
    assert list(marks) == ["quick", "slow", "ray", "scenario"]
    everything = collected_marks(tmp_path)
    assert len(everything) > 1000  # the whole suite was collected
    for test, its_marks in everything.items():
        stages = [name for name, expression in marks.items() if selects(expression, its_marks)]
        assert len(stages) == 1, f"{test} ({', '.join(sorted(its_marks))}): in the stages {stages}"
    scenario = [test for test, its_marks in everything.items() if selects(marks["scenario"], its_marks)]
    assert scenario and all("ray" in everything[test] for test in scenario)
