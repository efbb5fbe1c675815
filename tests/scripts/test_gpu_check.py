"""scripts/gpu_check.sh's set-up and bundling, run for real with a Python that cannot import pytest (python -S: no
site-packages) and carried wheels built here: pytest comes from the carried wheels (by pip, or unpacked where the
Python has no pip), only the wheels the Python lacks are installed, a step past the plan's time is recorded as not
run, and a bundle killed mid-write leaves the last whole archive."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MAIN = "import sys, pytest\nprint('carried pytest from', pytest.__file__, 'args', ' '.join(sys.argv[1:]))\n"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    """A minimal pure-Python wheel `name`-1.0 holding `files` (path -> text)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
            f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in {**files, **meta}.items():
            z.writestr(arc, text)
        z.writestr(f"{info}/RECORD", "".join(f"{arc},,\n" for arc in [*files, *meta, f"{info}/RECORD"]))
    return path


def python_without_pytest(tmp: Path, with_pip: bool) -> Path:
    """A Python that cannot import pytest (no site-packages), with or without pip."""
    extra = ""
    if with_pip:
        import pip

        (tmp / "pipdir").mkdir()
        (tmp / "pipdir" / "pip").symlink_to(Path(pip.__file__).parent)
        extra = f'PYTHONPATH="${{PYTHONPATH:-}}:{tmp / "pipdir"}" '
    py = tmp / "python"
    py.write_text(f'#!/bin/sh\n{extra}exec "{sys.executable}" -S "$@"\n')
    py.chmod(0o755)
    assert subprocess.run([py, "-c", "import pytest"], capture_output=True).returncode != 0
    return py


def check(tmp: Path, py: Path, only: str, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "PY": str(py), "DEVICE": "cpu", "SHAPE": "tiny", "ONLY": only, "WHEELS": str(tmp / "wheels"),
           "OUT": str(tmp / "out"), "WORK": str(tmp / "work"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def steps(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "work" / "results" / "steps.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("with_pip", [True, False])
def test_pytest_comes_from_the_carried_wheels(tmp_path, with_pip):
    carried = tmp_path / "wheels" / "pytest"
    carried.mkdir(parents=True)
    wheel(carried, "pytest", {"pytest/__init__.py": "", "pytest/__main__.py": MAIN})
    wheel(carried, "json", {"json/__init__.py": "raise ImportError('the carried json shadowed the stdlib')\n"})
    result = check(tmp_path, python_without_pytest(tmp_path, with_pip), "tests")
    assert result.returncode == 0, result.stderr
    site = tmp_path / "work" / "site"
    log = (tmp_path / "work" / "results" / "tests.log").read_text()
    assert f"carried pytest from {site / 'pytest' / '__init__.py'} args -p no:xdist" in log
    assert not (site / "json").exists()  # the Python has json: its carried wheel stays out
    assert "pytest: from the carried wheels (1 installed into" in result.stdout
    assert ("no pip in" in result.stdout) != with_pip
    assert [(s["step"], s["rc"]) for s in steps(tmp_path)] == [("tests", 0)]


def test_without_carried_pytest_the_tests_step_fails_and_says_why(tmp_path):
    (tmp_path / "wheels").mkdir()
    result = check(tmp_path, python_without_pytest(tmp_path, False), "tests")
    assert (f"pytest: not importable and not carried (make gpu-carry puts it under {tmp_path / 'wheels'}/pytest): the "
            "tests step fails") in result.stdout
    assert [(s["step"], s["rc"] != 0) for s in steps(tmp_path)] == [("tests", True)]


def test_steps_past_the_plans_time_are_recorded_as_not_run(tmp_path):
    (tmp_path / "wheels").mkdir()
    result = check(tmp_path, python_without_pytest(tmp_path, False), "tests env", TOTAL="0")
    assert result.returncode == 0, result.stderr
    assert steps(tmp_path) == [{"step": "env", "rc": 124, "ms": 0, "skipped": "out of time"},
                               {"step": "tests", "rc": 124, "ms": 0, "skipped": "out of time"}]
    assert "== tests: not run, the plan's 0 s are spent" in result.stdout


def test_a_bundle_killed_mid_write_keeps_the_last_whole_archive(tmp_path):
    """A run killed while tar writes the archive (here: a tar that writes a few bytes and is killed) leaves the
    previous archive whole, not a truncated one."""
    carried = tmp_path / "wheels" / "pytest"
    carried.mkdir(parents=True)
    wheel(carried, "pytest", {"pytest/__init__.py": "", "pytest/__main__.py": MAIN})
    py = python_without_pytest(tmp_path, False)
    assert check(tmp_path, py, "tests").returncode == 0
    archive = tmp_path / "out" / "results.tar.gz"
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "tar").write_text('#!/bin/sh\nprintf partial > "$2"\nkill -9 $$\n')
    (shim / "tar").chmod(0o755)
    check(tmp_path, py, "tests", PATH=f"{shim}:{os.environ['PATH']}")
    with tarfile.open(archive) as t:
        assert "results/steps.jsonl" in t.getnames() and "results/tests.log" in t.getnames()
    assert (tmp_path / "out" / "summary.md").read_text().startswith("# GPU check")
