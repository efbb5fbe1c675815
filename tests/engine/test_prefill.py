"""Engine invariants on tiny random-init models of every dense family."""

import pytest
import torch

from conftest import random_ids, tiny_model
from ridgefill.engine import DropFiller, Engine, FillPlan, IdentityFiller, OracleFiller, adapter_for
from ridgefill.errors import RidgefillError

TOL = 1e-5


def engine_for(model, chunk=2048):
    return Engine(adapter_for(model), chunk=chunk)


def hf_hidden(model, ids):
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states  # L+1 tensors [B, N, H]


def assert_caches_equal(a, b, tol=TOL):
    assert len(a) == len(b)
    for la, lb in zip(a.layers, b.layers):
        assert la.length == lb.length
        assert (la.keys - lb.keys).abs().max() <= tol
        assert (la.values - lb.values).abs().max() <= tol


def test_exact_prefill_matches_transformers(dense_model):
    ids = random_ids(37, batch=2)
    ref = dense_model(ids).logits
    out = engine_for(dense_model).prefill(ids, logits_at="full")
    assert out.logits.shape == ref.shape
    assert (out.logits - ref).abs().max() <= TOL
    assert out.n_filled == 0


@pytest.mark.parametrize("split", [2, 6])
def test_tail_covering_prompt_is_exact(dense_model, split):
    ids = random_ids(30)
    eng = engine_for(dense_model)
    exact = eng.prefill(ids, logits_at="full")
    plan = FillPlan(IdentityFiller(split, eng.n_layers), tail=30)
    filled = eng.prefill(ids, fill=plan, logits_at="full")
    assert filled.n_filled == 0
    assert (filled.logits - exact.logits).abs().max() <= TOL
    assert_caches_equal(filled.cache, exact.cache)


def test_split_at_last_layer_is_exact(dense_model):
    ids = random_ids(30)
    eng = engine_for(dense_model)
    exact = eng.prefill(ids, logits_at="last")
    plan = FillPlan(IdentityFiller(eng.n_layers, eng.n_layers), tail=4)
    filled = eng.prefill(ids, fill=plan)
    assert filled.n_filled == 0  # no late layer to fill
    assert (filled.logits - exact.logits).abs().max() <= TOL
    assert_caches_equal(filled.cache, exact.cache)


@pytest.mark.parametrize("split,tail,keep", [(1, 5, ()), (3, 7, (0, 1, 11)), (5, 1, (4,))])
def test_oracle_maps_are_exact(dense_model, split, tail, keep):
    ids = random_ids(33)
    eng = engine_for(dense_model, chunk=10)
    exact = eng.prefill(ids, logits_at="full")
    plan = FillPlan(OracleFiller(split, hf_hidden(dense_model, ids)), tail=tail, keep_rows=keep)
    filled = eng.prefill(ids, fill=plan, logits_at="full")
    assert filled.n_filled == 33 - tail - len(keep)
    ref = exact.logits[:, filled.rows]
    assert (filled.logits - ref).abs().max() <= TOL
    assert_caches_equal(filled.cache, exact.cache)


def test_identity_fill_differs_only_after_split(dense_model):
    ids = random_ids(24)
    eng = engine_for(dense_model)
    exact = eng.prefill(ids)
    split = 3
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(split, eng.n_layers), tail=4))
    for layer in range(split + 1):  # layers 0..S-1 run exactly; layer S's map is the identity
        assert (filled.cache[layer].keys - exact.cache[layer].keys).abs().max() <= TOL
    assert (filled.cache[split + 1].keys - exact.cache[split + 1].keys).abs().max() > 1e-3
    # tail rows of the filled cache differ downstream, filled rows differ from the exact cache
    assert (filled.logits - exact.logits).abs().max() > 1e-4


@pytest.mark.parametrize("filler", [IdentityFiller, DropFiller])  # drop: the late caches hold the full rows only
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_equals_unchunked(dense_model, chunk, filler):
    ids = random_ids(40)
    eng = engine_for(dense_model)
    plan = FillPlan(filler(2, eng.n_layers), tail=9, keep_rows=(0, 20))
    whole = eng.prefill(ids, fill=plan, logits_at="full", chunk=4096)
    parts = eng.prefill(ids, fill=plan, logits_at="full", chunk=chunk)
    assert torch.equal(whole.rows, parts.rows)
    assert (whole.logits - parts.logits).abs().max() <= TOL
    assert_caches_equal(whole.cache, parts.cache)


def test_greedy_after_full_tail_matches_transformers_generate(dense_model):
    ids = random_ids(12)
    eng = engine_for(dense_model)
    plan = FillPlan(IdentityFiller(3, eng.n_layers), tail=12)
    ours = eng.generate(ids, max_new_tokens=20, fill=plan)
    ref = dense_model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                               min_new_tokens=20)
    assert ours.tokens[0] == ref[0, 12:].tolist()


