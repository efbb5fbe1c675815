"""A split's maps in the form llama.cpp takes them (llama_ridgefill_set_maps), translated from an engine filler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Maps:
    """A split's maps as llama.cpp takes them (method/maps.py's fillers, translated by `maps_of`)."""

    split: int
    w: np.ndarray | None = None  # [m, H, H] each map transposed (row o: output o)
    u: np.ndarray | None = None  # [m, r, H] (Uᵀ)
    v: np.ndarray | None = None  # [m, H, r] (Vᵀ)
    b: np.ndarray | None = None  # [m, H]; None: identity fill
    key_scale: np.ndarray | None = None  # [L-S, Hkv]
    adapter: Path | None = None  # the same maps as a GGUF adapter: libllama reads it itself, tensors as stored (F16)

    @property
    def rank(self) -> int:
        return 0 if self.u is None else int(self.u.shape[1])


def maps_of(filler) -> Maps:
    """The llama.cpp form of an engine filler, from its affine maps (torchfill/fillers.py Affine): identity, fitted
    maps (full or low rank) or the mean control; the callers refuse the others (lookback, drop, oracle) before."""
    if getattr(filler, "lookback", 0) or not hasattr(filler, "affine"):
        raise ValueError(f"the {getattr(filler, 'name', type(filler).__name__)} filler has no llama.cpp form")

    def arr(t):
        return None if t is None else np.ascontiguousarray(t.detach().float().cpu().numpy())

    form, key_scale = filler.affine(), arr(filler.key_scale)
    if form.weights is not None:  # llama.cpp takes [m, out, in]
        return Maps(filler.split, w=arr(form.weights.transpose(1, 2)), b=arr(form.biases), key_scale=key_scale)
    if form.low_rank is not None:
        u, v = form.low_rank  # [m, F, r], [m, r, H] -> [m, r, F], [m, H, r]
        return Maps(filler.split, u=arr(u.transpose(1, 2)), v=arr(v.transpose(1, 2)), b=arr(form.biases),
                    key_scale=key_scale)
    return Maps(filler.split, b=arr(form.biases), key_scale=key_scale)
