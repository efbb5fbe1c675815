"""Lookback windows: the rows just before a filled row, whose split states its maps also read.

Maps fitted with lookback K (`calibrate --lookback K`) predict each late layer's input of row t from its own split
state x_t and from those of the K rows before it, x_{t-1}..x_{t-K} (its *window*). The first filled layers' inputs
carry what their attention copied from the preceding tokens (a previous-token head writes x_{t-1}'s content into
row t); a map of x_t alone cannot know it, a map of the window can.

A window is *whole* when each of its rows
- belongs to the same run of consecutive rows as row t (one runner chunk; one request's tokens in a vLLM step),
- sits at an absolute position >= `start` (calibration kept its first rows, the attention sinks, out of every
  window: `calibrate --skip-first`), and
- is not blocked (a split-state outlier: calibration kept those out too).
A filled row whose window is not whole runs the full model instead, as an outlier row does, so the maps never see
a window unlike the ones they were fitted on. That is at most K rows per chunk (or per request and step) and the
K rows after the sinks.
"""

from __future__ import annotations

import torch


def lookback_windows(positions: torch.Tensor, group: torch.Tensor, blocked: torch.Tensor, k: int,
                     start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of every row of a batch.

    positions [N]: each row's absolute position; group [N]: rows of one sequence share a value (a row's window
    may only hold rows of its group, at the K positions right before it); blocked [N] bool: rows no window may hold.
    Returns (index [N, K] long: row i's window, nearest first, as indices into the batch (clamped to 0 where the
    window is not whole), whole [N] bool)."""
    n = positions.shape[0]
    back = torch.arange(1, k + 1, device=positions.device)  # [K]
    index = torch.arange(n, device=positions.device).unsqueeze(1) - back  # [N, K]
    inside = index >= 0
    index = index.clamp(min=0)
    whole = inside & (group[index] == group.unsqueeze(1))
    whole &= positions[index] == positions.unsqueeze(1) - back
    whole &= positions[index] >= start
    whole &= ~blocked[index]
    return index, whole.all(dim=1)


def window_states(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, N, H] split states of a batch's rows, index [n, K] the windows of n of them -> [B, n, K·H], the
    window's states concatenated nearest first (the layout the maps' weights expect after x itself)."""
    b, _, h = x.shape
    n, k = index.shape
    return x[:, index.reshape(-1)].reshape(b, n, k * h)
