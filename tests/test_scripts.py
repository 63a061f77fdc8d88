"""The scripts a user runs by hand (benchmarks/*.py) refuse what they cannot do with exit 2 and
one line naming the valid values, before anything runs: never a traceback (pure tier: each
script's `main` called in this process, its parser's error caught)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    return capsys.readouterr().err


def test_silent_faults_names_the_cases_it_has_and_wants_a_directory(tmp_path, capsys):
    main = script("silent_faults").main
    said = refused(main, [str(tmp_path / "out"), "--cases", "straggler,bogus"], capsys)
    assert "error: --cases: no case 'bogus'; choose among straggler, corrupt, comma-separated" in said
    (tmp_path / "file").write_text("")
    said = refused(main, [str(tmp_path / "file")], capsys)
    assert f"error: OUT {tmp_path / 'file'} is a file; give a directory (made if missing)" in said
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_gpu_check_names_the_parts_it_has_and_wants_a_directory(tmp_path, capsys):
    main = script("gpu_check").main
    said = refused(main, [str(tmp_path / "out"), "--device", "cpu", "--parts", "sync,bogus"], capsys)
    assert "error: --parts: no part 'bogus'; choose among sync, compile, resume, oom, speed, watch" in said
    (tmp_path / "file").write_text("")
    said = refused(main, [str(tmp_path / "file"), "--device", "cpu"], capsys)
    assert f"error: OUT {tmp_path / 'file'} is a file; give a directory (made if missing)" in said
    assert not (tmp_path / "out").exists()  # refused before anything ran
