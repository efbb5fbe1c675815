"""A recipe as TOML text, both ways: the file read (one line for TOML it cannot read), a value of a KEY=VALUE
override read as TOML, and a recipe built in memory written back as the TOML record of what ran."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import read_text


def toml_text(raw: dict, comment: str = "") -> str:
    """A recipe's tables as TOML text (top-level keys, then one table per step): the record of a recipe built in
    memory."""
    top = {k: v for k, v in raw.items() if not isinstance(v, dict)}
    lines = [f"# {comment}"] if comment else []
    lines += [f"{k} = {_toml(v)}" for k, v in top.items()]
    for step, values in ((k, v) for k, v in raw.items() if isinstance(v, dict)):
        lines += ["", f"[{step}]", *(f"{k} = {_toml(v)}" for k, v in values.items())]
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def read_toml(path: Path) -> tuple[str, dict]:
    text = read_text(path, "recipe")
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RidgefillError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise RidgefillError(f"{path}: invalid TOML: nested too deeply to read: fix the recipe") from None


def toml_value(text: str):
    try:
        parsed = tomllib.loads(f"value = {text}")
    except (tomllib.TOMLDecodeError, RecursionError):  # not TOML, or nested too deeply to read: the text itself
        return text
    return parsed["value"] if list(parsed) == ["value"] else text
