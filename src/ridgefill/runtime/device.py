"""--device and --dtype: `auto` resolved to what this machine runs (resolve_device), once, before anything is keyed,
loaded or recorded; then, before a model loads, the resolved pair checked against the hardware (check_device).

auto device: cuda when torch sees a CUDA GPU, else cpu. auto dtype: bf16 on a GPU that runs it natively, else fp32.
A program that runs on one device only (vLLM's CPU build: `cpu_only` says why) resolves auto to the CPU and refuses
cuda. Resolving never asks whether an explicit cuda is present, so a recipe written for a GPU validates (and
dry-runs) anywhere; check_device does, before the model loads.
"""

from __future__ import annotations

import torch

from ridgefill.errors import RidgefillError
from ridgefill.runtime.models import DTYPES

AUTO = "auto"
DEVICES = ("cpu", "cuda")
DEVICE_HELP = "auto (cuda when a CUDA GPU is visible, else cpu), cpu or cuda."
DTYPE_HELP = "auto (bf16 on a GPU that supports it, else fp32), fp32, bf16 or fp16."


def resolve_device(device: str, dtype: str, cpu_only: str | None = None) -> tuple[str, str]:
    """(device, dtype) with `auto` replaced by what this machine runs; explicit values as given. Unknown names, and
    cuda where `cpu_only` (why the program runs on the CPU alone) says it cannot run, are one-line errors."""
    if device != AUTO and device not in DEVICES:
        raise RidgefillError(f"unknown device '{device}': use {AUTO}, {' or '.join(DEVICES)}")
    if dtype != AUTO and dtype not in DTYPES:
        raise RidgefillError(f"unknown dtype '{dtype}': use {AUTO}, {', '.join(DTYPES)}")
    if cpu_only and device == "cuda":
        raise RidgefillError(f"--device cuda but {cpu_only}: use --device {AUTO} or cpu")
    if device == AUTO:
        device = "cpu" if cpu_only or not torch.cuda.is_available() else "cuda"
    if dtype == AUTO:
        dtype = "bf16" if device == "cuda" and native_bf16() else "fp32"
    return device, dtype


def check_device(device: str, dtype: str) -> None:
    """The resolved pair runs here: a CUDA GPU is visible for cuda, and it runs bf16 for bf16 (before a model
    loads)."""
    resolve_device(device, dtype)  # known names
    if device == "cuda" and not torch.cuda.is_available():
        raise RidgefillError("--device cuda but no CUDA GPU is visible: use --device cpu")
    if device == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported():  # emulated bf16 runs too
        raise RidgefillError("this GPU cannot run bf16: use --dtype fp16 or fp32")


def native_bf16() -> bool:
    """Whether the current CUDA GPU runs bf16 in hardware, what auto picks bf16 on (torch's default answer also
    counts bf16 emulated on a GPU without bf16 units)."""
    return torch.cuda.is_bf16_supported(including_emulation=False)
