"""Per-layer caches. Attention layers hold post-norm, post-RoPE keys and values; the cache grows in place.
Linear-attention layers hold a recurrent state and a short conv state (`StateCache`).

Shapes: keys/values are [B, Hkv, T, D] with T the number of cached positions.
"""

from __future__ import annotations

import torch


class AttentionCache:
    """Keys and values of one attention layer, preallocated and grown by doubling."""

    kind = "attention"

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self._v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, capacity: int = 0) -> None:
        """Write k, v ([B, Hkv, n, D]) at positions length..length+n."""
        n = k.shape[2]
        need = self.length + n
        if self._k is None or need > self._k.shape[2]:
            size = max(need, capacity, 2 * (self._k.shape[2] if self._k is not None else 0))
            self._k = self._grow(self._k, k, size)
            self._v = self._grow(self._v, v, size)
        self._k[:, :, self.length : need] = k
        self._v[:, :, self.length : need] = v
        self.length = need

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, size: int) -> torch.Tensor:
        shape = (like.shape[0], like.shape[1], size, like.shape[3])
        new = torch.empty(shape, dtype=like.dtype, device=like.device)
        if old is not None:
            new[:, :, : self.length] = old[:, :, : self.length]
        return new

    @property
    def keys(self) -> torch.Tensor:
        """[B, Hkv, length, D], a view into the buffer."""
        return self._k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self.length]

    def replace(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        """Overwrite the cached keys and/or values (same shape as `.keys`); used by splice tests."""
        if keys is not None:
            self._k[:, :, : self.length] = keys
        if values is not None:
            self._v[:, :, : self.length] = values

    def clone(self) -> "AttentionCache":
        out = AttentionCache()
        if self._k is not None:
            out._k = self._k.clone()
            out._v = self._v.clone()
        out.length = self.length
        return out


class Cache:
    """One entry per decoder layer; `length` is the number of positions already written."""

    def __init__(self, layers: list) -> None:
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def clone(self) -> "Cache":
        return Cache([layer.clone() for layer in self.layers])

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int):
        return self.layers[index]


class StateCache:
    """The running state of one linear-attention (Gated DeltaNet) layer.

    recurrent: [B, heads, Dk, Dv] float32 delta-rule state after the last consumed row (None before use);
    conv: [B, channels, kernel-1] the last kernel-1 pre-conv inputs (None before use; zeros stand in);
    length: positions consumed so far (kept so `Cache.length` works when layer 0 is a linear layer).
    """

    kind = "state"

    def __init__(self, recurrent: torch.Tensor | None = None, conv: torch.Tensor | None = None,
                 length: int = 0) -> None:
        self.recurrent = recurrent
        self.conv = conv
        self.length = length

    def replace(self, recurrent: torch.Tensor | None = None, conv: torch.Tensor | None = None) -> None:
        """Swap in another recurrent and/or conv state (same shapes); used by splice tests."""
        if recurrent is not None:
            self.recurrent = recurrent.clone()
        if conv is not None:
            self.conv = conv.clone()

    def clone(self) -> "StateCache":
        return StateCache(
            None if self.recurrent is None else self.recurrent.clone(),
            None if self.conv is None else self.conv.clone(),
            self.length,
        )