def test_decode_after_filled_prefill_runs_the_full_model(dense_model):
    ids = random_ids(20)
    eng = engine_for(dense_model)
    plan = FillPlan(OracleFiller(2, hf_hidden(dense_model, ids)), tail=3)
    pre = eng.prefill(ids, fill=plan)
    nxt = pre.logits[:, -1].argmax(-1, keepdim=True)
    logits = eng.decode_step(pre.cache, nxt)
    ref = dense_model(torch.cat([ids, nxt], dim=1)).logits[:, -1]
    assert (logits - ref).abs().max() <= TOL


def test_errors_are_one_line():
    model = tiny_model("llama")
    eng = engine_for(model)
    with pytest.raises(RidgefillError, match="^tail 0 must be an integer of at least 1"):
        eng.prefill(random_ids(10), fill=FillPlan(IdentityFiller(2, 6), tail=0))
    with pytest.raises(RidgefillError, match="out of range"):
        eng.prefill(random_ids(10), fill=FillPlan(IdentityFiller(9, 6), tail=2))
    with pytest.raises(RidgefillError, match="exceed the model's context"):
        eng.prefill(random_ids(513))
    with pytest.raises(RidgefillError, match="filled rows"):
        eng.prefill(random_ids(10), fill=FillPlan(IdentityFiller(2, 6), tail=2), logits_at=[0])


def test_unsupported_family_lists_supported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(RidgefillError, match="unsupported architecture 'gpt2'.*llama"):
        adapter_for(model)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_block_attention_paths_equal_the_masked_one(kv_heads):
    """Queries that are the last rows after a cached prefix: the CPU log-sum-exp merge and the lower-right causal
    bias (the CUDA path, here run on the CPU) equal attention with an explicit causal mask."""
    import torch.nn.functional as F

    from ridgefill.engine.attention import lower_right_causal, prefix_then_block

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 16, generator=g)
    k, v = torch.randn(2, kv_heads, 19, 16, generator=g), torch.randn(2, kv_heads, 19, 16, generator=g)
    mask = torch.arange(19).unsqueeze(0) <= torch.arange(12, 19).unsqueeze(1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=kv_heads != 4)
    assert (prefix_then_block(q, k, v, 12, 0.3) - ref).abs().max() <= TOL
    assert (lower_right_causal(q, k, v, 0.3) - ref).abs().max() <= TOL


# --- outlier rows and keep rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [64, 16])
def test_outlier_rows_run_in_full_like_keep_rows(dense_model, chunk):
    """A filled row whose split-state norm exceeds factor x the median of its chunk's filled rows runs in full:
    the prefill equals one that keeps exactly those rows, and the plan's tally counts them."""
    ids, split, tail = random_ids(48, seed=5), 3, 8
    engine = engine_for(dense_model, chunk=chunk)
    x = hf_hidden(dense_model, ids)[split][0]  # [N, H]: the split state (layers 0..S-1 are exact)
    plan = FillPlan(IdentityFiller(split, engine.n_layers), tail, (0,), outlier_factor=1.1)
    filled = (~plan.full_rows(ids.shape[1])).nonzero().squeeze(1)
    expected = []
    for c0 in range(0, ids.shape[1], chunk):  # the rule works per chunk, on that chunk's filled rows
        rows = filled[(filled >= c0) & (filled < c0 + chunk)]
        norms = x[rows].norm(dim=-1)
        expected += rows[norms > 1.1 * norms.median()].tolist()
    assert expected  # the factor is low enough that some rows are outliers
    rows = plan.full_rows(ids.shape[1]).nonzero().squeeze(1).tolist()  # the rows full before the split
    got = engine.prefill(ids, fill=plan, logits_at=rows)
    kept = engine.prefill(ids, fill=FillPlan(plan.filler, tail, (0, *expected)), logits_at=rows)
    assert got.n_outliers == len(expected) and got.n_filled == kept.n_filled
    assert (got.logits - kept.logits).abs().max() <= TOL
    assert_caches_equal(got.cache, kept.cache)
    assert plan.tally.to_dict() == {"filled_rows": got.n_filled, "outlier_rows_run_full": len(expected),
                                    "lookback_rows_run_full": 0}


def test_outlier_factor_zero_or_huge_changes_nothing(dense_model):
    ids, engine = random_ids(40, seed=6), engine_for(dense_model)
    filler = IdentityFiller(3, engine.n_layers)
    plain = engine.prefill(ids, fill=FillPlan(filler, 8, (0,)))
    huge = engine.prefill(ids, fill=FillPlan(filler, 8, (0,), outlier_factor=1e9))
    assert huge.n_outliers == 0 and plain.n_filled == huge.n_filled
    assert (plain.logits - huge.logits).abs().max() == 0


def test_bad_keep_rows_are_refused_not_dropped(dense_model):
    engine, filler = engine_for(dense_model), IdentityFiller(3, 6)
    with pytest.raises(RidgefillError, match="keep row -1 is not a row index"):
        FillPlan(filler, 8, (-1,))
    with pytest.raises(RidgefillError, match="outside the 20-token prompt"):
        engine.prefill(random_ids(20), fill=FillPlan(filler, 8, (0, 25)))
    with pytest.raises(RidgefillError, match="outlier factor -1"):
        FillPlan(filler, 8, outlier_factor=-1)
