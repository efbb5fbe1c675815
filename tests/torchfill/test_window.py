"""Local attention for filled rows below the split (torchfill/window.py): checked against transformers' own layers
with the window as an explicit mask, for chunk invariance, and for the O(rows x W) work it promises. Both window
routes run here: "blocks" (the CPU's) and "masked_band" (the CUDA band route's logic with its band kernel's exact
stand-in; torchfill/routes.py)."""

import numpy as np
import pytest
import torch

from tiny_models import HYBRID_FAMILIES, random_ids, tiny_model
from ridgefill.torchfill import DropFiller, Runner, FilledWindow, FillPlan, IdentityFiller, ModelShape, adapter_for
from ridgefill.torchfill.window import block_size, parse_layers, window_blocks
from ridgefill.errors import RidgefillError
from ridgefill.evals.flops import prefill_flops

TOL = 1e-5
ROUTES = ["blocks", "masked_band"]


@pytest.fixture(params=ROUTES)
def window_route(request, monkeypatch):
    """Every runner the test builds takes this window route."""
    monkeypatch.setenv("RIDGEFILL_ROUTES", f"window={request.param}")
    return request.param


def window_mask(positions, local, window):
    """[1, 1, N, N] additive mask of the rows at `positions`: causal, and rows where `local` [N] is True see only
    the sinks and the `window.size` positions before them."""
    q, k = positions.unsqueeze(1), positions.unsqueeze(0)
    allowed = k <= q
    near = (k >= q - window.size) | (k < window.sinks)
    allowed &= near | ~local.unsqueeze(1)
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]


@torch.no_grad()
def hf_forward(model, ids, masks, positions=None, h=None, layers=None):
    """transformers' decoder layers `layers` (default all) over `h` (default the embedded `ids`), layer i with the
    mask masks(i)."""
    inner = model.model
    positions = torch.arange(ids.shape[1]) if positions is None else positions
    h = inner.embed_tokens(ids) if h is None else h
    cos_sin = inner.rotary_emb(h, positions.unsqueeze(0))
    layers = range(len(inner.layers)) if layers is None else layers
    for i in layers:
        out = inner.layers[i](h, attention_mask=masks(i), position_ids=positions.unsqueeze(0), position_embeddings=cos_sin)
        h = out[0] if isinstance(out, tuple) else out
    return h


@pytest.mark.parametrize("size,first,last,sinks,chunk", [(3, 0, 3, 1, 4096), (5, 1, 2, 2, 16), (40, 0, 1, 0, 7),
                                                          (1, 2, 3, 1, 1)])
def test_windowed_forward_equals_transformers_layers_with_the_window_as_a_mask(dense_model, size, first, last, sinks,
                                                                            chunk, window_route):
    """Calibration's forward (no fill, a window): every row past the sinks attends locally in the window's layers."""
    n = 90  # past one block of windowed rows (block_size >= 32) and across chunks
    ids = random_ids(n)
    window = FilledWindow(size, first, last, sinks)
    positions = torch.arange(n)
    local = window_mask(positions, positions >= sinks, window)
    causal = window_mask(positions, torch.zeros(n, dtype=torch.bool), window)
    ref = hf_forward(dense_model, ids, lambda i: local if first <= i <= last else causal)
    ref = dense_model.lm_head(dense_model.model.norm(ref))
    runner = Runner(adapter_for(dense_model))
    assert runner.routes.window == window_route
    out = runner.prefill(ids, logits_at="full", chunk=chunk, window=window)
    assert (out.logits - ref).abs().max() <= TOL
    plain = Runner(adapter_for(dense_model)).prefill(ids, logits_at="full")
    assert (plain.logits - ref).abs().max() > 1e-3  # the window changes the model: the test can fail


@pytest.mark.parametrize("chunk", [4096, 13])
def test_a_windowed_fill_windows_its_filled_rows_below_the_split_only(dense_model, chunk, window_route):
    """Drop fill with a window: below the split, filled rows attend locally and full rows (kept, tail) to every
    row; above it, the full rows alone (the drop control), so the full rows' logits are transformers' layers run
    that way."""
    n, split, tail, keep = 70, 3, 9, (0, 30)
    ids = random_ids(n)
    eng = Runner(adapter_for(dense_model))
    window = FilledWindow(4, 0, 3, sinks=1)  # layers 0..3 asked: only 0..2 lie below the split
    plan = FillPlan(DropFiller(split, eng.n_layers), tail=tail, keep_rows=keep, window=window)
    full = plan.full_rows(n)
    positions = torch.arange(n)
    local = window_mask(positions, ~full, window)
    h = hf_forward(dense_model, ids, lambda i: local, layers=range(split))
    late = window_mask(positions[full], torch.zeros(int(full.sum()), dtype=torch.bool), window)
    h = hf_forward(dense_model, ids, lambda i: late, positions=positions[full], h=h[:, full],
                   layers=range(split, eng.n_layers))
    ref = dense_model.lm_head(dense_model.model.norm(h))
    out = eng.prefill(ids, fill=plan, logits_at="full", chunk=chunk)
    assert (out.logits - ref).abs().max() <= TOL


