"""The dense families' torchfill tests (tiny random-init models); the invariants every family keeps are in
test_invariants.py."""

import pytest
import torch

from tiny_models import random_ids, tiny_model
from helpers import TOL, assert_caches_equal, runner_for, hf_hidden
from ridgefill.torchfill import FillPlan, IdentityFiller, adapter_for
from ridgefill.torchfill.fill_plan import FillTally
from ridgefill.errors import RidgefillError


def test_identity_fill_differs_only_after_split(dense_model):
    ids = random_ids(24)
    eng = runner_for(dense_model)
    exact = eng.prefill(ids)
    split = 3
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(split, eng.n_layers), tail=4))
    for layer in range(split + 1):  # layers 0..S-1 run exactly; layer S's map is the identity
        assert (filled.cache[layer].keys - exact.cache[layer].keys).abs().max() <= TOL
    assert (filled.cache[split + 1].keys - exact.cache[split + 1].keys).abs().max() > 1e-3
    # tail rows of the filled cache differ downstream, filled rows differ from the exact cache
    assert (filled.logits - exact.logits).abs().max() > 1e-4


def test_errors_are_one_line():
    model = tiny_model("llama")
    eng = runner_for(model)
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

    from ridgefill.torchfill.attention import lower_right_causal, prefix_then_block

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
    runner = runner_for(dense_model, chunk=chunk)
    x = hf_hidden(dense_model, ids)[split][0]  # [N, H]: the split state (layers 0..S-1 are exact)
    plan = FillPlan(IdentityFiller(split, runner.n_layers), tail, (0,), outlier_factor=1.1)
    filled = (~plan.full_rows(ids.shape[1])).nonzero().squeeze(1)
    expected = []
    for c0 in range(0, ids.shape[1], chunk):  # the rule works per chunk, on that chunk's filled rows
        rows = filled[(filled >= c0) & (filled < c0 + chunk)]
        norms = x[rows].norm(dim=-1)
        expected += rows[norms > 1.1 * norms.median()].tolist()
    assert expected  # the factor is low enough that some rows are outliers
    rows = plan.full_rows(ids.shape[1]).nonzero().squeeze(1).tolist()  # the rows full before the split
    got = runner.prefill(ids, fill=plan, logits_at=rows)
    kept = runner.prefill(ids, fill=FillPlan(plan.filler, tail, (0, *expected)), logits_at=rows)
    assert got.n_outliers == len(expected) and got.n_filled == kept.n_filled
    assert (got.logits - kept.logits).abs().max() <= TOL
    assert_caches_equal(got.cache, kept.cache)
    assert plan.tally == FillTally(filled_tokens=got.n_filled, outlier_tokens=len(expected))


def test_outlier_factor_zero_or_huge_changes_nothing(dense_model):
    ids, runner = random_ids(40, seed=6), runner_for(dense_model)
    filler = IdentityFiller(3, runner.n_layers)
    plain = runner.prefill(ids, fill=FillPlan(filler, 8, (0,)))
    huge = runner.prefill(ids, fill=FillPlan(filler, 8, (0,), outlier_factor=1e9))
    assert huge.n_outliers == 0 and plain.n_filled == huge.n_filled
    assert (plain.logits - huge.logits).abs().max() == 0


def test_bad_keep_rows_are_refused_not_dropped(dense_model):
    runner, filler = runner_for(dense_model), IdentityFiller(3, 6)
    with pytest.raises(RidgefillError, match="keep row -1 is not a row index"):
        FillPlan(filler, 8, (-1,))
    with pytest.raises(RidgefillError, match="outside the 20-token prompt"):
        runner.prefill(random_ids(20), fill=FillPlan(filler, 8, (0, 25)))
    with pytest.raises(RidgefillError, match="outlier factor -1"):
        FillPlan(filler, 8, outlier_factor=-1)


# --- rows that are not one block ending at the last key ---------------------------------------------------------
def test_runs_of_consecutive_positions():
    from ridgefill.torchfill.chunk_rows import runs_of

    assert runs_of(torch.tensor([3, 4, 5, 9, 12, 13])) == [(0, 3, 5), (3, 4, 9), (4, 6, 13)]
    assert runs_of(torch.tensor([7])) == [(0, 1, 7)] and runs_of(torch.tensor([], dtype=torch.long)) == []


@pytest.mark.parametrize("route", ["cpu_split", "lower_right"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_by_runs_equals_the_masked_reference(route, kv_heads):
    """Rows at positions 0-2, 5, 9-13 and 19 (the last key) over 20 cached keys: each run a lower-right block by the
    causal route, equal to attention with an explicit causal mask at those positions."""
    import torch.nn.functional as F

    from ridgefill.torchfill.chunk_rows import attention_by_runs, runs_of

    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 5, 9, 10, 11, 12, 13, 19])
    q = torch.randn(2, 4, len(positions), 16, generator=g)
    k, v = torch.randn(2, kv_heads, 20, 16, generator=g), torch.randn(2, kv_heads, 20, 16, generator=g)
    mask = torch.arange(20).unsqueeze(0) <= positions.unsqueeze(1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=kv_heads != 4)
    assert (attention_by_runs(route, q, k, v, runs_of(positions), 0.3) - ref).abs().max() <= TOL


@pytest.mark.parametrize("window", [None, 6])
def test_kept_and_outlier_rows_take_the_causal_route_by_runs(dense_model, monkeypatch, window):
    """Kept rows mid-chunk and outliers (rows that are not one block ending at the last key) run by the causal route,
    one lower-right block per run of consecutive positions, never a masked SDPA call (on CUDA a masked call with GQA
    falls to the math backend and repeats the K/V prefix in float32); the prefill still equals the oracle fill (its
    exactness: tests/torchfill/test_invariants.py)."""
    import torch.nn.functional as F

    from ridgefill.torchfill import FilledWindow, OracleFiller
    from ridgefill.torchfill import chunk_rows

    ids, split = random_ids(40, seed=2), 3
    runner = runner_for(dense_model, chunk=16)
    exact = runner.prefill(ids, logits_at="full")
    masked, runs = [], []
    sdpa, by_runs = F.scaled_dot_product_attention, chunk_rows.attention_by_runs

    def recording_sdpa(*args, attn_mask=None, **kwargs):
        if isinstance(attn_mask, torch.Tensor):
            masked.append(attn_mask.shape)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(chunk_rows, "attention_by_runs", lambda *a: runs.append(a[4]) or by_runs(*a))
    keep = (5, 6, 7, 20, 33)  # a run of three and single rows, in chunks 0, 1 and 2
    filler = OracleFiller(split, hf_hidden(dense_model, ids))
    if window is None:
        plan = FillPlan(filler, tail=4, keep_rows=keep)
        got = runner.prefill(ids, fill=plan, logits_at="full")
        assert (got.logits - exact.logits[:, got.rows]).abs().max() <= TOL
        assert not masked
    else:  # the window's "blocks" route masks its own key blocks (window_blocks): those masks span a block's keys
        plan = FillPlan(filler, tail=4, keep_rows=keep, window=FilledWindow(window, 0, split - 1))
        runner.prefill(ids, fill=plan, logits_at="full")
        assert all(shape[-1] <= window + 1 + 32 + 1 for shape in masked)  # never a chunk's whole prefix
    assert [(0, 3, 7)] in runs and [(0, 1, 20)] in runs  # the kept rows' runs (chunk-relative rows, positions)
