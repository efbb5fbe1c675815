"""Maps files: the fitted per-layer maps of one split, and turning them into an engine filler."""

from __future__ import annotations

from pathlib import Path

import torch

from ridgefill.runtime.artifacts import load_private, save_artifact
from ridgefill.engine import Filler, IdentityFiller, MapFiller
from ridgefill.errors import RidgefillError
from ridgefill.method.ridge import LayerFit

KINDS = ("ridge", "identity")


def save_maps(path: str | Path, split: int, n_layers: int, fits: list[LayerFit], meta: dict, kind: str,
              key_scale: torch.Tensor | None = None) -> None:
    """key_scale [L-S, Hkv]: a key-scale correction to store with the maps (method/key_scale.py)."""
    tensors = {} if key_scale is None else {"key_scale": key_scale.float()}
    if kind == "ridge":
        tensors["bias"] = torch.stack([f.bias for f in fits]).float()
        if fits and fits[0].low_rank is not None:
            tensors["u"] = torch.stack([f.low_rank[0] for f in fits]).float()
            tensors["v"] = torch.stack([f.low_rank[1] for f in fits]).float()
        elif fits:
            tensors["weight"] = torch.stack([f.weight for f in fits]).float()
    layers = [{"layer": f.layer, "lam": f.lam, "error_identity": f.error_identity, "error_map": f.error_map,
               "error_full_rank": f.error_full_rank} for f in fits]
    save_artifact(path, tensors, {**meta, "artifact": "maps", "kind": kind, "split": split,
                                  "n_layers": n_layers, "layers": layers})


def load_filler(path: str | Path, model_info: dict, split: int | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                sha256: str | None = None) -> tuple[Filler, dict]:
    """The filler stored in a maps file, checked against the model it will run on. The file is read whole into
    private memory (its tensors are no view of it: changing the file later changes nothing); with `sha256`, it must
    be the file that was checked. The metadata returned carries the file's `sha256`."""
    tensors, meta, digest = load_private(path, "maps", sha256)
    meta = {**meta, "sha256": digest}
    if meta.get("model", {}).get("weights_hash") != model_info["weights_hash"]:
        raise RidgefillError(
            f"{path} was fitted for another model ({meta.get('model', {}).get('id')}, weights "
            f"{meta.get('model', {}).get('weights_hash')}); this model's weights are {model_info['weights_hash']}: "
            "calibrate and fit for this model"
        )
    if split is not None and split != meta["split"]:
        raise RidgefillError(f"{path} holds maps for split {meta['split']}, not {split}: pass --split "
                             f"{meta['split']} or fit maps for split {split}")
    n_layers, s = meta["n_layers"], meta["split"]
    key_scale = tensors.get("key_scale")
    if key_scale is not None and key_scale.shape[0] != n_layers - s:
        raise RidgefillError(f"{path} has a key scale for {key_scale.shape[0]} layers, not {n_layers - s}: refit it")
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
