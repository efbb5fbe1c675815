"""Exact-model results kept by content, so a sweep computes them once.

Every evaluation runs exact prefill beside the fills on the same samples. In a sweep over splits, the samples
of one tail are the same for every split, so the exact answers (RULER) and the exact per-token NLLs (loss) are
too (and the exact LongBench answers). An `ExactStore` over a folder keeps each such result in one small JSON
file named by a hash of
- the scope: model weights hash, model id, dtype, device, chunk size, and the versions that compute it (ridgefill's
  version and source hash, the maps format, and what the engine that runs it reports, Backend.provenance: e.g.
  torch and transformers, vLLM's version, the llama.cpp build: runtime/provenance.result_versions): anything that
  could change an exact result, down to float rounding, so an upgrade of any of them recomputes, and
- the sample: what the computation reads (the prompt ids and its own settings).
A file is reused only when it holds a stored result of that kind and scope (a file edited or copied from another
install is computed again and replaced).

A result's kind starts with the command that stores it (`ruler-answer`, `loss-exact-nll`): `ridgefill run
--force STEP` deletes that step's stored results (`forget`), and only files the store wrote: named
`<kind>-<24 hex digits>.json` and holding a stored result of that kind. Whatever else the folder holds (a user
may point `exact-cache` at a folder of their own) stays. A store without a folder computes every time.
Files are written atomically, so an interrupted run leaves nothing half-written. Results are JSON numbers and
strings: float32 values round-trip exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

from ridgefill.runtime.paths import write_json
from ridgefill.runtime.provenance import result_versions

SUFFIX = ".json"
KEY_DIGITS = 24  # hex digits of a stored result's key in its file name
STORED = re.compile(rf"(?P<kind>[A-Za-z0-9][A-Za-z0-9_-]*)-[0-9a-f]{{{KEY_DIGITS}}}{re.escape(SUFFIX)}")


class ExactStore:
    def __init__(self, folder: str | Path | None, model_info: dict, dtype: str, device: str, chunk: int,
                 engine_scope: dict | None = None, computed_by: dict | None = None) -> None:
        """engine_scope: what the scope adds for the engine beyond its provenance (Backend.store_scope);
        computed_by: the provenance of the engine that computes the results (Backend.provenance, which names the
        engine; default: the default engine's)."""
        if computed_by is None:
            from ridgefill.backends import DEFAULT_ENGINE, backend_class

            computed_by = backend_class(DEFAULT_ENGINE).provenance()
        self.folder = Path(folder) if folder is not None else None
        self.scope = {"weights": model_info.get("weights_hash"), "model": model_info.get("id"), "dtype": dtype,
                      "device": device, "chunk": chunk, "versions": result_versions(computed_by),
                      **(engine_scope or {})}
        self.hits = self.misses = 0

    def get(self, kind: str, sample: dict, compute: Callable[[], Any]) -> Any:
        """The stored result of `kind` for `sample` (JSON-able: ids as lists), else compute() stored. A file under
        the key that is not this scope's stored result (unreadable, edited, another scope) is computed again."""
        if self.folder is None:
            return compute()
        path = self.folder / f"{kind}-{self._key(kind, sample)}{SUFFIX}"
        doc = read_stored(path)
        if doc is not None and doc["kind"] == kind and doc["scope"] == self.scope:
            self.hits += 1
            return doc["value"]
        value = compute()
        write_json(path, {"kind": kind, "scope": self.scope, "value": value})
        self.misses += 1
        return value

    def get_exact(self, plan, kind: str, sample: dict, compute: Callable[[], Any]) -> Any:
        """`get` for the exact variant (plan None); a fill plan's result depends on its split: always computed."""
        return self.get(kind, sample, compute) if plan is None else compute()

    def _key(self, kind: str, sample: dict) -> str:
        payload = json.dumps({"kind": kind, "scope": self.scope, "sample": sample}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:KEY_DIGITS]

    def summary(self) -> dict:
        return {"folder": None if self.folder is None else str(self.folder), "hits": self.hits, "misses": self.misses}


def forget(folder: str | Path, command: str) -> None:
    """Delete the results that `command` stored in `folder` (its kinds start with the command's name); files the
    store did not write stay, whatever their names."""
    for path in Path(folder).glob(f"{command}-*{SUFFIX}"):
        if stored_by(path, command):
            path.unlink(missing_ok=True)


def stored_by(path: Path, command: str) -> bool:
    """Whether `path` is a result the store wrote for `command`: named `<kind>-<key>.json` with a kind that is the
    command's name or starts with it and a dash, and holding that kind's stored result (kind, scope, value)."""
    found = STORED.fullmatch(path.name)
    if found is None or not (found["kind"] == command or found["kind"].startswith(f"{command}-")):
        return False
    doc = read_stored(path)
    return doc is not None and doc["kind"] == found["kind"]


def read_stored(path: Path) -> dict | None:
    """The stored result at `path` (an object of exactly kind, scope and value), None where there is none: no such
    file, a link, unreadable, not JSON (nested too deeply included) or another object."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and set(doc) == {"kind", "scope", "value"} else None
