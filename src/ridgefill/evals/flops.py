"""The FLOP count of a prefill and its first token, which bounds the speedup a fill can reach (bench-ttft).

FLOPs are multiply-adds × 2, from the model's shapes (engine.ModelShape); norms, RoPE, softmax, gates, the delta
rule's decays and other elementwise work are not counted. Per row and layer:
- an attention layer: Q (with a hybrid's output gate: 2·Hq·D outputs), K, V, O projections, and attention
  4·Hq·D·(p+1) for a row at position p (QKᵀ and AV over its p+1 causal keys);
- a linear (Gated DeltaNet) layer: its mixer's input projections (q, k, v, z; beta, decay), the depthwise conv,
  the delta rule (per value head: kᵀS, the rank-1 update and qᵀS, 3 × 2·Dk·Dv) and, the mixer's output, out_proj;
- the MLP: gate, up, down of the dense MLP, or a sparse MoE's router, its top-k experts and the shared expert;
plus the LM head of the last row. A filled row skips attention, the MLP and the Q and O projections in the
attention layers S..L-1 but keeps their K and V projections; in the linear layers S..L-1 it runs the mixer's
input projections, conv and delta rule (its state update) but not out_proj or the MLP. It adds its maps (the
filler's `flops_per_row`, engine.maps_flops: 2·F·H per late layer S+1..L-1 for full-rank maps of F = (K+1)·H
inputs (lookback K; F = H without), 2·r·(F+H) for rank r, none for identity fill; none for the mean control,
whose inputs are constants). The drop control's filled rows cost nothing in layers S..L-1 (no K/V, no state
update) and the full rows there attend only to full rows. With a filled window (torchfill/window.py), a filled row
in a windowed attention layer below the split attends to keys_per_row(p) keys (itself, the W rows before it, the
sinks) instead of p+1.
"""

from __future__ import annotations

import numpy as np

from ridgefill.torchfill import FilledWindow, ModelShape
from ridgefill.torchfill.shape import HybridShape


def row_flops(shape: ModelShape) -> dict[str, int]:
    """FLOPs of one row through one attention layer's projections and a dense MLP (gate, up, down)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    gate = q if shape.hybrid is not None and shape.hybrid.q_gate else 0
    return {"q": 2 * h * (q + gate), "k": 2 * h * kv, "v": 2 * h * kv, "o": 2 * q * h,
            "mlp": 3 * 2 * h * (shape.intermediate or 0)}


def mlp_flops(shape: ModelShape, layer: int) -> int:
    """One row through layer `layer`'s MLP: dense, or a sparse MoE (router, top-k experts, shared expert)."""
    hy, h = shape.hybrid, shape.hidden
    if hy is None or not hy.moe_layers or not hy.moe_layers[layer]:
        return row_flops(shape)["mlp"]
    shared = 6 * h * hy.shared_intermediate + (2 * h if hy.shared_intermediate else 0)  # + its sigmoid gate
    return 2 * h * hy.experts + hy.experts_per_token * 6 * h * hy.expert_intermediate + shared


def linear_mixer_flops(shape: ModelShape) -> dict[str, int]:
    """One row through a Gated DeltaNet layer's mixer: `state` (what updates the recurrent and conv states: input
    projections, conv, delta rule) and `out` (out_proj)."""
    hy, h = shape.hybrid, shape.hidden
    key, value = hy.key_heads * hy.key_dim, hy.value_heads * hy.value_dim
    project = 2 * h * (2 * key + 2 * value + 2 * hy.value_heads)  # q, k, v, z; beta and decay per value head
    conv = 2 * (2 * key + value) * hy.conv_kernel
    delta = 3 * 2 * hy.value_heads * hy.key_dim * hy.value_dim
    return {"state": project + conv + delta, "out": 2 * value * h}


def attention_flops(shape: ModelShape, positions: np.ndarray) -> int:
    """QKᵀ and AV of rows at `positions` over their causal keys, in one layer."""
    return 4 * shape.heads * shape.head_dim * int((positions.astype(np.int64) + 1).sum())


def prefill_flops(shape: ModelShape, length: int, full: np.ndarray | None = None, split: int | None = None,
                  map_flops: int = 0, drops: bool = False, window: FilledWindow | None = None) -> int:
    """FLOPs of a prefill of `length` rows and its first token. full: [length] bool, the rows that run every
    layer of a filled prefill at `split` (None: exact); map_flops: one filled row's maps; drops: the drop control
    (filled rows write nothing in the late layers, whose full rows attend to full rows only); window: the filled
    rows' local attention below the split."""
    every = np.arange(length)
    lm_head = 2 * shape.hidden * shape.vocab
    if full is None or split is None or split >= shape.layers or full.all():
        return sum(_layer_flops(shape, layer, length, every) for layer in range(shape.layers)) + lm_head
    full_pos, filled = every[full], every[~full]
    windowed = set(window.layers(split)) if window is not None else set()
    n_fill, total = len(filled), 0
    for layer in range(shape.layers):
        if layer < split:
            total += _layer_flops(shape, layer, length, every)
            if layer in windowed and shape.layer_kinds[layer] == "attention":  # filled rows attend to fewer keys
                total -= 4 * shape.heads * shape.head_dim * int((filled + 1 - window.keys_per_row(filled)).sum())
        elif drops:  # the late layers hold full rows only: the i-th full row attends to i+1 keys
            total += _layer_flops(shape, layer, len(full_pos), np.arange(len(full_pos)))
        else:
            total += _layer_flops(shape, layer, len(full_pos), full_pos) + n_fill * _filled_row_flops(shape, layer)
    return total + (0 if drops else n_fill * map_flops) + lm_head


def _layer_flops(shape: ModelShape, layer: int, rows: int, positions: np.ndarray) -> int:
    """`rows` full rows at `positions` through one layer."""
    row = row_flops(shape)
    if shape.layer_kinds[layer] == "linear":
        mixer = linear_mixer_flops(shape)
        return rows * (mixer["state"] + mixer["out"] + mlp_flops(shape, layer))
    return rows * (row["q"] + row["k"] + row["v"] + row["o"] + mlp_flops(shape, layer)) + \
        attention_flops(shape, positions)


def _filled_row_flops(shape: ModelShape, layer: int) -> int:
    """A filled row in a late layer: its K and V (attention), or its mixer's state update (linear)."""
    if shape.layer_kinds[layer] == "linear":
        return linear_mixer_flops(shape)["state"]
    row = row_flops(shape)
    return row["k"] + row["v"]


def described_shape(model: dict, config: dict) -> ModelShape | None:
    """The ModelShape of a model described as a result document's `model` records it (the adapter's describe():
    layers, widths, heads, layer kinds) with its config.json (`config`, {} when not at hand: the MLP width and
    vocabulary, and a hybrid's linear layers and MLPs); None when any of them is unknown."""
    names = ("layers", "hidden_size", "heads", "kv_heads", "head_dim")
    if not all(isinstance(model.get(k), int) for k in names):
        return None
    config = config.get("text_config") or config
    intermediate = model.get("intermediate_size") or config.get("intermediate_size")
    vocab = model.get("vocab_size") or config.get("vocab_size")
    if not isinstance(intermediate, int) or not isinstance(vocab, int):
        return None
    kinds = tuple(model.get("layer_kinds") or ())
    hybrid = None
    if any(kind != "attention" for kind in kinds):  # a hybrid: its linear layers and MLPs from its config.json
        try:
            hybrid = HybridShape.from_config(config, model["layers"])
        except KeyError:
            return None
    return ModelShape(*(model[k] for k in names), intermediate, vocab, kinds, hybrid)
