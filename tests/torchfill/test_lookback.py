"""Lookback maps: which rows a window may hold, the maps' inputs, and the runner's filled prefill with them (each
filled row gets f·W + b of its own window; a row without a whole window runs in full)."""

import pytest
import torch

from tiny_models import random_ids
from ridgefill.torchfill import Runner, FillPlan, MapFiller, OracleFiller, adapter_for
from ridgefill.torchfill.lookback import lookback_windows, window_states

TOL = 1e-5


# --- windows ---------------------------------------------------------------------------------------
def test_a_window_is_the_k_rows_before_in_the_same_group_past_the_sinks():
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 3, 4, 5])  # a gap after 5; a second sequence from 3
    group = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    blocked = torch.zeros(11, dtype=torch.bool)
    blocked[3] = True
    index, whole = lookback_windows(positions, group, blocked, 2, start=1)
    assert whole.tolist() == [False, False, False,  # rows 0-2 reach position 0 (a sink) or before the batch
                              True,  # rows 2, 1: a blocked row may have a window, only not be in one
                              False, False,  # row 3 is blocked
                              False, False,  # position 7 follows 5: not the rows right before it
                              False, False, True]  # the second group starts at row 8
    assert index[3].tolist() == [2, 1] and index[10].tolist() == [9, 8]


def test_without_lookback_every_window_is_whole_and_empty():
    index, whole = lookback_windows(torch.arange(5), torch.zeros(5, dtype=torch.long),
                                    torch.ones(5, dtype=torch.bool), 0, start=3)
    assert index.shape == (5, 0) and whole.all()


def test_window_states_are_nearest_first():
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # [B, N, H]
    out = window_states(x, torch.tensor([[3, 2], [1, 0]]))
    assert out.shape == (2, 2, 6)
    assert torch.equal(out[1, 0], torch.cat([x[1, 3], x[1, 2]]))


# --- the maps' inputs ------------------------------------------------------------------------------
H, L, S, K = 4, 5, 1, 2  # three maps (layers 2-4), each reading x and the two rows before


def lookback_fillers():
    g = torch.Generator().manual_seed(0)
    f = (K + 1) * H
    bias = torch.randn(L - S - 1, H, generator=g)
    weights = torch.randn(L - S - 1, f, H, generator=g)
    low = (torch.randn(L - S - 1, f, 2, generator=g), torch.randn(L - S - 1, 2, H, generator=g))
    return weights, bias, low


@pytest.mark.parametrize("rank", [None, 2])
def test_lookback_maps_read_x_then_its_window(rank):
    weights, bias, low = lookback_fillers()
    filler = MapFiller(S, L, None if rank else weights, bias, low if rank else None)
    assert filler.lookback == K and filler.rank == rank
    x, previous = torch.randn(2, 3, H), torch.randn(2, 3, K * H)
    f = torch.cat([x, previous], -1).reshape(6, -1)  # [B*n, F]
    if rank:  # W = E + U V
        want = [x.reshape(6, H) + f @ u @ v + b for u, v, b in zip(*low, bias)]
    else:
        want = [f @ w + b for w, b in zip(weights, bias)]
    y = filler.late_inputs(x, torch.arange(3), previous)  # [L-S, B*n, H]
    assert torch.equal(y[0], x.reshape(6, H))
    assert (y[1:] - torch.stack(want)).abs().max() <= TOL
    predicted = filler.predict(x, torch.arange(3), previous)  # [B, n, L-S-1, H]
    assert (predicted.permute(2, 0, 1, 3).reshape(L - S - 1, 6, H) - y[1:]).abs().max() <= TOL
    h, r = H, rank
    assert filler.flops_per_row() == (L - S - 1) * (2 * 3 * h * h if r is None else 2 * r * (3 * h + h))


def test_lookback_maps_refuse_to_run_without_the_window():
    weights, bias, _ = lookback_fillers()
    with pytest.raises(ValueError, match="lookback 2 need the split states"):
        MapFiller(S, L, weights, bias).late_inputs(torch.randn(1, 3, H), torch.arange(3))


# --- the runner ------------------------------------------------------------------------------------
def predicted_hidden(model, ids, split, weights, bias, k):
    """The late-layer inputs a lookback map gives every row, computed by hand from the exact split states:
    hidden[l] [B, N, H] for l = 0..L (rows without k predecessors get x_t for the missing ones; they run in full)."""
    with torch.no_grad():
        hs = list(model(ids, output_hidden_states=True).hidden_states)
    x = hs[split]  # [B, N, H]
    shifted = [torch.cat([x[:, :1].expand(-1, j, -1), x[:, :-j]], 1) if j else x for j in range(k + 1)]
    f = torch.cat(shifted, -1)  # [B, N, F]
    for j in range(weights.shape[0]):
        hs[split + 1 + j] = f @ weights[j] + bias[j]
    return hs


@pytest.mark.parametrize("chunk", [10, 64])
@pytest.mark.parametrize("start", [0, 1])
def test_lookback_fill_equals_oracle_fill_with_the_unwindowed_rows_kept(dense_model, chunk, start):
    """Filled prefill with lookback maps = oracle fill with the maps' predictions computed by hand, where the rows
    whose window is not whole (before `start` + K, the first K of each chunk) are kept rows instead."""
    eng = Runner(adapter_for(dense_model), chunk=chunk)
    n, tail, split, k = 33, 5, 2, 2
    hidden = dense_model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    maps = eng.n_layers - split - 1
    weights = torch.eye((k + 1) * hidden, hidden).expand(maps, -1, -1) + 0.05 * torch.randn(
        maps, (k + 1) * hidden, hidden, generator=g)
    bias = 0.1 * torch.randn(maps, hidden, generator=g)
    ids = random_ids(n, batch=2)
    plan = FillPlan(MapFiller(split, eng.n_layers, weights, bias, lookback_start=start), tail=tail)
    got = eng.prefill(ids, fill=plan, logits_at="full")
    chunk_starts = {c for c in range(0, n - tail, chunk)}
    unwindowed = sorted({r for c in chunk_starts for r in range(c, c + k)} | set(range(start + k)))
    unwindowed = [r for r in unwindowed if r < n - tail]
    assert got.n_unwindowed == len(unwindowed) and got.n_filled == n - tail - len(unwindowed)
    assert plan.tally.to_dict()["lookback_full_tokens"] == len(unwindowed)
    oracle = FillPlan(OracleFiller(split, predicted_hidden(dense_model, ids, split, weights, bias, k)), tail=tail,
                      keep_rows=tuple(unwindowed))
    ref = eng.prefill(ids, fill=oracle, logits_at=got.rows.tolist())  # the tail: rows run in full have no logits
    assert (got.logits - ref.logits).abs().max() <= TOL
    for la, lb in zip(got.cache.layers, ref.cache.layers):
        assert (la.keys - lb.keys).abs().max() <= TOL and (la.values - lb.values).abs().max() <= TOL
