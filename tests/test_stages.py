"""scripts/test.sh, the staged runner CI calls: every test once, cheapest stage first, stopping
at the first stage that fails, and a last line that sums the stages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # starts pytest three times

CONFTEST = """
def pytest_configure(config):
    for mark in ("ray", "slow", "gpu"):
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
    )
    return root


def run(root: Path) -> tuple[int, list[str]]:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh"), "-p", "no:cacheprovider", str(root)],
        cwd=REPO,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout.splitlines()


def test_every_test_runs_once_in_three_stages_and_the_last_line_sums_them(tmp_path):
    status, lines = run(suite(tmp_path / "green"))
    assert status == 0, "\n".join(lines[-30:])
    stages = [line.split()[3] for line in lines if line.startswith("test: stage ")]
    assert stages == ["quick", "slow", "ray"]
    assert lines[-1].startswith("5 passed, 0 failed, 1 skipped in "), lines[-1]
    assert lines[-1].endswith("(stages: quick, slow, ray)")


def test_a_failing_stage_stops_the_later_ones_with_its_status(tmp_path):
    status, lines = run(suite(tmp_path / "red", slow="assert False"))
    assert status == 1
    assert not any(line.startswith("test: stage 3/3") for line in lines)
    assert "test: stage slow failed (pytest exit status 1); later stages not run" in lines
    assert lines[-1].startswith("2 passed, 1 failed, 1 skipped in "), lines[-1]
    assert lines[-1].endswith("(stages: quick, slow)")
