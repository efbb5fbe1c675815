"""Fillers: what a filled row gets as the input of each late layer, predicted from the split state.

A filler for split S maps the split state x (the residual stream entering layer S) of the filled rows to
predicted inputs of layers S+1..L-1. Layer S itself always gets x (its map is the identity, so its cache
is exact). All fillers return [B, n, L-S-1, H].
"""

from __future__ import annotations

from typing import Protocol

import torch


class Filler(Protocol):
    split: int
    n_layers: int

    def predict(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, n, H] split state of the filled rows at absolute `positions` [n] -> [B, n, L-S-1, H]."""
        ...


class IdentityFiller:
    """Identity fill (training-free, SwiftKV-style): x itself is every late layer's input."""

    name = "identity"

    def __init__(self, split: int, n_layers: int) -> None:
        self.split, self.n_layers = split, n_layers

    def predict(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(2).expand(-1, -1, self.n_layers - self.split - 1, -1)


class MapFiller:
    """Fitted affine maps x·W_l + b_l for l = S+1..L-1, applied as one GEMM against their concatenation.

    weights: [L-S-1, H, H]; biases: [L-S-1, H]. A low-rank map stores W_l = I + U_l V_l; then
    `low_rank` = (U [L-S-1, H, r], V [L-S-1, r, H]) and `weights` is None.
    """

    name = "ridge"

    def __init__(self, split: int, n_layers: int, weights: torch.Tensor | None, biases: torch.Tensor,
                 low_rank: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.split, self.n_layers = split, n_layers
        self.biases = biases
        self.low_rank = low_rank
        hidden = biases.shape[-1]
        n_maps = n_layers - split - 1
        if weights is not None:
            # [H, (L-S-1)*H]: column block j is layer S+1+j's map.
            self.stacked = weights.permute(1, 0, 2).reshape(hidden, n_maps * hidden).contiguous()
        else:
            u, v = low_rank
            self.stacked_u = u.permute(1, 0, 2).reshape(hidden, -1).contiguous()  # [H, (L-S-1)*r]
            self.v = v  # [L-S-1, r, H]

    def to(self, device: torch.device, dtype: torch.dtype) -> "MapFiller":
        for name in ("stacked", "stacked_u", "v", "biases"):
            if hasattr(self, name):
                setattr(self, name, getattr(self, name).to(device=device, dtype=dtype))
        return self

    def predict(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        n_maps = self.n_layers - self.split - 1
        if self.low_rank is None:
            out = (x.reshape(b * n, h) @ self.stacked).view(b, n, n_maps, h)
        else:
            r = self.v.shape[1]
            z = (x.reshape(b * n, h) @ self.stacked_u).view(b * n, n_maps, r).transpose(0, 1)  # [maps, B*n, r]
            out = x.unsqueeze(2) + torch.bmm(z, self.v).transpose(0, 1).view(b, n, n_maps, h)
        return out + self.biases


class OracleFiller:
    """The true late-layer inputs of an exact run, indexed by position (for exactness tests and splices).

    hidden: [B, N, L+1, H] or a list of L+1 tensors [B, N, H] (index l = input of layer l).
    """

    name = "oracle"

    def __init__(self, split: int, hidden: list[torch.Tensor]) -> None:
        self.split = split
        self.n_layers = len(hidden) - 1
        late = list(hidden[split + 1 : self.n_layers])
        b, n, h = hidden[0].shape
        self.late = torch.stack(late, dim=2) if late else hidden[0].new_empty(b, n, 0, h)  # [B, N, L-S-1, H]

    def predict(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.late[:, positions]
