"""Local attention for filled rows below the split (`--filled-window W`).

With a window, every filled row, in the windowed layers below the split, attends only to the sinks (the leading
`sinks` positions: the kept first rows) and to the W rows before it (positions p-W..p); full rows (tail, kept rows,
decode) attend to everything as without one. Layers at or above the split are untouched: there filled rows run no
attention. The work is O(rows x W) per layer: the windowed rows of a chunk go in blocks of consecutive rows, and a
block attends to the sinks and the band of keys from W rows before its first row to its last row, masked per row
(`window_blocks`), never to a masked full prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ridgefill.errors import RidgefillError


def check_window_size(window, name: str = "--filled-window") -> int:
    """The one rule of a filled window's size: an integer of at least 0 (0: full attention); returns it."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise RidgefillError(f"{name} {window} must be an integer of at least 0 (0: full attention)")
    return window


@dataclass(frozen=True)
class FilledWindow:
    """W = `size` rows before each windowed row, in layers `first`..`last` (inclusive; only those below the split
    window anything), besides the leading `sinks` positions."""

    size: int
    first: int
    last: int
    sinks: int = 1

    def __post_init__(self) -> None:
        check_window_size(self.size)
        for name in ("first", "last", "sinks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RidgefillError(f"filled window {name} {value!r} must be an integer of at least 0")
        if self.size < 1:
            raise RidgefillError(f"--filled-window {self.size} must be at least 1 (0 means no window: full "
                                 "attention)")
        if self.first > self.last:
            raise RidgefillError(f"--filled-window-layers {self.first}-{self.last} is empty: give first-last with "
                                 "first <= last")

    def layers(self, split: int) -> range:
        """The windowed layers at `split`: first..last, below the split."""
        return range(self.first, min(self.last + 1, split))

    def keys_per_row(self, position):
        """How many keys a windowed row at `position` (a number or a numpy array of them) attends to: itself, up to
        W rows before it, the sinks before those."""
        band = np.minimum(position, self.size) + 1
        return band + np.minimum(self.sinks, np.maximum(0, np.subtract(position, self.size)))

    def to_meta(self) -> dict:
        """What a statistics or maps file stores (the sinks are the kept first rows of the run that reads it)."""
        return {"size": self.size, "first": self.first, "last": self.last}


def parse_layers(text: str | None, split: int) -> tuple[int, int]:
    """--filled-window-layers 'a-b' (or one layer 'a') -> (a, b); None: every layer below `split`, 0..split-1."""
    if text is None or str(text).strip() == "":
        return 0, split - 1
    parts = str(text).strip().split("-")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        first = last = None
    if first is None or first < 0 or last < first:
        raise RidgefillError(f"--filled-window-layers '{text}' is not a layer range: give first-last, e.g. 0-{split - 1}")
    if last >= split:
        raise RidgefillError(f"--filled-window-layers '{text}' reaches layer {last}, at or above the split {split}: "
                             f"windowed layers lie below the split (at most {split - 1})")
    return first, last


@dataclass(frozen=True)
class WindowBlock:
    """A block of windowed rows and the keys it reads: rows [g] chunk-relative, keys [k] cache positions, mask
    [g, k] additive (0 where a row may attend, -inf elsewhere)."""

    rows: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor


def block_size(window: int) -> int:
    """Rows per block: a block costs each of its rows up to (block + W) keys, and each block one attention call;
    a quarter of W, between 32 and 256 rows."""
    return max(32, min(256, window // 4))


def window_blocks(rows: torch.Tensor, positions: torch.Tensor, window: FilledWindow,
                  dtype: torch.dtype) -> list[WindowBlock]:
    """The blocks of a chunk's windowed rows `rows` [nW] (chunk-relative, ascending) at absolute `positions` [nW]."""
    blocks, size = [], block_size(window.size)
    for b0 in range(0, len(rows), size):
        pos = positions[b0:b0 + size]  # [g]
        lo, hi = int(pos[0]) - window.size, int(pos[-1])
        keys = torch.arange(max(lo, 0), hi + 1, device=pos.device)
        sinks = torch.arange(min(window.sinks, max(lo, 0)), device=pos.device)
        keys = torch.cat([sinks, keys])  # [k] the sinks before the band, then the band
        allowed = (keys.unsqueeze(0) <= pos.unsqueeze(1)) & (
            (keys.unsqueeze(0) >= pos.unsqueeze(1) - window.size) | (keys.unsqueeze(0) < window.sinks))
        mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device).masked_fill_(~allowed, float("-inf"))
        blocks.append(WindowBlock(rows[b0:b0 + size], keys, mask))
    return blocks


def windowed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: list[WindowBlock],
                       scale: float, out: torch.Tensor) -> None:
    """Write into `out` [B, Hq, n, D] the attention of each block's rows (q [B, Hq, n, D], the chunk's queries) over
    its keys among the cached `keys` / `values` [B, Hkv, n_keys, D]."""
    gqa = q.shape[1] != keys.shape[1]
    for b in blocks:
        k, v = keys.index_select(2, b.keys), values.index_select(2, b.keys)  # [B, Hkv, k, D]
        attn = F.scaled_dot_product_attention(q.index_select(2, b.rows), k, v, attn_mask=b.mask, scale=scale,
                                              enable_gqa=gqa)
        out.index_copy_(2, b.rows, attn)
