"""Where a result came from: package versions, a hash of ridgefill's own source, the device, the load on the machine,
the source commit. One copy, used by a recipe's manifest and cache keys, the exact store, calibration checkpoints and
bench-ttft's result document. `result_versions` is what keys cached results (a recipe's artifacts, the exact
store): ridgefill's own identity merged with what computes the results, as the engine that ran reports it
(backends: Backend.provenance); a change of any of them recomputes."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ridgefill import __version__

PACKAGES = ("torch", "transformers", "numpy", "triton")
ARTIFACT_FORMAT = 1  # the layout of maps and statistics files (tensor names, metadata): bump when a writer changes it
BYTECODE = (".pyc", ".pyo")  # Python's caches of the source: never part of the code hash


def versions(packages=PACKAGES) -> dict:
    """ridgefill, Python and the installed version of each package (None where it is not installed)."""
    out = {"ridgefill": __version__, "python": platform.python_version()}
    for name in packages:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def result_versions(computed_by: dict) -> dict:
    """Everything beside a result's inputs that can change it: ridgefill's version and source hash, the maps and
    statistics format, and `computed_by`: what computes the results, as the engine that runs them reports it
    (Backend.provenance: its name, and e.g. torch and transformers for torchfill, vLLM's version, the llama.cpp
    build's version, patch and instruction sets)."""
    return {"ridgefill": __version__, "code": code_hash(), "format": ARTIFACT_FORMAT, **computed_by}


def code_hash() -> str:
    """A hash of the ridgefill package's files (by relative path and content): what keys cached artifacts and exact
    results to the code that made them, whether or not it runs from a git checkout. The rule: every file under the
    package shapes results, so every file is hashed (the Python source, and what is not Python: llama.cpp's
    patches, compiled into the llama.cpp builds), except Python's bytecode caches (__pycache__ folders,
    .pyc and .pyo files), which only mirror the source."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        relative = path.relative_to(package)
        if not path.is_file() or "__pycache__" in relative.parts or path.suffix in BYTECODE:
            continue
        digest.update(f"{relative.as_posix()}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: str) -> dict:
    """The device a run uses: the GPU's name and count, or the CPU's name, cores and torch threads."""
    import torch

    if device == "cuda":
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                "cuda": torch.version.cuda}
    return {"kind": "cpu", "name": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (other processes on a shared machine swing timings)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def git_commit() -> dict | None:
    """The commit of the ridgefill source, when it runs from a git checkout."""
    source = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
