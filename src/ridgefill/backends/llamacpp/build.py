"""Build llama-cpp-python and llama.cpp's `llama-server` with ridgefill's patches and install them (stdlib only:
`make install` runs it before the package's own dependencies are needed).

    python -m ridgefill.backends.llamacpp.build [--python PY] [--key] [--jobs N] [--stock] [--stock-server]

The patches (patches/, applied in order with `patch -p1` in the sdist's vendor/llama.cpp), each a separate change:
libllama.patch (the fill, the GGUF adapter and the fill plan in libllama: what the ctypes driver calls),
common.patch (common's --ridgefill options and the adapter's loading) and server.patch (llama-server: a fill per
slot, its refusals and counters).

The sdist of llama-cpp-python VERSION (it vendors llama.cpp) is downloaded once and unpacked into a temporary folder
for each build:
- the wheel: the library patch, FLAGS and the patch's identity compiled in (RIDGEFILL_PATCH_ID), kept under
  $RIDGEFILL_CACHE/llamacpp/wheels/<key>/ (default ~/.cache/ridgefill), the key a hash of (version, patch, flags);
- `llama-server`: every patch, the same FLAGS and identity, static libraries, no web UI (nothing downloaded), kept
  under $RIDGEFILL_CACHE/llamacpp/server/<key>/ and installed as the interpreter's bin/llama-server.
A second install reuses both and takes seconds; a new patch or new flags build again. `--key` prints the key of both
(the Makefile's stamp) and does nothing else. `--stock` builds (or finds) the wheel of the same version with the same
FLAGS and no patch, `--stock-server` the same llama-server; they install nothing and print the path: the references
the exactness tests (tests/backends/llamacpp/test_stock.py, test_llama_server.py) compare with.

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
PATCHES = Path(__file__).with_name("patches")
LIBRARY_PATCH = PATCHES / "libllama.patch"  # the wheel's (library.py checks its identity)
SERVER_PATCHES = (LIBRARY_PATCH, PATCHES / "common.patch", PATCHES / "server.patch")  # llama-server's, in order
SERVER_FLAGS = ("-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                "-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF "
                "-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF")
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
    """The first 16 hex digits of the library patch's sha256 (library.patch_id computes the same)."""
    return hashlib.sha256(LIBRARY_PATCH.read_bytes()).hexdigest()[:16]


def server_patch_id() -> str:
    """The first 16 hex digits of the sha256 of llama-server's patches, in order."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SERVER_PATCHES)).hexdigest()[:16]


def build_key(patched: bool = True, feats: tuple[str, ...] | None = None) -> str:
    """The wheel's cache key."""
    flags = cmake_flags(feats)
    return hashlib.sha256(f"{VERSION}\n{patch_id() if patched else 'stock'}\n{flags}".encode()).hexdigest()[:16]


def server_key(patched: bool = True, feats: tuple[str, ...] | None = None) -> str:
    """llama-server's cache key."""
    flags = f"{cmake_flags(feats)} {SERVER_FLAGS}"
    ident = server_patch_id() if patched else "stock"
    return hashlib.sha256(f"{VERSION}\nserver\n{ident}\n{flags}".encode()).hexdigest()[:16]


def install_key() -> str:
    """What `make install` builds: the wheel's key and the server's."""
    return f"{build_key()}-{server_key()}"


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
    with tempfile.TemporaryDirectory(prefix="ridgefill-llamacpp-") as tmp:
        root = unpacked(python, Path(tmp), (LIBRARY_PATCH,) if patched else ())
        env = dict(os.environ, CMAKE_ARGS=cmake_flags() + (identity_flags() if patched else ""),
                   CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
        built = Path(tmp) / "wheel"
        _run([python, "-m", "pip", "wheel", "-q", "--no-deps", str(root), "-w", str(built)], env=env)
        wheels = sorted(built.glob("llama_cpp_python-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"the build left {len(wheels)} wheels in {built}")
        keep(wheels[0], out)
    return cached_wheel(patched)


def unpacked(python: str, tmp: Path, patches: tuple[Path, ...]) -> Path:
    """The sdist unpacked into `tmp`, its vendored llama.cpp patched by `patches` in order; returns its root."""
    with tarfile.open(sdist(python)) as tar:
        tar.extractall(tmp, filter="data")
    root = tmp / f"llama_cpp_python-{VERSION}"
    for patch in patches:
        _run(["patch", "-p1", "--forward", "--batch", "-i", str(patch)], cwd=root / "vendor" / "llama.cpp")
    return root


def identity_flags() -> str:
    """The CMake definitions that compile the library patch's identity and the build's instruction sets in."""
    return f" -DRIDGEFILL_PATCH_ID={patch_id()} -DRIDGEFILL_CPU_FEATURES={','.join(features()) or 'none'}"


def keep(built: Path, out: Path) -> None:
    """Put the file `built` in the cache folder `out`, whole or not at all: another install building at the same
    time keeps its own."""
    staging = out.with_name(out.name + f".{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, staging / built.name)
    try:
        staging.rename(out)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def server_folder(patched: bool = True) -> Path:
    """Where the llama-server of this build is kept (a stock build's name says so)."""
    return cache_root() / "server" / (server_key() if patched else f"stock-{server_key(patched=False)}")


def server(python: str, jobs: int, patched: bool = True) -> Path:
    """llama-server, patched or stock: from the cache, else built (and cached). Built from the same sdist with the
    same instruction sets as the wheel, static (one file), without the web UI (LLAMA_BUILD_UI and
    LLAMA_USE_PREBUILT_UI off: nothing is downloaded)."""
    out = server_folder(patched)
    if (out / "llama-server").is_file():
        return out / "llama-server"
    with tempfile.TemporaryDirectory(prefix="ridgefill-llama-server-") as tmp:
        root = unpacked(python, Path(tmp), SERVER_PATCHES if patched else ())
        build = Path(tmp) / "build"
        flags = f"{cmake_flags()} {SERVER_FLAGS}" + (identity_flags() if patched else "")
        _run(["cmake", "-S", str(root / "vendor" / "llama.cpp"), "-B", str(build), *flags.split()])
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)])
        keep(build / "bin" / "llama-server", out)
    return out / "llama-server"


def install_server(python: str, jobs: int) -> Path:
    """The patched llama-server, copied (atomically) into the interpreter's bin/ beside its `ridgefill`."""
    found = server(python, jobs)
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], check=True, capture_output=True,
                            text=True).stdout.strip()
    target = Path(prefix) / "bin" / "llama-server"
    staging = target.with_name(f".llama-server.{os.getpid()}")
    shutil.copy2(found, staging)
    staging.chmod(0o755)
    staging.replace(target)
    return target


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
    parser.add_argument("--stock-server", action="store_true", help="build (or find) llama-server of the same version "
                        "with the same flags and no patch; install nothing, print its path")
    args = parser.parse_args(argv)
    if args.key:
        print(install_key())
        return
    if args.stock or args.stock_server:
        print(wheel(args.python, args.jobs, patched=False) if args.stock else
              server(args.python, args.jobs, patched=False))
        return
    found = install(args.python, args.jobs)
    print(f"llama-cpp-python {VERSION} with ridgefill patch {patch_id()} installed from {found}")
    print(f"llama-server with ridgefill patches {server_patch_id()} installed as {install_server(args.python, args.jobs)}")


if __name__ == "__main__":
    main()
