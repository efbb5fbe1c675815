"""A chunk's rows inside the engine's prefill: which run a layer, which are filled, their positions and RoPE, and
the attention of the rows that run (causal over the cached keys, or local in a filled window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridgefill.engine.attention import causal_attention
from ridgefill.engine.routes import Routes
from ridgefill.engine.window import (BAND_KERNELS, FilledWindow, WindowBlock, banded_attention, window_blocks,
                                     windowed_attention)


class ChunkRows:
    """Bookkeeping of a chunk's rows: which run the layer, which are filled, their positions and RoPE."""

    def __init__(self, n, idx_full, idx_fill, positions, cos, sin, routes: Routes, split_done=False, dropped=False):
        """routes: the engine's (engine/routes.py). dropped (after the split of a drop fill): the late layers'
        caches hold full rows only, so the run rows are the last of their keys, in order, whatever their
        positions."""
        self.n, self.idx_full, self.idx_fill, self.routes = n, idx_full, idx_fill, routes
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
        self._window: FilledWindow | None = None  # with a window, before the split:
        self._start = 0  # the chunk's first position
        self._local: list[WindowBlock] = []  # the windowed rows' blocks ("blocks" route)
        self._others: torch.Tensor | None = None  # [nO] the rows that attend to everything beside them
        self._others_mask: torch.Tensor | None = None  # [nO, n_keys] their causal mask, built once per chunk
        self._suffix = 0  # band routes: how many of the others end the chunk (causal over every key, no mask)

    def windowed(self, local: torch.Tensor, start: int, window: FilledWindow, dtype: torch.dtype) -> None:
        """Make the rows where `local` [n] (bool, on the CPU) is True attend locally in `window` in the layers that
        ask (attend_locally); the chunk starts at position `start`."""
        device = self.positions.device
        self._window, self._start = window, start
        others = (~local).nonzero().squeeze(1)  # [nO] on the CPU: no device sync here
        if self.routes.window == "blocks":
            rows = local.nonzero().squeeze(1).to(device)
            self._local = window_blocks(rows, self.positions[rows], window, dtype)
        else:  # band routes: the others that end the chunk attend causally by the causal route
            tail = others.flip(0) == torch.arange(self.n - 1, self.n - 1 - len(others), -1)
            self._suffix = int(tail.cumprod(0).sum())
            others = others[:len(others) - self._suffix]
        self._others = others.to(device)

    @property
    def positions_full(self) -> torch.Tensor:
        return self.positions_run

    def after_split(self, dropped: bool = False) -> "ChunkRows":
        return ChunkRows(self.n, self.idx_full, self.idx_fill, self.positions, self.cos, self.sin, self.routes, True,
                         dropped)

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
        queries are the last nq positions (every row before the split; a tail that ends the chunk), the
        routes' causal route (engine/attention.py: one flash call on CUDA, the log-sum-exp merge of prefix and
        block on the CPU). Any other query set gets an additive mask, built once per chunk and shared by every
        layer."""
        nq, n_keys = q.shape[2], keys.shape[2]
        gqa = q.shape[1] != keys.shape[1]
        if self._block is None:
            first, last = self.positions_run[[0, -1]].tolist() if nq else (0, -1)
            self._block = last == n_keys - 1 and last - first + 1 == nq
        if self._block:
            return causal_attention(self.routes.causal, q, keys, values, scale)
        if self._mask is None:
            self._mask = causal_mask(self.positions_run, n_keys, q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self._mask, scale=scale, enable_gqa=gqa)

    def attend_locally(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """Before the split, in a windowed layer: the windowed rows attend to their sinks and window
        (engine/window.py, by the routes' window route), every other row causally to every cached key.
        q [B, Hq, n, D] -> [B, Hq, n, D]."""
        if self.routes.window == "blocks":
            out = torch.empty_like(q)
            windowed_attention(q, keys, values, self._local, scale, out)
        else:  # every row's band and sinks, then the others overwrite theirs
            out = banded_attention(q, keys, values, self._start, self.positions, self._window, scale,
                                   BAND_KERNELS[self.routes.window])
        if self._suffix:
            out[:, :, self.n - self._suffix:] = causal_attention(self.routes.causal, q[:, :, self.n - self._suffix:],
                                                                 keys, values, scale)
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
