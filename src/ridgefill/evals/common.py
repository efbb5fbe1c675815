"""The one JSON result document every measurement command writes (schema in docs/results-schema.md)."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone
from pathlib import Path

from ridgefill import __version__
from ridgefill.runtime.paths import write_json


def file_hash(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def maps_info(path: str | Path | None, meta: dict | None) -> dict | None:
    if path is None:
        return None
    return {"path": str(path), "hash": file_hash(path), "split": (meta or {}).get("split"),
            "kind": (meta or {}).get("kind")}


class ResultWriter:
    """Start it when a command starts; `write` stamps the duration and writes the document atomically."""

    def __init__(self, command: str, config: dict, seed: int | None = None) -> None:
        self.command, self.config, self.seed = command, config, seed
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._t0 = time.perf_counter()

    def document(self, model: dict, maps: dict | None, variants: list[str], results, intervals: dict,
                 **extra) -> dict:
        return {
            "command": self.command,
            "model": model,
            "maps": maps,
            "config": self.config,
            "variants": variants,
            "results": results,
            "intervals": intervals,
            "seed": self.seed,
            "ridgefill_version": __version__,
            "started_at": self.started_at,
            "duration_s": time.perf_counter() - self._t0,
            **extra,
        }

    def write(self, path: str | Path, *args, **kwargs) -> dict:
        doc = self.document(*args, **kwargs)
        write_json(path, doc)
        return doc
