"""The FLOP count of hybrid models (evals/flops.py): Gated DeltaNet layers, the output gate, MoE MLPs."""

from __future__ import annotations

import numpy as np

from tiny_models import tiny_model
from ridgefill.torchfill import ModelShape, adapter_for
from ridgefill.torchfill.shape import HybridShape
from ridgefill.evals.flops import prefill_flops

HYBRID = HybridShape(q_gate=True, key_heads=1, value_heads=2, key_dim=2, value_dim=2, conv_kernel=3,
                     moe_layers=(False, True), experts=4, experts_per_token=2, expert_intermediate=2,
                     shared_intermediate=3)
SHAPE = ModelShape(layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10,
                   layer_kinds=("linear", "attention"), hybrid=HYBRID)


def test_hybrid_flops_match_a_hand_count():
    # attention layer per row: q with its gate 2·4·8 = 64, k 16, v 16, o 32 = 128; attention 4·2·2·(p+1) = 16(p+1).
    # MLPs: layer 0 dense 6·4·8 = 192; layer 1 MoE: router 2·4·4 = 32, 2 experts 2·6·4·2 = 96, shared 6·4·3 = 72
    # and its gate 8: 208. Linear mixer: in-projections 2·4·(2+2+4+4+2+2) = 128, conv 2·(2+2+4)·3 = 48, delta rule
    # 3·2·2·2·2 = 48: state 224; out_proj 2·4·4 = 32. LM head 2·4·10 = 80.
    assert prefill_flops(SHAPE, 3) == 3 * (224 + 32 + 192) + 3 * (128 + 208) + 16 * 6 + 80
    full = np.array([True, False, True])
    # split 1: the filled row keeps its K and V (32) in layer 1; rows 0 and 2 attend over 1 and 3 keys
    assert prefill_flops(SHAPE, 3, full, split=1, map_flops=5) == 1344 + 2 * 336 + 16 * 4 + 32 + 5 + 80
    # split 0: in the linear layer the filled row updates the state (224) and skips out_proj and the MLP
    assert prefill_flops(SHAPE, 3, full, split=0) == 2 * 448 + 224 + 2 * 336 + 16 * 4 + 32 + 80
    # drop: the filled row costs nothing in the late layers, the full rows attend to each other (keys 1 and 2)
    assert prefill_flops(SHAPE, 3, full, split=0, drops=True) == 2 * 448 + 2 * 336 + 16 * 3 + 80


def test_the_shape_of_a_qwen3_next_model_reads_its_config():
    model = tiny_model("qwen3_next")  # layers L L A L L A, a dense MLP in layer 1, 4 experts top-2
    shape = ModelShape.of(adapter_for(model))
    assert shape.layer_kinds == ("linear", "linear", "attention", "linear", "linear", "attention")
    assert shape.hybrid == HybridShape(True, 2, 4, 16, 16, 4, (True, False, True, True, True, True), 4, 2, 32, 48)
    assert prefill_flops(shape, 64, np.arange(64) >= 40, split=3) < prefill_flops(shape, 64)
