"""The patched llama-cpp-python as ridgefill loads it: the library with the patch's functions declared, and every
check that it can run here, each one line (RidgefillError) naming `make install`: llama-cpp-python or one of its
dependencies missing, another version, a build without the patch or with another patch, a build for an instruction
set this CPU lacks (its first matmul would die with SIGILL). `build_info` names the build (results and cache keys)."""

from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

from ridgefill.errors import RidgefillError

VERSION = "0.3.36"  # the llama-cpp-python whose vendored llama.cpp the patch is written against
PATCH = Path(__file__).with_name("patches") / "libllama.patch"  # build.LIBRARY_PATCH
INSTALL = "run `make install` (it builds llama-cpp-python with ridgefill's patch)"


def patch_id() -> str:
    """The patch's identity: the first 16 hex digits of its sha256 (build.py compiles it in)."""
    return hashlib.sha256(PATCH.read_bytes()).hexdigest()[:16]


def load():
    """llama_cpp.llama_cpp with the patch's functions declared; one line when it is missing, of another version,
    or built without (or with another) patch."""
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as ll
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing and missing != "llama_cpp":  # llama_cpp imports, one of its own imports does not
            raise RidgefillError(f"llama-cpp-python needs the package {missing}, which is not installed: "
                                 f"{INSTALL}") from None
        raise RidgefillError(f"llama-cpp-python is not installed: {INSTALL}") from None
    except (OSError, RuntimeError) as exc:  # the shared library did not load
        raise RidgefillError(f"llama-cpp-python's library does not load ({type(exc).__name__}): {INSTALL}") from None
    if getattr(llama_cpp, "__version__", None) != VERSION:
        raise RidgefillError(f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} is installed, ridgefill's "
                             f"patch is written for {VERSION}: {INSTALL}")
    lib = ll._lib
    if not hasattr(lib, "llama_ridgefill_patch_id"):
        raise RidgefillError(f"the installed llama-cpp-python {VERSION} was built without ridgefill's patch: {INSTALL}")
    _declare(lib)
    built = lib.llama_ridgefill_patch_id().decode()
    if built != patch_id():
        raise RidgefillError(f"the installed llama-cpp-python was built with ridgefill patch {built}, this ridgefill "
                             f"has patch {patch_id()}: {INSTALL}")
    check_cpu(build_features(lib), cpu_features(lib))
    return ll, lib


def _features(text: bytes) -> tuple[str, ...]:
    return tuple(f for f in text.decode().split(",") if f and f not in ("none", "unset"))


def build_features(lib) -> tuple[str, ...]:
    """The instruction sets the installed build was made for (build.py compiles them in)."""
    return _features(lib.llama_ridgefill_build_features())


def cpu_features(lib) -> tuple[str, ...]:
    """The instruction sets of the CPU this runs on (CPUID, read by the patched library)."""
    return _features(lib.llama_ridgefill_cpu_features())


def check_cpu(built: tuple[str, ...], cpu: tuple[str, ...]) -> None:
    """Refuse in one line a build that needs an instruction set this CPU lacks (its first matmul would die with
    SIGILL)."""
    lacking = [f for f in built if f not in cpu]
    if lacking:
        raise RidgefillError(f"the installed llama-cpp-python was built for a CPU with {', '.join(lacking)}, which "
                             f"this CPU lacks: run `make install` (it builds llama.cpp for the CPU it runs on)")


def build_info() -> dict:
    """What computes llama.cpp's results: llama-cpp-python's version, the patch built in and the instruction sets
    the build was made for (results and cache keys name it)."""
    _, lib = load()
    return {"llama_cpp_python": VERSION, "patch": lib.llama_ridgefill_patch_id().decode(),
            "cpu_features": list(build_features(lib))}


class Plan(ctypes.Structure):
    """llama.h's struct llama_ridgefill_plan: the fill rule and the outlier rule of a prompt."""

    _fields_ = [("tail", ctypes.c_int32), ("keep_first", ctypes.c_int32), ("outlier_factor", ctypes.c_float),
                ("chunk", ctypes.c_int32), ("keep_rows", ctypes.POINTER(ctypes.c_int32)),
                ("n_keep_rows", ctypes.c_int32)]


class Stats(ctypes.Structure):
    """llama.h's struct llama_ridgefill_stats: what one llama_ridgefill_prefill call did."""

    _fields_ = [("n_past", ctypes.c_int32), ("n_first", ctypes.c_int32), ("n_decode", ctypes.c_int32)]


ROW_FULL, ROW_FILLED, ROW_OUTLIER = 0, 1, 2  # llama.h's LLAMA_RIDGEFILL_ROW_*


def _declare(lib) -> None:
    f32p, vp, i32 = ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int32
    i32p, planp = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(Plan)
    for name in ("llama_ridgefill_patch_id", "llama_ridgefill_build_features", "llama_ridgefill_cpu_features"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_char_p
    signatures = {
        "llama_ridgefill_set_maps": ([vp, i32, i32, i32, i32, i32, f32p, f32p, f32p, f32p, f32p], i32),
        "llama_ridgefill_set_fill": ([vp, ctypes.c_bool], i32),
        "llama_ridgefill_n_norms": ([vp], i32),
        "llama_ridgefill_norms": ([vp], f32p),
        "llama_ridgefill_norm_pos": ([vp], i32p),
        "llama_adapter_ridgefill_init": ([vp, ctypes.c_char_p], vp),
        "llama_adapter_ridgefill_free": ([vp], None),
        "llama_adapter_ridgefill_meta_val_str": ([vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t], i32),
        "llama_set_adapter_ridgefill": ([vp, vp], i32),
        "llama_ridgefill_plan_default": ([vp], Plan),
        "llama_ridgefill_plan_rows": ([planp, i32, ctypes.POINTER(ctypes.c_bool)], i32),
        "llama_ridgefill_reusable": ([vp, i32, planp, i32, i32], i32),
        "llama_ridgefill_get_rows": ([vp, i32, i32, i32, ctypes.POINTER(ctypes.c_uint8), f32p], None),
        "llama_ridgefill_prefill": ([vp, i32, i32p, i32, i32, i32, i32, planp, i32p, i32, f32p,
                                     ctypes.POINTER(Stats)], i32),
    }
    for name, (args, res) in signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, res


def check_installed() -> None:
    """Refuse in one line when the patched llama-cpp-python cannot run here."""
    load()


_LOG_SINK = None  # the C log callback must outlive every context: kept for the process


def quiet(ll) -> None:
    """llama.cpp's log off (stderr carries progress bars): failures come back as return codes."""
    global _LOG_SINK
    if _LOG_SINK is None:
        _LOG_SINK = ll.llama_log_callback(lambda level, text, data: None)
        ll.llama_log_set(_LOG_SINK, ctypes.c_void_p())
