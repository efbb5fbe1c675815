"""One bad input through the real console entry point (`ridgefill.cli.main`, as tests/test_bad_input.py runs its
cases): exit code 2, one line on stderr naming the problem, nothing written. For the tests beside each reader."""

from __future__ import annotations

from pathlib import Path

DEEP_JSON = "[" * 100_000  # one JSON value nested 100,000 deep: past any parser's recursion limit


def refused(args: list[str], tmp_path: Path, monkeypatch, capfd, match: str) -> None:
    """`ridgefill ARGS` (run in an empty tmp_path/cwd; outputs meant for tmp_path/out) is refused in one line that
    contains `match`, leaving both folders empty."""
    from test_bad_input import _main

    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir(exist_ok=True)
    cwd.mkdir(exist_ok=True)
    capfd.readouterr()
    code = _main(args, cwd, monkeypatch)
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr and code == 2, f"exit code {code}, stderr:\n{stderr}"
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    assert match in stderr, f"the error does not say {match!r}: {stderr}"
    assert not any(out.iterdir()) and not any(cwd.iterdir()), (list(out.iterdir()), list(cwd.iterdir()))
