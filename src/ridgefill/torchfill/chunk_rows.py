"""A chunk's rows inside the runner's prefill: which run a layer, which are filled, their positions and RoPE, and
the attention of the rows that run (causal over the cached keys, or local in a filled window)."""

from __future__ import annotations

import torch

from ridgefill.torchfill.attention import causal_attention
from ridgefill.torchfill.routes import Routes
from ridgefill.torchfill.window import (BAND_KERNELS, FilledWindow, WindowBlock, banded_attention, window_blocks,
                                        windowed_attention)


class ChunkRows:
    """Bookkeeping of a chunk's rows: which run the layer, which are filled, their positions and RoPE."""

    def __init__(self, n, idx_full, idx_fill, positions, cos, sin, routes: Routes, split_done=False, dropped=False):
        """routes: the runner's (torchfill/routes.py). dropped (after the split of a drop fill): the late layers'
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
        self._runs: list[Run] | None = None  # the run rows' runs of consecutive positions, found once per chunk
        self._window: FilledWindow | None = None  # with a window, before the split:
        self._start = 0  # the chunk's first position
        self._local: list[WindowBlock] = []  # the windowed rows' blocks ("blocks" route)
        self._others: torch.Tensor | None = None  # [nO] the rows that attend to everything beside them
        self._others_runs: list[Run] | None = None  # their runs of consecutive positions, found once per chunk
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
        routes' causal route (torchfill/attention.py: one flash call on CUDA, the log-sum-exp merge of prefix and
        block on the CPU). Any other query set (kept rows or outliers among filled rows, a tail after them) is
        taken by runs of consecutive positions, each the last rows of the keys up to its last position, so each is
        one lower-right causal block by the same route (`attention_by_runs`): never a masked SDPA call, which with
        GQA fell to CUDA's math backend and repeated the whole K/V prefix in float32. The runs are found once per
        chunk (one host read of the positions) and shared by every layer."""
        nq, n_keys = q.shape[2], keys.shape[2]
        if self._block is None:
            first, last = self.positions_run[[0, -1]].tolist() if nq else (0, -1)
            self._block = last == n_keys - 1 and last - first + 1 == nq
        if self._block:
            return causal_attention(self.routes.causal, q, keys, values, scale)
        if self._runs is None:
            self._runs = runs_of(self.positions_run)
        return attention_by_runs(self.routes.causal, q, keys, values, self._runs, scale)

    def attend_locally(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """Before the split, in a windowed layer: the windowed rows attend to their sinks and window
        (torchfill/window.py, by the routes' window route), every other row causally to every cached key.
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
            if self._others_runs is None:
                self._others_runs = runs_of(self.positions[self._others])
            attn = attention_by_runs(self.routes.causal, q.index_select(2, self._others), keys, values,
                                     self._others_runs, scale)
            out.index_copy_(2, self._others, attn)
        return out


Run = tuple[int, int, int]  # (first query row, end query row, last position): a run of consecutive positions


def runs_of(positions: torch.Tensor) -> list[Run]:
    """The runs of consecutive positions in `positions` [n] (ascending): (first row, end row, its last position)."""
    pos = positions.tolist()
    runs, first = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            runs.append((first, i, pos[i - 1]))
            first = i
    return runs


def attention_by_runs(route: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: list[Run],
                      scale: float) -> torch.Tensor:
    """Causal attention of query rows q [B, Hq, nq, D] made of `runs` over the cached keys/values [B, Hkv, n_keys, D]
    (key j at position j): a run of rows at positions p0..p1 is the last rows of keys 0..p1, one lower-right causal
    block by the causal `route` (torchfill/attention.py; GQA K/V as they are on the flash route). -> [B, Hq, nq, D]."""
    parts = [causal_attention(route, q[:, :, a:b], keys[:, :, :last + 1], values[:, :, :last + 1], scale)
             for a, b, last in runs]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, 2) if parts else torch.empty_like(q)
