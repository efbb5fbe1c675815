"""Serving configs (`ridgefill tune` writes one): the split, tail, keep rows, fill variant and maps a model was
tuned to fill with. Commands that fill (`generate --serving-config`, `bench-ttft --serving-config`) take their
fill settings from it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import read_text

KIND = "ridgefill-serving-config"


@dataclass(frozen=True)
class Serving:
    variant: str  # identity or ridge
    split: int
    tail: int
    keep_first: int
    maps: Path | None  # the ridge maps (None for identity fill)
    weights_hash: str  # of the checkpoint it was tuned on


def load_serving(path: str | Path) -> Serving:
    """Read and check a serving config; anything missing or malformed is a one-line error."""
    text = read_text(path, "--serving-config")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RidgefillError(f"--serving-config {path} is not JSON ({exc.msg}): pass the file `ridgefill tune` "
                             "wrote (serving.json)") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise RidgefillError(f"--serving-config {path} is not a ridgefill serving config: pass the serving.json "
                             "that `ridgefill tune` wrote")
    try:
        variant, split, tail, keep = doc["variant"], int(doc["split"]), int(doc["tail"]), int(doc["keep_first"])
        weights = str(doc["model"]["weights_hash"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RidgefillError(f"--serving-config {path} lacks a valid {exc}: rerun `ridgefill tune`") from None
    if variant not in ("identity", "ridge") or (variant == "ridge" and not doc.get("maps")):
        raise RidgefillError(f"--serving-config {path}: variant {variant!r} without its maps: rerun `ridgefill tune`")
    maps = Path(doc["maps"]) if variant == "ridge" else None
    if maps is not None and not maps.is_absolute():
        maps = Path(path).parent / maps
    return Serving(variant, split, tail, keep, maps, weights)


def check_model(serving: Serving, weights_hash: str, path) -> None:
    """A serving config is refused for a model with other weights (the maps check this too; identity fill
    carries no maps, so it is checked here)."""
    if serving.weights_hash != weights_hash:
        raise RidgefillError(f"--serving-config {path} was tuned for another model (weights {serving.weights_hash}; "
                             f"this model's are {weights_hash}): tune this model, or pass its --model")
