"""Safetensors artifacts (calibration statistics, maps) with ridgefill metadata, written atomically.

The writer streams: it writes the safetensors header, then each tensor's bytes straight from the tensor's
memory (a CPU tensor as it is, a GPU tensor one slice along its first dimension at a time), so a write holds
no byte copy of the file and, for statistics on a GPU, at most one slice of them on the host. Readers can
read one part of a file (`prefix`) or only its metadata. Maps (small) are read whole into private memory
(`load_private`), with the sha256 of the bytes read: tensors that are no view of the file, so overwriting or
truncating it later changes nothing for whoever loaded it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes

from ridgefill import __version__
from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import atomic_path

META_KEY = "ridgefill"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def save_artifact(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write `tensors` (on any device) and `meta` as a safetensors file, atomically (temporary name, fsync,
    rename): an interrupted write leaves the previous file whole."""
    meta = {**meta, "ridgefill_version": __version__}
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        header = _header(tensors, {META_KEY: json.dumps(meta)})
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for tensor in tensors.values():
            _write_tensor(f, tensor)
        f.flush()
        os.fsync(f.fileno())


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors JSON header: each tensor's dtype, shape and byte range, in the order written."""
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"cannot store {name} of dtype {t.dtype} in safetensors")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)  # the tensor data starts 8-byte aligned


def _write_tensor(f, tensor: torch.Tensor) -> None:
    """Write a tensor's bytes (little-endian, as safetensors stores them) without copying a CPU tensor."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        f.write(_bytes_of(tensor.contiguous()))
        return
    for part in tensor.unbind(0) if tensor.dim() > 1 else (tensor,):  # one slice on the host at a time
        f.write(_bytes_of(part.contiguous().cpu()))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A view of a contiguous CPU tensor's memory as bytes (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def load_artifact(path: str | Path, kind: str, prefix: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an artifact of `kind` ('stats' or 'maps'); a missing, truncated or foreign file is a one-line error.
    prefix: read only the tensors whose names start with it (e.g. one split's statistics, "s18.")."""
    return _read(path, kind, lambda f: {k: f.get_tensor(k) for k in f.keys() if prefix is None or k.startswith(prefix)})


def load_private(path: str | Path, kind: str, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(tensors, metadata, sha256 of the file's bytes) of an artifact read whole into memory: the tensors own their
    memory (no view of a mapping of the file). With `sha256`, bytes that hash otherwise are a one-line error (the
    file changed since it was checked)."""
    path = Path(path)
    _exists(path, kind)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RidgefillError(f"cannot read {kind} file {path}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise RidgefillError(f"{kind} file {path} changed since it was checked (sha256 {digest[:16]}, expected "
                             f"{sha256[:16]}): leave it in place while it is served, and restart")
    try:
        size = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + size]).get("__metadata__", {}).get(META_KEY, "null"))
        tensors = load_safetensors_bytes(data) if isinstance(meta, dict) and meta.get("artifact") == kind else {}
    except Exception as exc:
        raise _corrupt(path, kind, exc) from None
    return tensors, _checked(path, kind, meta), digest


def read_meta(path: str | Path, kind: str) -> dict:
    """The metadata of an artifact of `kind`, without reading its tensors."""
    return _read(path, kind, lambda f: {})[1]


def _read(path: str | Path, kind: str, read: Callable) -> tuple[dict[str, torch.Tensor], dict]:
    path = Path(path)
    _exists(path, kind)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY, "null"))
            tensors = read(f) if isinstance(meta, dict) and meta.get("artifact") == kind else {}
    except Exception as exc:
        raise _corrupt(path, kind, exc) from None
    return tensors, _checked(path, kind, meta)


def _maker(kind: str) -> str:
    return "calibrate" if kind == "stats" else "fit"


def _exists(path: Path, kind: str) -> None:
    if not path.is_file():
        raise RidgefillError(f"{kind} file {path} does not exist: check the path (or create it with ridgefill "
                             f"{_maker(kind)})")


def _corrupt(path: Path, kind: str, exc: Exception) -> RidgefillError:
    return RidgefillError(f"cannot read {kind} file {path}: it is corrupted or truncated ({type(exc).__name__}); "
                          f"recreate it with ridgefill {_maker(kind)}")


def _checked(path: Path, kind: str, meta) -> dict:
    """The metadata, after checking it is ridgefill's, of an artifact of `kind`."""
    if not isinstance(meta, dict) or meta.get("artifact") != kind:
        found = meta.get("artifact") if isinstance(meta, dict) else "no ridgefill metadata"
        raise RidgefillError(f"{path} is not a ridgefill {kind} file (found: {found}): pass the right file")
    return meta
