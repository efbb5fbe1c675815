"""Maps files: the fitted per-layer maps of one split, and turning them into an engine filler."""

from __future__ import annotations

from pathlib import Path

import torch

from ridgefill.method import maps_gguf
from ridgefill.runtime.artifacts import load_private, read_meta, save_artifact
from ridgefill.torchfill import Filler, IdentityFiller, MapFiller, MeanFiller
from ridgefill.errors import RidgefillError
from ridgefill.method.ridge import LayerFit
from ridgefill.method.statistics import first_nonfinite

KINDS = ("ridge", "identity", "mean")  # mean: the null control's maps (zero weights, the bias the mean)


def save_maps(path: str | Path, split: int, n_layers: int, fits: list[LayerFit], meta: dict, kind: str,
              key_scale: torch.Tensor | None = None, means: torch.Tensor | None = None,
              gguf_type: str | None = None) -> None:
    """key_scale [L-S, Hkv]: a key-scale correction to store with the maps (method/key_scale.py). means [L-S-1, H]:
    the calibration mean of each late layer's input, stored so that the `mean` control runs from any maps file.
    A .gguf path is written as a GGUF adapter with its matrices in `gguf_type` (write_maps)."""
    tensors = {} if key_scale is None else {"key_scale": key_scale.float()}
    if means is not None:
        tensors["mean"] = means.float()
    if kind in ("ridge", "mean"):
        tensors["bias"] = torch.stack([f.bias for f in fits]).float()
        if fits and fits[0].low_rank is not None:
            tensors["u"] = torch.stack([f.low_rank[0] for f in fits]).float()
            tensors["v"] = torch.stack([f.low_rank[1] for f in fits]).float()
        elif fits and fits[0].weight is not None:  # a mean map has none (zero weights)
            tensors["weight"] = torch.stack([f.weight for f in fits]).float()
    layers = [{"layer": f.layer, "lam": f.lam, "error_identity": f.error_identity, "error_map": f.error_map,
               "error_full_rank": f.error_full_rank} for f in fits]
    write_maps(path, tensors, {**meta, "artifact": "maps", "kind": kind, "split": split, "n_layers": n_layers,
                               "layers": layers}, gguf_type)


def write_maps(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict, gguf_type: str | None = None,
               fix: str | None = None, model: str | None = None) -> None:
    """Write a maps file's tensors and metadata, atomically: a GGUF adapter when `path` ends in .gguf (method/
    maps_gguf.py: its matrices in `gguf_type`, default f16; `model`: where the maps' model is, when not at their
    id), else safetensors (fp32 as given)."""
    if maps_gguf.is_gguf_path(path):
        maps_gguf.write(path, tensors, meta, gguf_type, fix, model)
    else:
        save_artifact(path, tensors, {k: v for k, v in meta.items() if k != "gguf"}, fix)


