"""The null controls (torchfill/fillers.py): drop (filled rows write nothing in layers S..L-1) and mean (every filled
row's late input is the calibration mean), checked against transformers' own layers and against their definitions
(drop's chunk invariance on the dense families: test_invariants.test_chunked_equals_unchunked)."""

import numpy as np
import pytest
import torch

from tiny_models import HYBRID_FAMILIES, random_ids, tiny_model
from helpers import TOL, runner_for
from ridgefill.torchfill import DropFiller, FillPlan, MapFiller, MeanFiller, ModelShape
from ridgefill.evals.flops import prefill_flops


def hf_layers(model, h, layers, positions):
    """transformers' own decoder layers over the rows at `positions` [N] (h [1, N, H]), each row attending to the
    rows given at or before its position."""
    inner = model.model
    pos = positions.unsqueeze(0)
    cos_sin = inner.rotary_emb(h, pos)
    hidden = positions.unsqueeze(0) > positions.unsqueeze(1)  # [N, N] key after query
    mask = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))[None, None]
    for layer in layers:
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        h = out[0] if isinstance(out, tuple) else out
    return h


@torch.no_grad()
def drop_reference(model, ids, split, full):
    """Logits of the full rows when the filled rows are absent from layers S..L-1: layers 0..S-1 on every row, then
    layers S..L-1 on the full rows alone, at their true positions."""
    inner = model.model
    positions = torch.arange(ids.shape[1])
    h = hf_layers(model, inner.embed_tokens(ids), inner.layers[:split], positions)
    h = hf_layers(model, h[:, full], inner.layers[split:], positions[full])
    return model.lm_head(inner.norm(h))


@pytest.mark.parametrize("split,tail,keep", [(2, 5, (0,)), (3, 7, (0, 11)), (1, 1, ())])
def test_drop_equals_the_late_layers_run_on_the_full_rows_alone(dense_model, split, tail, keep):
    ids = random_ids(30)
    eng = runner_for(dense_model)
    plan = FillPlan(DropFiller(split, eng.n_layers), tail=tail, keep_rows=keep)
    out = eng.prefill(ids, fill=plan, logits_at="full")
    full = plan.full_rows(30)
    ref = drop_reference(dense_model, ids, split, full)
    assert out.logits.shape == ref.shape
    assert (out.logits - ref).abs().max() <= TOL
    assert out.n_filled == int((~full).sum())
    for layer in range(eng.n_layers):  # the late caches hold the full rows only
        assert out.cache[layer].length == (30 if layer < split else int(full.sum()))


def test_decode_after_drop_sees_the_full_rows_only(dense_model):
    ids = random_ids(24)
    eng = runner_for(dense_model)
    plan = FillPlan(DropFiller(3, eng.n_layers), tail=4)
    pre = eng.prefill(ids, fill=plan)
    nxt = pre.logits[:, -1].argmax(-1, keepdim=True)
    logits = eng.decode_step(pre.cache, nxt)
    full = torch.cat([plan.full_rows(24), torch.tensor([True])])
    ref = drop_reference(dense_model, torch.cat([ids, nxt], dim=1), 3, full)[:, -1]
    assert (logits - ref).abs().max() <= TOL


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_drop_on_a_hybrid_model_is_chunk_invariant_and_skips_the_filled_rows(family):
    ids = random_ids(40)
    eng = runner_for(tiny_model(family))
    split = 2
    plan = FillPlan(DropFiller(split, eng.n_layers), tail=9, keep_rows=(0,))
    whole = eng.prefill(ids, fill=plan, logits_at="full", chunk=4096)
    for chunk in (5, 16):
        parts = eng.prefill(ids, fill=plan, logits_at="full", chunk=chunk)
        assert (whole.logits - parts.logits).abs().max() <= 1e-4  # the chunked delta rule sums in another order
    means = torch.zeros(eng.n_layers - split - 1, eng.shape.hidden)
    kept = eng.prefill(ids, fill=FillPlan(MeanFiller(split, eng.n_layers, means), tail=9, keep_rows=(0,)),
                       logits_at="full")
    assert (whole.logits - kept.logits).abs().max() > 1e-3  # filled rows pass the linear layers' states
    for layer in range(split, eng.n_layers):
        if eng.layer_kinds[layer] == "attention":
            assert whole.cache[layer].length == 10


def test_mean_is_the_map_with_zero_weights(dense_model):
    ids = random_ids(30)
    eng = runner_for(dense_model)
    split, hidden = 2, eng.shape.hidden
    means = torch.randn(eng.n_layers - split - 1, hidden)
    zero = MapFiller(split, eng.n_layers, torch.zeros(eng.n_layers - split - 1, hidden, hidden), means)
    mean = eng.prefill(ids, fill=FillPlan(MeanFiller(split, eng.n_layers, means), tail=6), logits_at="full")
    ref = eng.prefill(ids, fill=FillPlan(zero, tail=6), logits_at="full")
    assert (mean.logits - ref.logits).abs().max() <= TOL
    x = torch.randn(1, 3, hidden)  # the row is ignored: every late input is the mean, layer S gets x
    late = MeanFiller(split, eng.n_layers, means).late_inputs(x, torch.arange(3))
    assert torch.equal(late[0], x[0]) and torch.equal(late[1:], means.unsqueeze(1).expand(-1, 3, -1))


def test_control_flops_match_a_hand_count():
    shape = ModelShape(layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)
    full = np.array([True, False, True])
    # layer 0 exact over 3 rows: 3·288 + 4·2·2·(1+2+3) = 960. Layer 1, drop: rows 0 and 2 alone, keys 1 and 2:
    # 2·288 + 4·2·2·(1+2) = 624, nothing for row 1; LM head 80
    assert prefill_flops(shape, 3, full, split=1, drops=True) == 960 + 624 + 80
    # mean and identity: row 1 keeps its K, V (2·16); rows 0, 2 attend over keys 1 and 3: 576 + 16·4 + 32 = 672
    assert prefill_flops(shape, 3, full, split=1) == 960 + 672 + 80
    assert DropFiller(1, 2).flops_per_row() == 0 and MeanFiller(1, 3, torch.zeros(1, 4)).flops_per_row() == 0
