"""The attention routes' math on the CPU (torchfill/attention.py, torchfill/window.py's band route): each against attention
with an explicit mask, element-wise. The CUDA kernels themselves are checked in tests/gpu/test_attention_gpu.py."""

import pytest
import torch
import torch.nn.functional as F

from ridgefill.torchfill.attention import causal_attention, flash_cpu, merge, prefix_then_block
from ridgefill.torchfill.window import FilledWindow, band_masked, banded_attention, merge_sinks, sink_scores

TOL = 1e-5


def qkv(nq, n_keys, heads=4, kv_heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, nq, d, generator=g), torch.randn(1, kv_heads, n_keys, d, generator=g),
            torch.randn(1, kv_heads, n_keys, d, generator=g))


def masked(q, k, v, allowed, scale):
    """Reference: attention with the boolean mask `allowed` [nq, n_keys], in float64, and its log-sum-exp."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).float(), scores.logsumexp(-1).float()


def window_allowed(positions, n_keys, window: FilledWindow):
    """[n, n_keys] what a windowed row at each of `positions` sees: causal, its W rows before it and the sinks
    (tests/torchfill/test_window.py's window_mask, for one row set)."""
    p, k = positions.unsqueeze(1), torch.arange(n_keys).unsqueeze(0)
    return (k <= p) & ((k >= p - window.size) | (k < window.sinks))


@pytest.mark.parametrize("route", ["cpu_split", "lower_right"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_causal_routes_equal_the_masked_reference(route, kv_heads):
    q, k, v = qkv(7, 19, kv_heads=kv_heads)
    allowed = torch.arange(19).unsqueeze(0) <= torch.arange(12, 19).unsqueeze(1)
    ref, _ = masked(q, k, v, allowed, 0.3)
    assert (causal_attention(route, q, k, v, 0.3) - ref).abs().max() <= TOL


@pytest.mark.parametrize("nq", [1, 9])
def test_causal_attention_without_a_prefix_is_plain_causal_attention(nq):
    """One query (decode) over every key, or a first chunk (as many queries as keys): no prefix to split."""
    q, k, v = qkv(nq, 9 if nq == 9 else 5)
    allowed = torch.arange(k.shape[2]).unsqueeze(0) <= torch.arange(k.shape[2] - nq, k.shape[2]).unsqueeze(1)
    ref, _ = masked(q, k, v, allowed, 0.25)
    for route in ("cpu_split", "lower_right", "flash", "cudnn_split"):  # no CUDA kernel is called here
        assert (causal_attention(route, q, k, v, 0.25) - ref).abs().max() <= TOL


def test_merge_of_two_disjoint_key_sets_is_attention_over_their_union():
    q, k, v = qkv(5, 12)
    out_a, lse_a = flash_cpu(q, k[:, :, :4], v[:, :, :4], False, 0.5)
    out_b, lse_b = flash_cpu(q, k[:, :, 4:], v[:, :, 4:], False, 0.5)
    ref, ref_lse = masked(q, k, v, torch.ones(5, 12, dtype=torch.bool), 0.5)
    assert (merge(out_a, lse_a, out_b.clone(), lse_b) - ref).abs().max() <= TOL
    assert (torch.logaddexp(lse_a, lse_b) - ref_lse).abs().max() <= TOL  # the kernels' lse is what merge assumes
    empty = torch.full_like(lse_a, float("-inf"))
    assert torch.equal(merge(torch.zeros_like(out_a), empty, out_b.clone(), lse_b), out_b)  # no keys: weight 0


def test_prefix_then_block_takes_any_kernel_of_the_contract():
    """The split route with another (out, lse) kernel (cuDNN's on CUDA): here the masked reference as one."""
    q, k, v = qkv(6, 20)

    def reference_kernel(q, k, v, causal, scale):
        nq, nk = q.shape[2], k.shape[2]
        allowed = torch.ones(nq, nk, dtype=torch.bool).tril() if causal else torch.ones(nq, nk, dtype=torch.bool)
        return masked(q, k, v, allowed, scale)

    allowed = torch.arange(20).unsqueeze(0) <= torch.arange(14, 20).unsqueeze(1)
    ref, _ = masked(q, k, v, allowed, 0.3)
    assert (prefix_then_block(q, k, v, 14, 0.3, kernel=reference_kernel) - ref).abs().max() <= TOL


@pytest.mark.parametrize("w", [1, 5, 40])
def test_the_band_kernel_contract_its_masked_stand_in(w):
    """The band of the last nq of nk positions: itself and the W keys before it; out and lse."""
    nq, nk = 10, 25
    q, k, v = qkv(nq, nk)
    p = torch.arange(nk - nq, nk).unsqueeze(1)
    allowed = (torch.arange(nk).unsqueeze(0) <= p) & (torch.arange(nk).unsqueeze(0) >= p - w)
    ref, ref_lse = masked(q, k, v, allowed, 0.3)
    out, lse = band_masked(q, k, v, w, 0.3)
    assert (out - ref).abs().max() <= TOL and (lse - ref_lse).abs().max() <= TOL


@pytest.mark.parametrize("heads_last", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sink_scores_see_only_sinks_before_each_rows_band(heads_last, kv_heads):
    """Each query head against its own KV head's sinks, -inf where the sink is in (or after) the row's band; q as
    the projections leave it ([B, n, Hq, D] behind a transpose) or contiguous."""
    q, k, _ = qkv(4, 3, kv_heads=kv_heads)
    if heads_last:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        assert not q.is_contiguous()
    positions = torch.tensor([2, 5, 6, 30])  # W = 4: row 2 sees no sink outside its band, row 5 sink 0, 6: 0, 1
    scores = sink_scores(q, k, positions, 4, 0.5)
    seen = torch.arange(3).unsqueeze(0) < (positions - 4).unsqueeze(1)
    ref = (q.double() @ k.repeat_interleave(4 // kv_heads, 1).double().transpose(-1, -2) * 0.5)
    assert scores.dtype == torch.float32 and scores.shape == (1, 4, 4, 3)
    assert torch.equal(torch.isneginf(scores), ~seen.expand_as(scores))
    assert (scores[..., seen] - ref[..., seen]).abs().max() <= TOL


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_merge_sinks_is_the_attention_over_band_and_sinks(kv_heads):
    """merge_sinks (every device's merge) of a band's (out, lse) and the sinks' scores equals attention over both
    key sets at once; a row that sees no sink keeps its band's output."""
    q, k, v = qkv(6, 40, kv_heads=kv_heads, seed=5)
    sinks, band = slice(0, 3), slice(10, 40)
    seen = torch.ones(6, 3, dtype=torch.bool)
    seen[0] = False  # row 0 sees no sink
    seen[1, 2] = False
    out_b, lse_b = masked(q, k[:, :, band], v[:, :, band], torch.ones(6, 30, dtype=torch.bool), 0.3)
    scores = (q @ k[:, :, sinks].repeat_interleave(4 // kv_heads, 1).transpose(-1, -2) * 0.3).masked_fill(~seen,
                                                                                                      float("-inf"))
    ref, _ = masked(q, k[:, :, :40], v[:, :, :40], torch.cat([seen, torch.zeros(6, 7, dtype=torch.bool),
                                                            torch.ones(6, 30, dtype=torch.bool)], 1), 0.3)
    out = merge_sinks(out_b, lse_b, scores, v[:, :, sinks])
    assert (out - ref).abs().max() <= TOL
    assert torch.equal(out[:, :, 0], out_b[:, :, 0])


def test_merge_sinks_in_bf16_rounds_once():
    """In bf16 the merge is computed in float32 and rounded once: its result is the float64 merge of the same
    inputs (the band's bf16 output, the float32 log-sum-exps and scores) rounded to bf16, to within float32's own
    rounding of the intermediate terms, with sinks that hold most of the mass. Rounding the sinks' part to bf16
    before the merge (as the old route did) is off by up to half a step more."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, n, d, s = 1, 8, 2, 64, 64, 2
    out_b = torch.randn(b, hq, n, d, generator=g).bfloat16()
    lse_b = torch.randn(b, hq, n, generator=g) * 2
    scores = torch.randn(b, hq, n, s, generator=g) * 2 + 1.5
    v = torch.randn(b, hkv, s, d, generator=g).bfloat16()
    total = torch.logaddexp(lse_b.double(), scores.double().logsumexp(-1))
    band_part = out_b.double() * (lse_b.double() - total).exp().unsqueeze(-1)
    sinks_part = (scores.double() - total.unsqueeze(-1)).exp() @ v.double().repeat_interleave(hq // hkv, 1)
    exact = band_part + sinks_part
    step = exact.abs().float().bfloat16().float()  # each element's bf16 step: 2^-8 of its magnitude's power of 2
    step = torch.where(step > 0, 2.0 ** (torch.floor(torch.log2(step)) - 7), 2.0 ** -133)
    allowed = 0.5 * step + 2.0 ** -15 * (band_part.abs() + sinks_part.abs())  # one rounding; float32 weights
    assert ((merge_sinks(out_b, lse_b, scores, v).double() - exact).abs() <= allowed).all()
    twice = (band_part + sinks_part.bfloat16().double()).bfloat16()  # the sinks' part rounded first, then the sum
    assert ((twice.double() - exact).abs() > allowed).any()


@pytest.mark.parametrize("sinks", [0, 1, 4])
@pytest.mark.parametrize("size", [3, 16, 60])  # W smaller than the chunk, about it, larger than every position
@pytest.mark.parametrize("start", [0, 2, 37])  # the chunk at position 0, near it, far from it
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_band_plus_sinks_equals_the_masked_window(sinks, size, start, kv_heads):
    """The CUDA window route's logic (band kernel, then the sinks merged by log-sum-exp), with the band kernel's
    exact stand-in: every chunk row over its sinks and window equals the window as an explicit mask."""
    n = 20
    window = FilledWindow(size, 0, 3, sinks)
    q, k, v = qkv(n, start + n, kv_heads=kv_heads, seed=sinks + size + start)
    positions = torch.arange(start, start + n)
    ref, _ = masked(q, k, v, window_allowed(positions, start + n, window), 0.3)
    out = banded_attention(q, k, v, start, positions, window, 0.3, band_masked)
    assert (out - ref).abs().max() <= TOL


def test_the_cuda_kernels_calls_on_meta_tensors():
    """The CUDA routes' torch calls, run on meta tensors (torch's shape functions, no values): the arguments and
    keywords this torch takes, the layouts (band_flash's lse [B, Hq, nq], as merge reads it), GQA K/V unrepeated,
    and no host sync anywhere in the band route (a meta tensor has no value to read)."""
    from ridgefill.torchfill.window import band_flash

    q, k, v = (t.to("meta", torch.bfloat16) for t in qkv(64, 300, heads=8, kv_heads=2, d=128))
    assert causal_attention("flash", q, k, v, 0.1).shape == q.shape
    out, lse = band_flash(q, k, v, 32, 0.1)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    positions = torch.arange(236, 300, device="meta")
    assert banded_attention(q, k, v, 236, positions, FilledWindow(32, 0, 1, 4), 0.1, band_flash).shape == q.shape


def test_a_split_in_half_precision_is_as_accurate_as_one_kernel_call():
    """The log-sum-exp merge of bf16 parts adds no rounding of its own (it runs in float32)."""
    q, k, v = (t.bfloat16() for t in qkv(32, 300, seed=3))
    allowed = torch.arange(300).unsqueeze(0) <= torch.arange(268, 300).unsqueeze(1)
    ref, _ = masked(q.float(), k.float(), v.float(), allowed, 0.25)
    one = flash_cpu(q, k, v, False, 0.25, torch.zeros(32, 300, dtype=torch.bfloat16).masked_fill(~allowed, -torch.inf))[0]
    split = prefix_then_block(q, k, v, 268, 0.25)
    assert (split.float() - ref).abs().max() <= 1.5 * (one.float() - ref).abs().max()
