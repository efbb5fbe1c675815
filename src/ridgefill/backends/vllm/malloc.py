"""glibc malloc settings for the vLLM processes ridgefill starts: keep freed memory instead of handing it back to the
operating system.

A step with filled rows runs its layers 0..S-1 eagerly (outside vLLM's compiled graph), and each of them allocates
and frees activations of tens of MB. glibc hands freed memory at the top of its heap back to the operating system
past its trim threshold, serves every block over its mmap threshold with a fresh mapping, and takes the pages back
one fault at a time: about 100,000 page faults per filled 4,096-token prefill of SmolLM2 on this machine's CPU,
against about 20,000 for the compiled stock forward. vLLM's CPU guide preloads tcmalloc, which keeps freed memory;
without a preloaded allocator, ridgefill's vLLM workers and servers (stock and RidgeFill alike, so that benchmarks
compare like with like) run with glibc told to keep it too: no mmap'd blocks, and no trimming below KEEP_BYTES of
free memory. docs/performance.md has the measurements.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Mapping

KEEP_BYTES = 1 << 30  # free heap memory glibc keeps before trimming (1 GiB)
TUNABLES = f"glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold={KEEP_BYTES}"
_MALLOPT = {-4: 0, -1: KEEP_BYTES}  # mallopt(3): M_MMAP_MAX, M_TRIM_THRESHOLD -> the same values as TUNABLES
_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a vLLM process's environment `environ`: GLIBC_TUNABLES, unless `environ` sets it
    already or preloads another allocator (the operator's choice wins)."""
    if "GLIBC_TUNABLES" in environ or any(a in environ.get("LD_PRELOAD", "") for a in _ALLOCATORS):
        return {}
    return {"GLIBC_TUNABLES": TUNABLES}


def keep_freed_memory(environ: Mapping[str, str]) -> bool:
    """The same settings in this process, already running (GLIBC_TUNABLES is read only when a program starts): True
    when glibc took them; False where `environ` chose otherwise (malloc_env adds nothing) or glibc is not here."""
    if not malloc_env(environ):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in _MALLOPT.items())
