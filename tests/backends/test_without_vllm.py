"""On an install without vLLM (Python 3.10, which pyproject allows, or no `[vllm]` extra) every test module under
tests/backends/vllm/ collects: those that need vLLM skip, none fails to import (a module that imports vllm before its importorskip
would abort the whole run). vLLM's absence is simulated in a fresh process by an import hook that refuses `vllm`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VLLM_TESTS = Path(__file__).parent / "vllm"
COLLECT = r"""
import sys
from importlib.abc import MetaPathFinder


class NoVllm(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoVllm())
import pytest

sys.exit(pytest.main(["--collect-only", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def test_every_vllm_test_module_skips_without_vllm(tmp_path):
    modules = sorted(VLLM_TESTS.glob("test_*.py"))
    done = subprocess.run([sys.executable, "-c", COLLECT, *map(str, modules)], capture_output=True, text=True,
                          cwd=VLLM_TESTS.parents[1].parent, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "error" not in out.lower(), out[-4000:]  # collected, no module failed to import
    skipped = {line.split()[2].split(":")[0] for line in out.splitlines() if line.startswith("SKIPPED")}
    assert "tests/backends/vllm/test_vllm_kv.py" in skipped, out[-4000:]  # it imported vllm before any skip
    assert all("could not import 'vllm'" in line for line in out.splitlines() if line.startswith("SKIPPED"))
