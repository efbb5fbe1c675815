"""Build llama-cpp-python with ridgefill's patch and install it (stdlib only: `make install` runs it before the
package's own dependencies are needed).

    python -m ridgefill.backends.llamacpp.build [--python PY] [--key] [--jobs N] [--stock]

The sdist of llama-cpp-python VERSION (it vendors llama.cpp) is downloaded once, unpacked into a temporary folder,
patched (`patch -p1` in vendor/llama.cpp) and built into a wheel with FLAGS and the patch's identity compiled in
(RIDGEFILL_PATCH_ID). The wheel is kept under $RIDGEFILL_CACHE/llamacpp/wheels/<key>/ (default
~/.cache/ridgefill), the key a hash of (version, patch, flags): a second install reuses it and takes seconds; a
new patch or new flags build again. `--key` prints the key (the Makefile's stamp) and does nothing else.
`--stock` builds (or finds) the same version with the same FLAGS and no patch, installs nothing and prints the
wheel's path: the reference the exactness test (tests/backends/llamacpp/test_stock.py) compares with.

The build is made for the CPU it runs on: the instruction sets come from the flags of this machine's /proc/cpuinfo
(`cpu_flags`; SSE4.2, AVX, AVX2, BMI2, FMA, F16C, AVX-VNNI and the AVX-512 sets only where listed), never AMX and
never GGML_NATIVE (built natively, llama.cpp picks the AMX kernels on CPUs that report AMX_INT8, and the first
llama_decode crashed with SIGSEGV in ggml_backend_amx_mul_mat on an Intel machine here). The features are part of
the key, so another CPU builds its own wheel, and they are compiled in (RIDGEFILL_CPU_FEATURES): the driver refuses
in one line a build that needs an instruction set the running CPU lacks (a SIGILL otherwise).
RIDGEFILL_LLAMACPP_CPU builds for another CPU: a list of /proc/cpuinfo flag names (`avx,avx2,fma,f16c`; empty: SSE
only); RIDGEFILL_CPUINFO reads the flags from another file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
PATCH = Path(__file__).with_name("ridgefill.patch")
BASE_FLAGS = "-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"
CPU_ENV, CPUINFO_ENV = "RIDGEFILL_LLAMACPP_CPU", "RIDGEFILL_CPUINFO"
# ggml's x86 options and the /proc/cpuinfo flags each needs (the compiler flags ggml adds for it: GGML_AVX512 is
# -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw; the other AVX-512 options only come with it)
OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_bf16")),
)
KNOWN = tuple(dict.fromkeys(flag for _, needs in OPTIONS for flag in needs))  # every flag a build can need


def cpu_flags(cpuinfo: str | Path | None = None) -> set[str]:
    """The instruction-set flags a build is made for: RIDGEFILL_LLAMACPP_CPU's list when set, else the `flags` line
    of /proc/cpuinfo (or of RIDGEFILL_CPUINFO's file, or `cpuinfo`)."""
    chosen = os.environ.get(CPU_ENV)
    if chosen is not None and cpuinfo is None:
        flags = {f for f in chosen.replace(",", " ").split() if f}
        unknown = sorted(flags - set(KNOWN))
        if unknown:
            raise SystemExit(f"{CPU_ENV} names {', '.join(unknown)}, not an instruction set this build chooses: "
                             f"use /proc/cpuinfo flag names among {', '.join(KNOWN)}")
        return flags
    path = Path(cpuinfo or os.environ.get(CPUINFO_ENV) or "/proc/cpuinfo")
    for line in path.read_text().splitlines():
        if line.split(":", 1)[0].strip() == "flags":
            return set(line.split(":", 1)[1].split())
    return set()


def features(flags: set[str] | None = None) -> tuple[str, ...]:
    """The flags the build needs (those of its enabled options), in a fixed order: what keys and names it."""
    flags = cpu_flags() if flags is None else flags
    needed = {f for _, needs in OPTIONS if set(needs) <= flags for f in needs}
    return tuple(f for f in KNOWN if f in needed)


def cmake_flags(feats: tuple[str, ...] | None = None) -> str:
    """CMAKE_ARGS for a build of `feats` (default: this CPU's): every option on or off, AMX and GGML_NATIVE off."""
    feats = set(features() if feats is None else feats)
    opts = " ".join(f"-D{name}={'ON' if set(needs) <= feats else 'OFF'}" for name, needs in OPTIONS)
    return f"{BASE_FLAGS} {opts}"


def patch_id() -> str:
    """The first 16 hex digits of the patch's sha256 (library.patch_id computes the same)."""
    return hashlib.sha256(PATCH.read_bytes()).hexdigest()[:16]


def build_key(patched: bool = True, feats: tuple[str, ...] | None = None) -> str:
    flags = cmake_flags(feats)
    return hashlib.sha256(f"{VERSION}\n{patch_id() if patched else 'stock'}\n{flags}".encode()).hexdigest()[:16]


def cache_root() -> Path:
    """$RIDGEFILL_CACHE/llamacpp (runtime/paths.cache_dir's folder)."""
    return Path(os.environ.get("RIDGEFILL_CACHE", Path.home() / ".cache" / "ridgefill")) / "llamacpp"


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=cwd, env=env, check=True)


