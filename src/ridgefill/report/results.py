"""The result documents of a run folder, as the report and the pipeline read them: Result (a document and what it
names: command, split, tail, seed) and collect (every complete document of a folder, or of its manifest)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ridgefill.commands import steps
from ridgefill.errors import RidgefillError


@dataclass
class Result:
    path: Path
    doc: dict

    @property
    def command(self) -> str:
        return self.doc["command"].replace("_", "-")

    @property
    def split(self) -> int | None:
        maps = self.doc.get("maps")
        return (maps or {}).get("split") or self.doc.get("split") or self.config.get("split")

    @property
    def tail(self) -> int | None:
        return self.config.get("tail")

    @property
    def seed(self) -> int | None:
        return self.doc.get("seed")

    @property
    def config(self) -> dict:
        return self.doc.get("config") or {}

    @property
    def label(self) -> str:
        parts = [f"split {self.split}" if self.split is not None else None,
                 f"tail {self.tail}" if self.tail is not None else None,
                 f"seed {self.seed}" if self.seed is not None else None]
        return ", ".join(p for p in parts if p) or self.path.stem

    @property
    def slug(self) -> str:
        return "-".join(f"{k}{v}" for k, v in (("s", self.split), ("t", self.tail), ("seed", self.seed))
                        if v is not None) or self.path.stem

    @property
    def variants(self) -> list[str]:
        return list(self.doc.get("variants") or self.doc.get("results", {}))


def collect(run_dir: Path) -> tuple[dict | None, list[Result]]:
    """(manifest or None, result documents in task order). With a manifest only its artifacts are read."""
    manifest_path = run_dir / "manifest.json"
    manifest = read_json(manifest_path) if manifest_path.is_file() else None
    entries = manifest.get("steps", []) if isinstance(manifest, dict) else None
    if manifest is not None and not (isinstance(entries, list) and all(
            isinstance(e, dict) and isinstance(e.get("hashes", {}), dict) for e in entries)):
        raise RidgefillError(f"{manifest_path} is not a ridgefill run manifest (a JSON object with a list of steps): "
                             "rerun the recipe (ridgefill run), or remove the file to report every result below the "
                             "folder")
    if manifest is not None:
        paths = [run_dir / name for step in entries for name in step.get("hashes", {}) if name.endswith(".json")]
    else:
        paths = sorted(p for p in run_dir.rglob("*.json") if p.name != "manifest.json")
    known = steps()
    results = []
    for path in paths:
        doc = read_json(path) if path.is_file() else None
        if isinstance(doc, dict) and str(doc.get("command", "")).replace("_", "-") in known:
            result = Result(path, doc)
            problem = _incomplete(result)
            if problem:
                raise RidgefillError(f"{path} is not a complete `ridgefill {result.command}` result ({problem}): "
                                     f"rerun the command, or move the file out of {run_dir}")
            results.append(result)
    return manifest, results


# What the report reads of a document, key -> JSON type(s): of a measurement's envelope (only `results` is
# required; each of its values, or each entry of bench-ttft's list, is an object), and of the fit summary (all
# required; each of its layers is an object). Other steps' documents are listed, not read.
NUMBER = (int, float, type(None))
MEASUREMENTS = ("ruler", "loss", "splice", "longbench", "bench-ttft")
ENVELOPE = {"results": dict, "intervals": dict, "config": dict, "model": dict, "maps": (dict, type(None))}
SUMMARIES = {"fit": {"split": int, "kind": str, "layers": list, "mean_error_identity": NUMBER,
                     "mean_error_map": NUMBER}}


def _incomplete(result: Result) -> str | None:
    """What a result document lacks of what the report reads (None when nothing)."""
    doc, command = result.doc, result.command
    if command not in MEASUREMENTS and command not in SUMMARIES:
        return None
    if command in SUMMARIES:
        fields, required, nested = SUMMARIES[command], set(SUMMARIES[command]), "layers"
    else:
        fields, required, nested = {**ENVELOPE, "results": list if command == "bench-ttft" else dict}, {"results"}, \
            "results"
    for key, kind in fields.items():
        if key not in doc:
            if key in required:
                return f"no '{key}'"
        elif not isinstance(doc[key], kind):
            return f"'{key}' is a JSON {type(doc[key]).__name__}"
    values = doc.get(nested, [])
    if not all(isinstance(v, dict) for v in (values.values() if isinstance(values, dict) else values)):
        return f"an entry of '{nested}' is not an object"
    return None


def read_json(path: Path):
    """A JSON file's value; None when it cannot be read or parsed (nested too deeply included)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None

