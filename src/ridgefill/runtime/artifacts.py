"""Safetensors artifacts (calibration statistics, maps) with ridgefill metadata, written atomically.

The writer streams: it writes the safetensors header, then each tensor's bytes straight from the tensor's
memory (a CPU tensor as it is, a GPU tensor one slice along its first dimension at a time), so a write holds
no byte copy of the file and, for statistics on a GPU, at most one slice of them on the host. Readers can
read one part of a file (`prefix`) or only its metadata. Every reader copies the tensors into private memory (no
view of a mapping of the file: overwriting or truncating the file later changes nothing for whoever loaded it, where a
mapped read would crash with SIGBUS); maps (small) are read whole (`load_private`), with the sha256 of the bytes read.
A tensor with a NaN or an infinity, as it would be stored (after the writer's last cast), is refused before anything
is written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load as load_safetensors_bytes

from ridgefill import __version__
from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import atomic_path, is_sha256

META_KEY = "ridgefill"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own bound on a header's size
FIX_NONFINITE = {"stats": "calibrate again from the start (--restart), in fp32",
                 "maps": "refit with a larger --lam (or --lam auto), on statistics calibrated in fp32"}


def save_artifact(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict, fix: str | None = None) -> None:
    """Write `tensors` (on any device) and `meta` as a safetensors file, atomically (temporary name, fsync,
    rename): an interrupted write leaves the previous file whole. A tensor holding a NaN or an infinity is refused in
    one line before anything is written (`fix`: what to do then; default: by the artifact's kind)."""
    check_finite(path, tensors, fix or FIX_NONFINITE.get(meta.get("artifact"), "recreate it"))
    meta = {**meta, "ridgefill_version": __version__}
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        header = _header(tensors, {META_KEY: json.dumps(meta)})
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for tensor in tensors.values():
            _write_tensor(f, tensor)
        f.flush()
        os.fsync(f.fileno())


def check_finite(path: str | Path, tensors: dict[str, torch.Tensor], fix: str) -> None:
    """Refuse, naming the first such tensor, `tensors` to be written to `path` when one holds a NaN or an infinity
    as it is (in the dtype it would be stored in). A tensor on a GPU is checked there, one slice at a time."""
    for name, t in tensors.items():
        if (t.is_floating_point() or t.is_complex()) and not all(bool(p.isfinite().all()) for p in _slices(t)):
            raise RidgefillError(f"{path} not written: {name} holds a NaN or an infinity as {_dtype_name(t)}: {fix}")


def _slices(tensor: torch.Tensor):
    return tensor.detach().unbind(0) if tensor.dim() > 1 else (tensor.detach(),)


def _dtype_name(tensor: torch.Tensor) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        tensor.dtype, str(tensor.dtype).removeprefix("torch."))


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
    for part in _slices(tensor):  # one slice on the host at a time
        f.write(_bytes_of(part.contiguous().cpu()))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A view of a contiguous CPU tensor's memory as bytes (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def load_artifact(path: str | Path, kind: str, prefix: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an artifact of `kind` ('stats' or 'maps') into private memory (tensors that are no view of the file); a
    missing, truncated or foreign file is a one-line error. prefix: read only the tensors whose names start with it
    (e.g. one split's statistics, "s18."): the others are not read."""
    return _read(path, kind, lambda name: prefix is None or name.startswith(prefix))


def load_private(path: str | Path, kind: str, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(tensors, metadata, sha256 of the file's bytes) of an artifact read whole into memory: the tensors own their
    memory (no view of a mapping of the file). With `sha256`, bytes that hash otherwise are a one-line error (the
    file changed since it was checked)."""
    path = Path(path)
    data, digest = read_private(path, kind, sha256)
    try:
        size = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + size]).get("__metadata__", {}).get(META_KEY, "null"))
        tensors = load_safetensors_bytes(data) if isinstance(meta, dict) and meta.get("artifact") == kind else {}
    except Exception as exc:
        raise corrupt(path, kind, exc) from None
    return tensors, _checked(path, kind, meta), digest


def read_private(path: str | Path, kind: str, sha256: str | None = None) -> tuple[bytes, str]:
    """(the bytes of an artifact file of `kind`, read whole into memory once, their sha256); with `sha256`, bytes
    that hash otherwise are a one-line error (the file changed since it was checked). Any format: load_private parses
    safetensors from them, method/maps_gguf.py a GGUF adapter."""
    path = Path(path)
    if sha256 is not None and not is_sha256(sha256):
        raise RidgefillError(f"the sha256 pin of {kind} file {path} ({sha256!r}) is not a whole sha256 (64 hex "
                             "digits): pin the file by its full sha256")
    _exists(path, kind)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RidgefillError(f"cannot read {kind} file {path}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256.lower():
        raise RidgefillError(f"{kind} file {path} changed since it was checked (sha256 {digest[:16]}, expected "
                             f"{sha256[:16]}): leave it in place while it is served, and restart")
    return data, digest


def read_meta(path: str | Path, kind: str) -> dict:
    """The metadata of an artifact of `kind`, without reading its tensors."""
    return _read(path, kind, lambda name: False)[1]


def _read(path: str | Path, kind: str, wanted: Callable[[str], bool]) -> tuple[dict[str, torch.Tensor], dict]:
    """(the tensors whose names are `wanted`, the metadata) of an artifact of `kind`, each tensor copied from the file
    into memory of its own."""
    path = Path(path)
    _exists(path, kind)
    try:
        with open(path, "rb") as f:
            entries, meta = _parse_header(f)
            ok = isinstance(meta, dict) and meta.get("artifact") == kind
            tensors = {name: _read_tensor(f, entry) for name, entry in entries.items() if ok and wanted(name)}
    except OSError as exc:
        raise RidgefillError(f"cannot read {kind} file {path}: {exc.strerror or exc}") from None
    except Exception as exc:
        raise corrupt(path, kind, exc) from None
    return tensors, _checked(path, kind, meta)


def _parse_header(f) -> tuple[dict[str, dict], object]:
    """(each tensor's header entry, by name, with its absolute byte range; the ridgefill metadata) of an open
    safetensors file. A header that does not fit the file is a ValueError."""
    size = os.fstat(f.fileno()).st_size
    length = int.from_bytes(_read_exactly(f, 8), "little")
    if not 0 < length <= min(MAX_HEADER, size - 8):
        raise ValueError(f"header of {length} bytes in a file of {size}")
    header = json.loads(_read_exactly(f, length))
    meta = json.loads((header.pop("__metadata__", None) or {}).get(META_KEY, "null"))
    entries = {}
    for name, entry in header.items():
        begin, end = (8 + length + int(o) for o in entry["data_offsets"])
        shape = [int(d) for d in entry["shape"]]
        dtype = TORCH_DTYPES[entry["dtype"]]
        if not 8 + length <= begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{name}'s bytes {begin}..{end} do not fit its shape or the file")
        entries[name] = {"dtype": dtype, "shape": shape, "begin": begin}
    return entries, meta


def _read_tensor(f, entry: dict) -> torch.Tensor:
    """One tensor's bytes, copied from the open file into a new tensor."""
    tensor = torch.empty(entry["shape"], dtype=entry["dtype"])
    f.seek(entry["begin"])
    _fill(f, _bytes_of(tensor))
    return tensor


def _read_exactly(f, n: int) -> bytes:
    buffer = bytearray(n)
    _fill(f, memoryview(buffer))
    return bytes(buffer)


def _fill(f, view: memoryview) -> None:
    """Fill `view` from `f`, in as many reads as the system needs (one read returns at most 2 GiB on Linux); a file
    that ends first is an EOFError (truncated)."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise EOFError(f"{len(view) - done} bytes missing")
        done += got


def _maker(kind: str) -> str:
    return "calibrate" if kind == "stats" else "fit"


def _exists(path: Path, kind: str) -> None:
    if path.is_dir():
        raise RidgefillError(f"{kind} file {path} is a folder, not a file: pass the {kind} file itself (written by "
                             f"ridgefill {_maker(kind)})")
    if not path.is_file():
        raise RidgefillError(f"{kind} file {path} does not exist: check the path (or create it with ridgefill "
                             f"{_maker(kind)})")


def corrupt(path: Path, kind: str, exc: Exception) -> RidgefillError:
    return RidgefillError(f"cannot read {kind} file {path}: it is corrupted or truncated ({type(exc).__name__}); "
                          f"recreate it with ridgefill {_maker(kind)}")


def _checked(path: Path, kind: str, meta) -> dict:
    """The metadata, after checking it is ridgefill's, of an artifact of `kind`."""
    if not isinstance(meta, dict) or meta.get("artifact") != kind:
        found = meta.get("artifact") if isinstance(meta, dict) else "no ridgefill metadata"
        raise RidgefillError(f"{path} is not a ridgefill {kind} file (found: {found}): pass the right file")
    return meta
