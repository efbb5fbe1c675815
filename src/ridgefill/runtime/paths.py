"""Where ridgefill keeps converted models and downloaded corpora, and how it writes files atomically."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ridgefill.errors import RidgefillError


def cache_dir() -> Path:
    """$RIDGEFILL_CACHE, else ~/.cache/ridgefill."""
    return Path(os.environ.get("RIDGEFILL_CACHE", Path.home() / ".cache" / "ridgefill"))


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; rename it over `path` only if the block succeeds.
    Works for files and folders: a reader never sees a half-written result."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) / path.name
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def write_json(path: str | Path, data) -> None:
    """Strict JSON (NaN and infinities become null), written atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_finite(data), indent=2, default=_json_default, allow_nan=False) + "\n")


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _finite(obj.tolist())
    return obj


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def file_hash(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def read_text(path, what: str) -> str:
    """The UTF-8 text of a file a command reads (`what`: the option that names it, e.g. --prompt-file); a file
    that cannot be read or is not UTF-8 text (binary, another encoding) is a one-line error."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RidgefillError(f"{what} {path} is not UTF-8 text (byte {exc.start} cannot be decoded): pass a text "
                             "file, converted to UTF-8") from None
    except OSError as exc:
        raise RidgefillError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
