"""The FLOP count of a prefill and its first token, which bounds the speedup a fill can reach (bench-ttft).

FLOPs are multiply-adds × 2, from the model's shapes (engine.ModelShape); norms, RoPE, softmax and other
elementwise work are not counted. Per row and layer: Q, K, V, O projections and the MLP (gate, up, down);
attention 4·Hq·D·(p+1) for a row at position p (QKᵀ and AV over its p+1 causal keys); the LM head of the last
row. A filled row skips attention, MLP and the Q and O projections in layers S..L-1 but keeps their K and V
projections, and adds its maps (the filler's `flops_per_row`, engine.maps_flops: 2·F·H per late layer S+1..L-1
for full-rank maps of F = (K+1)·H inputs (lookback K; F = H without), 2·r·(F+H) for rank r, none for identity
fill; none for the mean control, whose inputs are constants). The drop control's filled rows cost nothing in
layers S..L-1 (no K/V) and the full rows there attend only to full rows. With a filled window (engine/window.py),
a filled row in a windowed layer below the split attends to keys_per_row(p) keys (itself, the W rows before it,
the sinks) instead of p+1. The count covers attention layers only (a hybrid model's linear layers have no count
here).
"""

from __future__ import annotations

import numpy as np

from ridgefill.engine import FilledWindow, ModelShape


def row_flops(shape: ModelShape) -> dict[str, int]:
    """FLOPs of one row through one layer's projections and MLP (gate, up, down)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"q": 2 * h * q, "k": 2 * h * kv, "v": 2 * h * kv, "o": 2 * q * h, "mlp": 3 * 2 * h * shape.intermediate}


def attention_flops(shape: ModelShape, positions: np.ndarray) -> int:
    """QKᵀ and AV of rows at `positions` over their causal keys, in one layer."""
    return 4 * shape.heads * shape.head_dim * int((positions.astype(np.int64) + 1).sum())


def prefill_flops(shape: ModelShape, length: int, full: np.ndarray | None = None, split: int | None = None,
                  map_flops: int = 0, drops: bool = False, window: FilledWindow | None = None) -> int:
    """FLOPs of a prefill of `length` rows and its first token. full: [length] bool, the rows that run every
    layer of a filled prefill at `split` (None: exact); map_flops: one filled row's maps; drops: the drop control
    (filled rows write nothing in the late layers, whose full rows attend to full rows only); window: the filled
    rows' local attention below the split."""
    row = row_flops(shape)
    every = np.arange(length)
    exact_layer = length * sum(row.values()) + attention_flops(shape, every)
    lm_head = 2 * shape.hidden * shape.vocab
    if full is None or split is None or split >= shape.layers or full.all():
        return shape.layers * exact_layer + lm_head
    full_pos, n_fill = every[full], int((~full).sum())
    if window is not None:  # the windowed layers' filled rows attend to fewer keys
        filled = every[~full]
        saved = 4 * shape.heads * shape.head_dim * int((filled + 1 - window.keys_per_row(filled)).sum())
        return prefill_flops(shape, length, full, split, map_flops, drops) - len(window.layers(split)) * saved
    if drops:  # the late caches hold full rows only: the i-th full row attends to i+1 keys
        late = len(full_pos) * sum(row.values()) + attention_flops(shape, np.arange(len(full_pos)))
        return split * exact_layer + (shape.layers - split) * late + lm_head
    late = len(full_pos) * sum(row.values()) + attention_flops(shape, full_pos) + n_fill * (row["k"] + row["v"])
    return split * exact_layer + (shape.layers - split) * late + n_fill * map_flops + lm_head