def test_a_window_changes_nothing_when_every_row_is_full(dense_model):
    ids = random_ids(40)
    eng = Runner(adapter_for(dense_model))
    plan = FillPlan(IdentityFiller(2, eng.n_layers), tail=40, window=FilledWindow(2, 0, 1))
    assert (eng.prefill(ids, fill=plan, logits_at="full").logits - eng.prefill(ids, logits_at="full").logits
            ).abs().max() <= TOL


def test_identity_fill_with_a_window_writes_the_windowed_split_state_into_layer_s(dense_model, window_route):
    """The filled rows' layer-S keys come from their split state, which the window shaped: the same keys as the
    windowed forward without a fill has at those rows."""
    n, split = 60, 2
    ids = random_ids(n)
    eng = Runner(adapter_for(dense_model))
    window = FilledWindow(6, 0, split - 1, sinks=1)
    plan = FillPlan(IdentityFiller(split, eng.n_layers), tail=5, window=window)
    filled = eng.prefill(ids, fill=plan, chunk=17).cache[split]
    windowed = eng.prefill(ids, window=window).cache[split]
    rows = slice(1, n - 5)
    assert (filled.keys[:, :, rows] - windowed.keys[:, :, rows]).abs().max() <= TOL
    unwindowed = eng.prefill(ids, fill=FillPlan(IdentityFiller(split, eng.n_layers), tail=5)).cache[split]
    assert (filled.keys[:, :, rows] - unwindowed.keys[:, :, rows]).abs().max() > 1e-3


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_windowed_fill_is_chunk_invariant(family, window_route):
    """Hybrids window their attention layers below the split; the linear layers' state passes every row as before."""
    model = tiny_model(family)
    eng = Runner(adapter_for(model))
    plan = FillPlan(IdentityFiller(4, eng.n_layers), tail=6, window=FilledWindow(3, 0, 3))
    ids = random_ids(50)
    whole = eng.prefill(ids, fill=plan, logits_at="full", chunk=4096)
    parts = eng.prefill(ids, fill=plan, logits_at="full", chunk=9)
    assert (whole.logits - parts.logits).abs().max() <= 1e-4
    plain = eng.prefill(ids, fill=FillPlan(IdentityFiller(4, eng.n_layers), tail=6), logits_at="full")
    assert (whole.logits - plain.logits).abs().max() > 1e-4  # layer 2 is attention, below the split: windowed


def test_window_blocks_read_sinks_plus_window_plus_block_keys_at_most():
    """The work is O(rows x W): no block reads more than sinks + W + block keys, however long the prefix."""
    window = FilledWindow(128, 0, 10, sinks=4)
    rows = torch.arange(2048)
    blocks = window_blocks(rows, rows + 10_000, window, torch.float32)  # a chunk far into the prompt
    assert sum(len(b.rows) for b in blocks) == 2048
    assert max(len(b.keys) for b in blocks) <= 4 + 128 + block_size(128)
    first = blocks[0]
    assert first.keys[:4].tolist() == [0, 1, 2, 3]  # the sinks, then the band
    allowed = torch.isfinite(first.mask).sum(1)
    assert allowed.tolist() == [4 + 128 + 1] * len(first.rows)  # every row: sinks, W rows before it, itself


def test_window_flops_count_sinks_plus_window_keys_below_the_split(dense_model):
    shape = ModelShape.of(adapter_for(dense_model))
    n, split, tail = 200, 2, 20
    full = np.zeros(n, dtype=bool)
    full[0], full[-tail:] = True, True
    window = FilledWindow(16, 0, 5, sinks=1)  # 0..5 asked: 0..1 lie below the split
    plain = prefill_flops(shape, n, full, split)
    windowed = prefill_flops(shape, n, full, split, window=window)
    per_key = 4 * shape.heads * shape.head_dim
    saved = sum((p + 1) - window.keys_per_row(p) for p in range(n) if not full[p])
    assert plain - windowed == split * per_key * saved
    assert window.keys_per_row(0) == 1 and window.keys_per_row(16) == 17 and window.keys_per_row(100) == 18


def test_window_settings_refused_in_one_line():
    with pytest.raises(RidgefillError, match="at least 1"):
        FilledWindow(0, 0, 3)
    with pytest.raises(RidgefillError, match="is empty"):
        FilledWindow(4, 3, 2)
    with pytest.raises(RidgefillError, match="below the split"):
        parse_layers("0-15", 15)
    with pytest.raises(RidgefillError, match="not a layer range"):
        parse_layers("a-b", 15)
    assert parse_layers(None, 15) == (0, 14) and parse_layers("3-7", 15) == (3, 7) and parse_layers("4", 15) == (4, 4)
