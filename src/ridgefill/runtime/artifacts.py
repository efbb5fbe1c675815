"""Safetensors artifacts (calibration statistics, maps) with ridgefill metadata, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ridgefill import __version__
from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import atomic_path

META_KEY = "ridgefill"


def save_artifact(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    meta = {**meta, "ridgefill_version": __version__}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})


def load_artifact(path: str | Path, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an artifact of `kind` ('stats' or 'maps'); a missing, truncated or foreign file is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise RidgefillError(f"{kind} file {path} does not exist: check the path (or create it with ridgefill "
                             f"{'calibrate' if kind == 'stats' else 'fit'})")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY, "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise RidgefillError(
            f"cannot read {kind} file {path}: it is corrupted or truncated ({type(exc).__name__}); "
            f"recreate it with ridgefill {'calibrate' if kind == 'stats' else 'fit'}"
        ) from None
    if not isinstance(meta, dict) or meta.get("artifact") != kind:
        found = meta.get("artifact") if isinstance(meta, dict) else "no ridgefill metadata"
        raise RidgefillError(f"{path} is not a ridgefill {kind} file (found: {found}): pass the right file")
    return tensors, meta