def sdist(python: str) -> Path:
    """The sdist, downloaded once into the cache."""
    folder = cache_root() / "sdist"
    found = folder / f"llama_cpp_python-{VERSION}.tar.gz"
    if not found.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        _run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={VERSION}", "-d", str(folder)])
    return found


def wheel_folder(patched: bool = True) -> Path:
    """Where the wheel of this build is kept (a stock build's name says so)."""
    return cache_root() / "wheels" / (build_key() if patched else f"stock-{build_key(patched=False)}")


def cached_wheel(patched: bool = True) -> Path | None:
    found = sorted(wheel_folder(patched).glob("llama_cpp_python-*.whl"))
    return found[0] if found else None


def wheel(python: str, jobs: int, patched: bool = True) -> Path:
    """The wheel, patched or stock: from the cache, else built (and cached)."""
    out = wheel_folder(patched)
    found = cached_wheel(patched)
    if found:
        return found
    source = sdist(python)
    with tempfile.TemporaryDirectory(prefix="ridgefill-llamacpp-") as tmp:
        with tarfile.open(source) as tar:
            tar.extractall(tmp, filter="data")
        root = Path(tmp) / f"llama_cpp_python-{VERSION}"
        if patched:
            _run(["patch", "-p1", "--forward", "--batch", "-i", str(PATCH)], cwd=root / "vendor" / "llama.cpp")
        flags = cmake_flags()
        if patched:
            flags += f" -DRIDGEFILL_PATCH_ID={patch_id()} -DRIDGEFILL_CPU_FEATURES={','.join(features()) or 'none'}"
        env = dict(os.environ, CMAKE_ARGS=flags, CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
        built = Path(tmp) / "wheel"
        _run([python, "-m", "pip", "wheel", "-q", "--no-deps", str(root), "-w", str(built)], env=env)
        wheels = sorted(built.glob("llama_cpp_python-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"the build left {len(wheels)} wheels in {built}")
        staging = out.with_name(out.name + f".{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheels[0], staging / wheels[0].name)
        try:
            staging.rename(out)  # whole or absent: another install building at the same time keeps its own
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return cached_wheel(patched)


def install(python: str, jobs: int) -> Path:
    found = wheel(python, jobs)
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(found)])
    # llama-cpp-python's own dependencies that ridgefill's driver imports (numpy is already one of ridgefill's)
    _run([python, "-m", "pip", "install", "-q", "typing-extensions>=4.5", "diskcache>=5.6.1", "jinja2>=2.11.3"])
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="build and install llama-cpp-python with ridgefill's patch")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to install into")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    parser.add_argument("--key", action="store_true", help="print the cache key of this build and stop")
    parser.add_argument("--stock", action="store_true", help="build (or find) the same version with the same flags "
                        "and no patch; install nothing, print the wheel's path")
    args = parser.parse_args(argv)
    if args.key:
        print(build_key())
        return
    if args.stock:
        print(wheel(args.python, args.jobs, patched=False))
        return
    found = install(args.python, args.jobs)
    print(f"llama-cpp-python {VERSION} with ridgefill patch {patch_id()} installed from {found}")


if __name__ == "__main__":
    main()