def load_maps(path: str | Path, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(tensors, metadata, sha256 of the file's bytes) of a maps file, safetensors or a GGUF adapter (by its first
    bytes), read whole into private memory (runtime/artifacts.load_private); with `sha256` the bytes must hash so."""
    if maps_gguf.is_gguf(path):
        return maps_gguf.read(path, sha256)
    return load_private(path, "maps", sha256)


def read_maps_meta(path: str | Path) -> dict:
    """The metadata of a maps file, safetensors or a GGUF adapter, without its tensors."""
    return maps_gguf.read_meta(path) if maps_gguf.is_gguf(path) else read_meta(path, "maps")


def load_filler(path: str | Path, model_info: dict, split: int | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                sha256: str | None = None, mean: bool = False, n_layers: int | None = None) -> tuple[Filler, dict]:
    """The filler stored in a maps file, checked against the model it will run on (mean: the `mean` control from
    the file's calibration means instead). The file is read whole into private memory (its tensors are no view of it:
    changing the file later changes nothing); with `sha256`, it must be the file that was checked. The metadata
    returned carries the file's `sha256`."""
    tensors, meta, digest = load_maps(path, sha256)
    return filler_of(path, tensors, {**meta, "sha256": digest}, model_info, split, dtype, device, mean, n_layers)


def filler_of(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict, model_info: dict,
              split: int | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              mean: bool = False, n_layers: int | None = None) -> tuple[Filler, dict]:
    """The filler of a maps file's `tensors` and `meta` as read (load_private), checked as load_filler checks it."""
    check_for_model(path, meta, model_info, split, n_layers)
    check_maps(path, tensors, meta, model_info.get("hidden_size"), model_info.get("kv_heads"))
    n_layers, s = meta["n_layers"], meta["split"]
    key_scale = tensors.get("key_scale")
    if mean or meta["kind"] == "mean":
        return MeanFiller(s, n_layers, calibration_means(path, tensors, meta), key_scale).to(torch.device(device),
                                                                                             dtype), meta
    if meta["kind"] == "identity":
        scale = None if key_scale is None else key_scale.to(device=torch.device(device), dtype=dtype)
        return IdentityFiller(s, n_layers, scale), meta
    try:
        low = (tensors["u"], tensors["v"]) if "u" in tensors else None
        filler = MapFiller(s, n_layers, tensors.get("weight"), tensors["bias"], low, key_scale,
                           meta.get("lookback_start", 0))
    except (KeyError, RuntimeError, ValueError) as exc:
        raise RidgefillError(f"{path} is incomplete ({exc}): refit it with ridgefill fit") from None
    return filler.to(torch.device(device), dtype), meta


def calibration_means(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    """[L-S-1, H] the calibration mean of each late layer's input that a maps file carries (a mean maps file: its
    bias). One line when it carries none (fitted before ridgefill 0.3)."""
    found = tensors.get("bias") if meta["kind"] == "mean" else tensors.get("mean")
    if found is None:
        raise RidgefillError(f"{path} carries no calibration means (fitted before ridgefill 0.3), which the mean "
                             "control needs: refit it with ridgefill fit")
    return found


META_KEYS = {"kind": str, "split": int, "n_layers": int, "model": dict}  # what a maps file's metadata must hold


def check_meta(path: str | Path, meta: dict) -> None:
    """Refuse maps whose metadata lacks what a filler needs (META_KEYS), or holds a split or kind no filler runs."""
    for key, kind in META_KEYS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise RidgefillError(f"{path} has no valid `{key}` in its ridgefill metadata (found {meta.get(key)!r}): "
                                 "refit it with ridgefill fit")
    if not 1 <= meta["split"] < meta["n_layers"] + 1 or meta["kind"] not in KINDS:
        raise RidgefillError(f"{path} holds split {meta['split']} of {meta['n_layers']} layers, kind "
                             f"{meta['kind']!r}: refit it with ridgefill fit")


def check_for_model(path: str | Path, meta: dict, model_info: dict, split: int | None = None,
                    n_layers: int | None = None) -> None:
    """Refuse maps whose metadata lacks what a filler needs, fitted for another checkpoint (its hash) or, given
    `split` and `n_layers`, for another split or layer count."""
    check_meta(path, meta)
    if "gguf" in meta:  # a GGUF adapter: its architecture, layer count, width and KV heads first
        maps_gguf.check_for_model(path, meta, model_info, n_layers)
    fitted = meta["model"]
    if fitted.get("weights_hash") != model_info["weights_hash"]:
        raise RidgefillError(f"{path} was fitted for another model ({fitted.get('id')}, weights "
                             f"{fitted.get('weights_hash')}); this model's weights are {model_info['weights_hash']}: "
                             "calibrate and fit for this model")
    if n_layers is not None and meta["n_layers"] != n_layers:
        raise RidgefillError(f"{path} holds maps for a {meta['n_layers']}-layer model, this model has {n_layers} "
                             "layers: fit maps for this model")
    if split is not None and split != meta["split"]:
        raise RidgefillError(f"{path} holds maps for split {meta['split']}, not {split}: pass --split "
                             f"{meta['split']} or fit maps for split {split}")


def check_maps(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict, hidden: int | None = None,
               kv_heads: int | None = None) -> None:
    """Refuse, in one line, maps a filler cannot run: a tensor that is not floating point, holds a NaN or an
    infinity, or is shaped otherwise than the file's own metadata says (`hidden`: the model's width, when known;
    else the bias's; `kv_heads`: the model's KV heads, which a key scale has one value for each of)."""
    wrong = next((name for name, t in tensors.items() if not t.is_floating_point()), None)
    if wrong:
        raise RidgefillError(f"{path} holds {wrong} as {tensors[wrong].dtype}, not floating point: {_redo(wrong)}")
    wrong = first_nonfinite(tensors)
    if wrong:
        raise RidgefillError(f"{path} holds a NaN or an infinity in {wrong}: {_redo(wrong)} (from statistics "
                             "calibrated in fp32)")
    shapes = _shapes(tensors, meta, hidden, kv_heads)
    for name, t in tensors.items():
        want = shapes.get(name)
        if want is not None and not _fits(t.shape, want):
            expected = "[" + ", ".join("*" if d is None else str(d) for d in want) + "]"
            raise RidgefillError(f"{path} has {name} of shape {list(t.shape)}, not {expected} (split {meta['split']} "
                                 f"of {meta['n_layers']} layers, lookback {meta.get('lookback', 0)}): {_redo(name)}")


def _redo(name: str) -> str:
    """The fix for a bad tensor of a maps file: redo the command that wrote it."""
    return "rerun ridgefill key-scale on the fitted maps" if name == "key_scale" else "refit it with ridgefill fit"


def _shapes(tensors: dict[str, torch.Tensor], meta: dict, hidden: int | None,
            kv_heads: int | None = None) -> dict[str, tuple]:
    """The shape each tensor of a maps file must have by its metadata (None: any size in that dimension): the
    L-S-1 maps' weight [L-S-1, F, H] (F = (K+1)·H with lookback K) or low-rank u [L-S-1, F, r] and v [L-S-1, r, H],
    bias and mean [L-S-1, H], key_scale [L-S, Hkv]."""
    maps = meta["n_layers"] - meta["split"] - 1
    bias = tensors.get("bias")
    h = hidden or (int(bias.shape[1]) if bias is not None and bias.dim() == 2 else None)
    f = None if h is None else ((meta.get("lookback") or 0) + 1) * h
    u = tensors.get("u")
    r = meta.get("rank") or (int(u.shape[2]) if u is not None and u.dim() == 3 else None)
    return {"weight": (maps, f, h), "u": (maps, f, r), "v": (maps, r, h), "bias": (maps, h), "mean": (maps, h),
            "key_scale": (maps + 1, kv_heads)}


def _fits(shape: torch.Size, want: tuple) -> bool:
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))
