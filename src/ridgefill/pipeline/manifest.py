"""manifest.json of a run folder: what reproduces the run (recipe text and overrides, versions, platform, device,
load, git commit, model and weights hash, settings) and, per task, its key, artifact, file hashes, the hash of
ridgefill's source that made it (`code`), whether it was cached and how long it took. Rewritten atomically after
every task."""

from __future__ import annotations

import hashlib
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ridgefill.runtime.paths import file_hash, write_json
from ridgefill.runtime.provenance import device_info, git_commit, load_average, versions

if TYPE_CHECKING:
    from ridgefill.pipeline.plan import Task
    from ridgefill.pipeline.recipe import Recipe

SETTINGS = ("splits", "tails", "seeds", "lam", "dtype", "device", "chunk", "tolerance")


class Manifest:
    def __init__(self, run_dir: Path, recipe: "Recipe", model: dict) -> None:
        self.run_dir, self.path = run_dir, run_dir / "manifest.json"
        self._t0 = time.perf_counter()
        self._previous = previous_hashes(self.path)
        s = recipe.settings
        self.doc = {
            "recipe": {"name": recipe.name, "path": str(recipe.path), "sha256": _sha(recipe.text),
                       "text": recipe.text, "overrides": list(recipe.overrides)},
            "status": "running", "started_at": _now(), "finished_at": None, "duration_s": None,
            "versions": versions(), "platform": platform.platform(), "device": device_info(s["device"]),
            "load_average": load_average(), "git": git_commit(), "model": model,
            "settings": {k: s[k] for k in SETTINGS}, "seeds": s["seeds"], "steps": [],
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        self.write()

    def add(self, task: "Task", key: str, files: list[Path], cached: bool, seconds: float, code: str) -> None:
        """One finished task; a cached file keeps the hash the last run recorded (no rehash of large files). code:
        the hash of ridgefill's source that made its artifact (part of its key, so a cached one was made by it)."""
        hashes = {}
        for f in files:
            rel = str(f.relative_to(self.run_dir))
            prior = self._previous.get(rel)
            hashes[rel] = prior if cached and prior else file_hash(f)
        self.doc["steps"].append({"label": task.label, "step": task.step, "split": task.split, "tail": task.tail,
                                  "seed": task.seed, "key": key, "reads": task.needs,
                                  "artifact": str(files[0].relative_to(self.run_dir)), "hashes": hashes,
                                  "code": code, "cached": cached, "duration_s": round(seconds, 3)})
        self.write()

    def finish(self, status: str) -> None:
        self.doc.update(status=status, finished_at=_now(), duration_s=round(time.perf_counter() - self._t0, 3),
                        load_average_end=load_average())
        self.write()

    def write(self) -> None:
        write_json(self.path, self.doc)


def previous_hashes(path: Path) -> dict:
    """File hashes an earlier manifest of this run folder recorded, by path in the folder (none from one that is
    missing, unreadable, nested too deeply or shaped otherwise)."""
    try:
        return {k: v for e in json.loads(path.read_text()).get("steps", []) for k, v in e.get("hashes", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        return {}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
