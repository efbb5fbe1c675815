"""Which tokens of a vLLM step are filled, and the segments full rows attend in (backends/vllm/plugin/rows.py; no vLLM)."""

from __future__ import annotations

import pytest
import torch

from ridgefill.torchfill import FillPlan, IdentityFiller
from ridgefill.torchfill.rows import MAX_ROWS
from ridgefill.errors import RidgefillError
from ridgefill.backends.vllm.requests import check_request_args
from ridgefill.backends.vllm.plugin.rows import bound_runs, full_tokens, outlier_tokens, segments, token_requests


def step(chunks):
    """chunks: per request (first position, count) -> (positions [N], request [N], query_start [R+1])."""
    positions = torch.cat([torch.arange(a, a + n) for a, n in chunks])
    query_start = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()])
    return positions, token_requests(query_start, positions.numel()), query_start


def test_token_requests_marks_padding():
    assert token_requests(torch.tensor([0, 2, 5]), 7).tolist() == [0, 0, 1, 1, 1, -1, -1]


def test_rule_matches_the_engine_plan_for_one_prompt():
    """One unchunked prompt: the same rows as the engine's FillPlan with the same keep-first, also past the prompt
    (the whole prompt in full, in both: one rule) and up to the largest keep-first either takes."""
    for n, tail, keep in [(50, 8, 1), (50, 8, 0), (5, 8, 1), (50, 1, 3), (50, 49, 1), (50, 1, 51), (50, 1, MAX_ROWS)]:
        positions, request, _ = step([(0, n)])
        full = full_tokens(positions, request, torch.tensor([n]), torch.tensor([tail]), torch.tensor([keep]))
        plan = FillPlan(IdentityFiller(2, 6), tail, keep_first=keep)
        assert full.tolist() == plan.full_rows(n).tolist(), (n, tail, keep)
    assert FillPlan(IdentityFiller(2, 6), 8, keep_first=51).full_rows(50).all()


def test_a_keep_first_past_the_largest_prompt_is_refused_by_the_engine_and_at_admission():
    with pytest.raises(RidgefillError, match=f"^keep-first {MAX_ROWS + 1} is past the {MAX_ROWS} rows a prompt can "
                                             "have: give at most"):
        FillPlan(IdentityFiller(2, 6), 8, keep_first=MAX_ROWS + 1)
    check_request_args({"ridgefill_keep_first": MAX_ROWS})
    with pytest.raises(ValueError, match=f"^ridgefill_keep_first={MAX_ROWS + 1} is not valid: give an integer in "
                                         f"0..{MAX_ROWS}"):
        check_request_args({"ridgefill_keep_first": MAX_ROWS + 1})


def test_chunks_and_recompute_fill_the_same_rows_as_one_prefill():
    """A 40-token prompt in chunks of 16, then decoding, and the same request recomputed after preemption
    (prompt + 3 generated tokens in one step): every position is filled or not exactly as unchunked."""
    n, tail, keep = 40, 6, 1
    args = torch.tensor([n]), torch.tensor([tail]), torch.tensor([keep])
    whole = full_tokens(*step([(0, n)])[:2], *args)
    pieces = [full_tokens(*step([(a, min(16, n - a))])[:2], *args) for a in range(0, n, 16)]
    assert torch.cat(pieces).tolist() == whole.tolist()
    recomputed = full_tokens(*step([(0, n + 3)])[:2], *args)
    assert recomputed[:n].tolist() == whole.tolist() and recomputed[n:].all()  # generated tokens: full
    assert full_tokens(*step([(n + 7, 1)])[:2], *args).all()  # a decode step


def test_mixed_batch_uses_each_requests_own_prompt_and_tail():
    positions, request, _ = step([(0, 10), (30, 1), (0, 4)])  # a prompt, a decode token, a short prompt
    full = full_tokens(positions, request, torch.tensor([10, 30, 4]), torch.tensor([3, 3, 8]),
                       torch.tensor([1, 1, 1]))
    assert full.tolist() == [True] + [False] * 6 + [True] * 3 + [True] + [True] * 4


def test_segments_split_runs_and_requests():
    positions, request, _ = step([(0, 10), (30, 1), (0, 4)])
    full = full_tokens(positions, request, torch.tensor([10, 30, 4]), torch.tensor([3, 3, 8]),
                       torch.tensor([1, 1, 1]))
    seg = segments(full, request, positions)
    assert seg.rows.tolist() == [0, 7, 8, 9, 10, 11, 12, 13, 14]
    assert seg.request.tolist() == [0, 0, 1, 2]  # the kept row 0 is its own segment
    assert seg.query_start.tolist() == [0, 1, 4, 5, 9]
    assert seg.seq_lens.tolist() == [1, 10, 31, 4]  # each segment sees keys up to its last position
    assert seg.max_query_len == 4


def test_segments_leave_padding_out_and_handle_no_full_rows():
    positions = torch.tensor([5, 6, 0, 0])
    request = torch.tensor([0, 0, -1, -1])
    seg = segments(torch.tensor([False, True, True, True]), request, positions)
    assert seg.rows.tolist() == [1] and seg.seq_lens.tolist() == [7]
    none = segments(torch.zeros(4, dtype=torch.bool), request, positions)
    assert none.n == 0 and none.rows.numel() == 0 and none.query_start.tolist() == [0]


def test_outliers_are_judged_within_each_request():
    request = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    full = torch.tensor([True, False, False, False, False, False, True])
    norms = torch.tensor([500.0, 1.0, 1.0, 30.0, 10.0, 10.0, 1.0])
    out = outlier_tokens(norms, request, full, 20.0)
    assert out.tolist() == [False, False, False, True, False, False, False]  # full rows are never outliers
    assert not outlier_tokens(norms, request, full, 0.0).any()


def test_runs_over_the_bound_close_the_shortest_gaps_of_one_request_first():
    """Three prompts of 20, 40 and 30 tokens (keep-first 1, tail 4: two runs each, gaps of 15, 35 and 25 filled
    rows) and a decode token: 7 runs. A bound of 5 closes the two shortest gaps (requests 0 and 2 run exact), a bound
    of 6 the shortest only; a bound below the number of requests closes every gap and merges no requests."""
    positions, request, _ = step([(0, 20), (0, 40), (0, 30), (50, 1)])
    prompts = torch.tensor([20, 40, 30, 50])
    full = full_tokens(positions, request, prompts, torch.tensor([4, 4, 4, 4]), torch.tensor([1, 1, 1, 1]))
    assert segments(full, request, positions).n == 7
    assert bound_runs(full, request, 7) is full
    six = bound_runs(full, request, 6)
    assert six[:20].all() and six[20:90].tolist() == full[20:90].tolist() and segments(six, request, positions).n == 6
    five = bound_runs(full, request, 5)
    assert five[:20].all() and five[60:90].all() and five[20:60].tolist() == full[20:60].tolist()
    assert segments(five, request, positions).n == 5
    for limit in (1, 4):
        one_each = bound_runs(full, request, limit)
        assert one_each.all() and segments(one_each, request, positions).n == 4  # one run per request


def test_the_bound_leaves_padding_out_and_keeps_the_rule_where_it_fits():
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 0])
    request = torch.tensor([0, 0, 0, 0, 0, 0, -1, -1])
    full = torch.tensor([True, False, False, True, False, True, True, True])  # runs: {0}, {3}, {5}; gaps 2 and 1
    assert bound_runs(full, request, 2).tolist() == [True, False, False, True, True, True, True, True]
    assert bound_runs(full, request, 3) is full
