"""vLLM's translation of a FillSettings (method/fill.py): what the plugin serves and how it reads it.

The plugin is configured by environment variables (method/fill_fields.ENV, one per FillField), which reach every
process vLLM starts. `pin` makes settings servable (identity fill through an identity maps file, the mean control
through a mean maps file, the maps pinned to their bytes), `fill_env` writes them as that environment and
`fill_from_env` reads them back inside vLLM's processes. Used by `ridgefill serve`, the workers of --engine vllm
(backends/vllm/backend.py through backends/vllm/worker.py) and the plugin itself (backends/vllm/plugin/).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from ridgefill.errors import RidgefillError
from ridgefill.method.fill import FillSettings, read_kind
from ridgefill.method.fill_fields import ENV, FIELD, env_number

V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its model runners (0: V1, the one the plugin hooks)


def pin(fill: FillSettings, n_layers: int, model_info: dict, scratch: Path) -> FillSettings:
    """`fill` as the vLLM plugin serves it: identity fill through an identity maps file written into `scratch` for
    this model, the mean control through a mean maps file written there from the maps' calibration means, and the
    maps pinned to their bytes as they are now (maps_sha256). The fill is one vLLM runs (backends/base.check_fill,
    Backend.use: no drop fill, no filled window); drop, which has no maps, is a ValueError here."""
    from ridgefill.method.maps import load_maps, read_maps_meta, save_maps

    maps = fill.maps
    if fill.variant == "drop":
        raise ValueError("drop fill has no maps to pin: check the fill with backends/base.check_fill first")
    if fill.variant == "identity":
        split = fill.split if fill.split is not None else read_maps_meta(fill.maps)["split"]
        maps = Path(scratch) / "identity.maps.safetensors"
        save_maps(maps, split, n_layers, [], {"model": model_info}, "identity")
    elif fill.variant == "mean" and read_kind(fill.maps) != "mean":
        maps = mean_maps(fill.maps, Path(scratch) / "mean.maps.safetensors", fill.maps_sha256)
    _, meta, digest = load_maps(maps, None if maps != fill.maps else fill.maps_sha256)
    if fill.split is not None and fill.split != meta["split"]:
        raise RidgefillError(f"{maps} holds maps for split {meta['split']}, not {fill.split}: pass --split "
                             f"{meta['split']} or fit maps for split {fill.split}")
    return replace(fill, maps=maps, split=meta["split"], maps_sha256=digest)


def fill_env(fill: FillSettings) -> dict[str, str]:
    """The plugin's environment (every process vLLM starts reads it); needs a maps file (`pin`)."""
    if fill.maps is None:
        raise RidgefillError("the vLLM plugin serves a maps file: pin the settings (backends/vllm/fill.pin) first")
    env = {ENV["maps"]: str(Path(fill.maps).resolve()), V2_RUNNER: "0"}
    for name, var in ENV.items():
        value = getattr(fill, name)
        if name != "maps" and value is not None:
            env[var] = repr(float(value)) if FIELD[name].kind is float else str(value)
    return env


def fill_from_env(env: Mapping[str, str] = os.environ) -> FillSettings | None:
    """The plugin's settings in `env`, or None when RIDGEFILL_MAPS is unset (vLLM then runs as stock). The variant
    is the maps file's kind (identity maps serve identity fill)."""
    from ridgefill.method.maps import read_maps_meta
    from ridgefill.runtime.paths import is_sha256

    maps = env.get(ENV["maps"], "").strip()
    if not maps:
        return None
    pinned = env.get(ENV["maps_sha256"], "").strip() or None  # unset or empty: no pin
    if pinned is not None and not is_sha256(pinned):
        raise RidgefillError(f"{ENV['maps_sha256']}={repr(pinned)[:80]} is not a whole sha256 (64 hex digits): set "
                             "it to the maps file's full sha256, or leave it unset")
    meta = read_maps_meta(maps)
    refuse_windowed(0, maps, meta)
    variant = meta.get("kind") if meta.get("kind") in ("identity", "mean") else "ridge"
    numbers = {n: env_number(env, FIELD[n]) for n in ENV if FIELD[n].kind in (int, float)}
    return FillSettings(variant, meta.get("split"), Path(maps), maps_sha256=pinned, **numbers)


def refuse_windowed(window: int, maps, meta: dict | None = None) -> None:
    """The vLLM plugin serves filled rows with full attention below the split: a window, asked or carried by the
    maps, is refused in one line."""
    from ridgefill.method.maps import read_maps_meta

    if meta is None and maps is not None:
        meta = read_maps_meta(maps)
    stored = (meta or {}).get("filled_window")
    if window or stored:
        size = window or stored["size"]
        raise RidgefillError(f"the vLLM plugin does not serve a filled window (--filled-window {size}"
                             f"{', carried by ' + str(maps) if stored else ''}) yet: measure it with --engine "
                             "torchfill, or serve maps calibrated without a window")


def mean_maps(maps: Path, out: Path, sha256: str | None = None) -> Path:
    """Write the mean control of `maps` (their calibration means as a mean maps file, for the vLLM plugin) to `out`."""
    from ridgefill.method.maps import calibration_means, load_maps
    from ridgefill.runtime.artifacts import save_artifact

    tensors, meta, _ = load_maps(maps, sha256)
    bias = calibration_means(maps, tensors, meta)
    keep = {k: meta[k] for k in ("model", "split", "n_layers", "data", "tokens", "seq_len") if k in meta}
    save_artifact(out, {"bias": bias}, {**keep, "artifact": "maps", "kind": "mean", "layers": [],
                                        "from_maps": str(maps)})
    return out
