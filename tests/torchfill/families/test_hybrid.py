"""The hybrid families' torchfill tests on tiny random-init models (Gated DeltaNet + gated full attention): Qwen3.5 and
Qwen3-Next (MoE MLP with a shared expert), plus the chunked gated delta rule against a per-token reference. The
invariants every family keeps are in test_invariants.py."""

import pytest
import torch
import torch.nn.functional as F

from tiny_models import A, HYBRID_FAMILIES, L, random_ids, tiny_model
from helpers import TOL, TOL_REORDERED, assert_caches_equal, runner_for, hf_hidden, max_diff
from ridgefill.torchfill import FillPlan, HybridAdapter, IdentityFiller, OracleFiller, StateCache, adapter_for
from ridgefill.torchfill.families.delta_rule import causal_conv, chunk_gated_delta_rule


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid_model(request):
    return tiny_model(request.param)


# --- the layer mix ---------------------------------------------------------------------------------------
def test_adapter_describes_the_layer_mix(hybrid_model):
    adapter = adapter_for(hybrid_model)
    assert isinstance(adapter, HybridAdapter)
    assert adapter.describe()["layer_kinds"] == ["linear", "linear", "attention", "linear", "linear", "attention"]
    assert adapter.filled_attention_layers(3) == [5]
    assert adapter.filled_attention_layers(1) == [2, 5]


# --- the identity fill -------------------------------------------------------------------------------------
def test_identity_fill_changes_states_after_split(hybrid_model):
    ids = random_ids(24)
    eng = runner_for(hybrid_model)
    exact = eng.prefill(ids)
    split = 3
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(split, eng.n_layers), tail=4))
    def state(cache, layer):  # K for attention layers, the recurrent state for linear ones
        return cache[layer].keys if cache[layer].kind == "attention" else cache[layer].recurrent

    for layer in range(split + 1):  # layers 0..S-1 exact; layer S's input is the split state itself
        assert max_diff(state(filled.cache, layer), state(exact.cache, layer)) <= TOL
    for layer in (4, 5):  # linear, then attention: both saw predicted (identity) inputs
        assert max_diff(state(filled.cache, layer), state(exact.cache, layer)) > 1e-4
    assert max_diff(filled.logits, exact.logits) > 1e-5


# --- the delta rule and the conv ------------------------------------------------------------------------
def naive_gated_delta_rule(q, k, v, g, beta, state):
    """One token at a time, straight from the recurrence (fp32). Shapes as chunk_gated_delta_rule."""
    hv, hk, dk = v.shape[2], k.shape[2], k.shape[3]
    q = q.repeat_interleave(hv // hk, dim=2).float()
    k = k.repeat_interleave(hv // hk, dim=2).float()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk**0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = state.clone()  # [B, Hv, Dk, Dv]
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]  # decay
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])  # what the state mispredicts
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * err)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(outs, dim=1), s


@pytest.mark.parametrize("n,chunk_size", [(1, 64), (5, 64), (64, 64), (100, 64), (37, 8)])
def test_chunked_delta_rule_matches_naive(n, chunk_size):
    g_ = torch.Generator().manual_seed(n)
    b, hk, hv, dk, dv = 2, 2, 4, 8, 6
    q, k = torch.randn(b, n, hk, dk, generator=g_), torch.randn(b, n, hk, dk, generator=g_)
    v = torch.randn(b, n, hv, dv, generator=g_)
    g = -torch.rand(b, n, hv, generator=g_) * 2  # log decay in (-2, 0]
    beta = torch.rand(b, n, hv, generator=g_)
    state = torch.randn(b, hv, dk, dv, generator=g_)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    ref_out, ref_final = naive_gated_delta_rule(q, k, v, g, beta, state)
    # The chunked form reassociates sums (triangular solve, cumulative log decays): fp32 rounding of O(1)
    # values compounded over up to 100 steps stays well under 1e-4 but can exceed 1e-5.
    assert max_diff(out, ref_out) <= 1e-4
    assert max_diff(final, ref_final) <= 1e-4
    # in two pieces, the state carried over
    cut = n // 2
    out1, mid = chunk_gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state,
                                       chunk_size=chunk_size)
    out2, end = chunk_gated_delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], mid,
                                       chunk_size=chunk_size)
    assert max_diff(torch.cat([out1, out2], dim=1), ref_out) <= 1e-4
    assert max_diff(end, ref_final) <= 1e-4


def test_causal_conv_continues_from_its_state():
    g_ = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 11, generator=g_), torch.randn(5, 4, generator=g_)
    ref = F.silu(F.conv1d(x, w.unsqueeze(1), padding=3, groups=5)[..., :11])  # zero-padded causal conv
    state, outs = None, []
    for piece in (x[..., :2], x[..., 2:3], x[..., 3:11]):  # shorter and longer than the kernel
        out, state = causal_conv(piece, w, None, state, F.silu)
        outs.append(out)
    assert max_diff(torch.cat(outs, dim=-1), ref) <= 1e-6
    assert torch.equal(state, x[..., -3:])


# --- no attention layer in the filled range ---------------------------------------------------------------
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_filled_range_without_attention_layers(family):
    model = tiny_model(family, layer_types=[L, A, L, L, L, L])
    eng = runner_for(model, chunk=8)
    split = 2
    assert eng.adapter.filled_attention_layers(split) == []
    ids = random_ids(30)
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(split, eng.n_layers), tail=3, keep_rows=(10,)),
                         logits_at="full")
    assert filled.n_filled == 26
    assert torch.isfinite(filled.logits).all()
    exact = eng.prefill(ids, logits_at="full")
    # the filled rows still reach the tail through the late layers' states
    assert max_diff(filled.logits, exact.logits[:, filled.rows]) > 1e-5
    oracle = FillPlan(OracleFiller(split, hf_hidden(model, ids)), tail=3, keep_rows=(10,))
    assert_caches_equal(eng.prefill(ids, fill=oracle).cache, exact.cache, TOL_REORDERED)


# --- StateCache ----------------------------------------------------------------------------------------------
def test_state_cache_clone_and_replace(hybrid_model):
    eng = runner_for(hybrid_model)
    cache = eng.prefill(random_ids(9)).cache
    layer = cache[0]
    assert isinstance(layer, StateCache) and layer.kind == "state" and layer.length == 9
    copy = cache.clone()[0]
    before = layer.recurrent.clone()
    layer.replace(recurrent=torch.zeros_like(layer.recurrent), conv=torch.ones_like(layer.conv))
    assert torch.equal(copy.recurrent, before) and copy.length == 9  # the clone is independent
    assert layer.recurrent.abs().max() == 0 and torch.equal(layer.conv, torch.ones_like(layer.conv))
