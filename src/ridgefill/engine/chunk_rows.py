"""A chunk's rows inside the engine's prefill: which run a layer, which are filled, their positions and RoPE, and
the attention of the rows that run (causal over the cached keys, or local in a filled window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridgefill.engine.attention import FLASH_CPU, lower_right_causal, prefix_then_block
from ridgefill.engine.window import FilledWindow, WindowBlock, window_blocks, windowed_attention


class ChunkRows:
    """Bookkeeping of a chunk's rows: which run the layer, which are filled, their positions and RoPE."""

    def __init__(self, n, idx_full, idx_fill, positions, cos, sin, split_done=False, dropped=False):
        """dropped (after the split of a drop fill): the late layers' caches hold full rows only, so the run rows
        are the last of their keys, in order, whatever their positions."""
        self.n, self.idx_full, self.idx_fill = n, idx_full, idx_fill
        self.positions, self.cos, self.sin = positions, cos, sin
        self.split_done = split_done
        run = idx_full if split_done else slice(None)
        self.positions_run = positions[run]
        self.cos_run, self.sin_run = cos[:, run], sin[:, run]
        self.cos_fill, self.sin_fill = cos[:, idx_fill], sin[:, idx_fill]
        # are the run rows the last keys of every layer's cache, in order? Always before the split (every row runs and
        # was just appended) and after a drop fill's split (the late caches hold full rows only); else found on use
        self._block: bool | None = True if dropped or not split_done else None
        self._mask: torch.Tensor | None = None  # additive causal mask of the run rows, built once per chunk
        self._local: list[WindowBlock] = []  # the windowed rows' blocks (before the split, with a window)
        self._others: torch.Tensor | None = None  # [nO] the rows that attend to everything beside them
        self._others_mask: torch.Tensor | None = None  # [nO, n_keys] their causal mask, built once per chunk

    def windowed(self, rows: torch.Tensor, window: FilledWindow, dtype: torch.dtype) -> None:
        """Make `rows` [nW] (chunk-relative) attend locally in `window` in the layers that ask (attend_locally)."""
        self._local = window_blocks(rows, self.positions[rows], window, dtype)
        others = torch.ones(self.n, dtype=torch.bool, device=rows.device)
        others[rows] = False
        self._others = others.nonzero().squeeze(1)

    @property
    def positions_full(self) -> torch.Tensor:
        return self.positions_run

    def after_split(self, dropped: bool = False) -> "ChunkRows":
        return ChunkRows(self.n, self.idx_full, self.idx_fill, self.positions, self.cos, self.sin, True, dropped)

    def merge(self, full_part: torch.Tensor, fill_part: torch.Tensor, dim: int) -> torch.Tensor:
        """Interleave full-row and filled-row tensors back into chunk row order along `dim`."""
        shape = list(full_part.shape)
        shape[dim] = self.n
        out = full_part.new_empty(shape)
        out.index_copy_(dim, self.idx_full, full_part)
        out.index_copy_(dim, self.idx_fill, fill_part)
        return out

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of the run rows (q [B, Hq, nq, D]) over every cached key [B, Hkv, n_keys, D].

        SDPA's is_causal aligns top-left, right only when the queries are positions 0..n_keys-1. When the
        queries are the last nq positions (every row before the split; a tail that ends the chunk), the CPU
        path attends to the cached prefix without a mask and to the block itself causally, and merges the
        two by their log-sum-exp (no masked work, no mask); elsewhere (CUDA) SDPA gets torch's lower-right
        causal bias, which runs as a causal flash/efficient kernel. Any other query set gets an additive mask,
        built once per chunk and shared by every layer."""
        nq, n_keys = q.shape[2], keys.shape[2]
        gqa = q.shape[1] != keys.shape[1]
        if self._block is None:
            first, last = self.positions_run[[0, -1]].tolist() if nq else (0, -1)
            self._block = last == n_keys - 1 and last - first + 1 == nq
        if self._block and (nq == 1 or nq == n_keys):
            return F.scaled_dot_product_attention(q, keys, values, is_causal=nq > 1, scale=scale, enable_gqa=gqa)
        if self._block and q.device.type == "cpu" and hasattr(torch.ops.aten, FLASH_CPU):
            return prefix_then_block(q, keys, values, n_keys - nq, scale)
        if self._block:
            return lower_right_causal(q, keys, values, scale)
        if self._mask is None:
            self._mask = causal_mask(self.positions_run, n_keys, q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self._mask, scale=scale, enable_gqa=gqa)

    def attend_locally(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """Before the split, in a windowed layer: the windowed rows attend to their sinks and window
        (engine/window.py), every other row causally to every cached key. q [B, Hq, n, D] -> [B, Hq, n, D]."""
        out = torch.empty_like(q)
        windowed_attention(q, keys, values, self._local, scale, out)
        if len(self._others):
            if self._others_mask is None:
                self._others_mask = causal_mask(self.positions[self._others], keys.shape[2], q.dtype)
            attn = F.scaled_dot_product_attention(q.index_select(2, self._others), keys, values,
                                                  attn_mask=self._others_mask, scale=scale,
                                                  enable_gqa=q.shape[1] != keys.shape[1])
            out.index_copy_(2, self._others, attn)
        return out


def causal_mask(positions: torch.Tensor, n_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, n_keys] additive mask of query rows at `positions` [n] over keys 0..n_keys-1: -inf after each row."""
    later = torch.arange(n_keys, device=positions.device).unsqueeze(0) > positions.unsqueeze(1)
    return torch.zeros(later.shape, dtype=dtype, device=positions.device).masked_fill_(later, float("-inf"))
