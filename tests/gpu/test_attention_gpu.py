"""The CUDA attention routes (torchfill/routes.py) in bf16 at a realistic shape (32 query heads, 8 KV heads, head dim
128, 2,048 queries over up to 8,192 keys) against attention computed in float32 from the same inputs, element-wise:
a route's max and RMS error are at most 1.5x those of transformers' eager attention in bf16, plus one bf16 step at
the reference's scale (scripts/attention_check.py's reference, errors and bound, so the script and these tests
judge alike). Then the runner's windowed prefill on CUDA by its default routes against the float32 runner.
Skipped without a GPU."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from tiny_models import random_ids, tiny_model
from ridgefill.torchfill import Runner, FilledWindow, FillPlan, IdentityFiller, adapter_for
from ridgefill.torchfill.attention import causal_attention
from ridgefill.torchfill.routes import ENV, Routes
from ridgefill.torchfill.window import band_flash, banded_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_spec = importlib.util.spec_from_file_location("attention_check",
                                               Path(__file__).resolve().parents[2] / "scripts" / "attention_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

SHAPE = dict(heads=32, kv_heads=8, head_dim=128)
NQ = 2048
SCALE = 128 ** -0.5


def assert_bounded(name, out, q, k, v, allowed, three_tf32=False):
    ref = check.reference(q, k, v, allowed, SCALE)
    err, base = check.errors(out, ref), check.errors(check.reference(q, k, v, allowed, SCALE, eager=True), ref)
    assert check.within(err, base, ref, q.dtype, three_tf32), f"{name}: error {err} against eager {q.dtype} {base}"


@torch.inference_mode()
def test_the_cuda_routes_of_the_8b_shape():
    assert Routes.for_model("cuda", torch.bfloat16, 32, 8, 128, overrides="").describe() == {
        "device": "cuda", "dtype": "bfloat16", "causal": "flash", "window": "flash_band", "projection": "torch",
        "delta_rule": Routes.for_model("cuda", torch.bfloat16, 32, 8, 128, overrides="").delta_rule}
    fp32 = Routes.for_model("cuda", torch.float32, 32, 8, 128, overrides="")
    assert (fp32.causal, fp32.window) == ("lower_right", "blocks")


@pytest.mark.parametrize("n_keys", [NQ + 1, 8192])
@torch.inference_mode()
def test_flash_chunk_attention_over_a_cached_prefix(n_keys, fp32_reference):
    """The last 2,048 of n_keys positions, one flash call with GQA K/V unrepeated, lower-right causal."""
    q, k, v = check.inputs(NQ, n_keys, SHAPE, torch.bfloat16, torch.device("cuda"))
    out = causal_attention("flash", q, k, v, SCALE)
    assert_bounded("flash", out, q, k, v, check.causal_allowed(NQ, n_keys, q.device))


@torch.inference_mode()
def test_lower_right_is_the_fp32_route_on_cuda(fp32_reference):
    s = dict(SHAPE)
    q, k, v = check.inputs(512, 4096, s, torch.float32, torch.device("cuda"))
    out = causal_attention("lower_right", q, k, v, SCALE)
    # the memory-efficient kernel multiplies fp32 in 3xTF32 on sm80+ (scripts/attention_check.py, THREE_TF32 cites
    # its source): bounded by what it is built to do, not by 1.5x eager fp32
    assert_bounded("lower_right fp32", out, q, k, v, check.causal_allowed(512, 4096, q.device),
                   check.fast_fp32(q.device, q.dtype))


@torch.inference_mode()
def test_the_band_kernel_returns_the_bands_log_sum_exp(fp32_reference):
    """band_flash's (out, lse) in the layout the merge reads: lse [B, Hq, nq], each row's band only."""
    q, k, v = check.inputs(256, 1024, SHAPE, torch.bfloat16, torch.device("cuda"))
    out, lse = band_flash(q, k, v, 100, SCALE)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    p = torch.arange(1024 - 256, 1024, device=q.device).unsqueeze(1)
    keys = torch.arange(1024, device=q.device).unsqueeze(0)
    allowed = (keys <= p) & (keys >= p - 100)
    scores = (q.float() @ k.float().repeat_interleave(4, 1).transpose(-1, -2)) * SCALE
    ref_lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    assert (lse - ref_lse).abs().max().item() <= 1e-2


@pytest.mark.parametrize("sinks", [0, 1, 4])
@pytest.mark.parametrize("size,n_keys", [(512, 8192), (2048, 8192), (4096, 8192), (512, NQ)])
@torch.inference_mode()
def test_window_band_plus_sinks(sinks, size, n_keys, fp32_reference):
    """Every chunk row over its band (one sliding-window flash call) and its sinks (merged by log-sum-exp): W
    below and above the chunk's 2,048 rows, the chunk at position 0 or far from it."""
    q, k, v = check.inputs(NQ, n_keys, SHAPE, torch.bfloat16, torch.device("cuda"), seed=sinks)
    window = FilledWindow(size, 0, 0, sinks)
    start = n_keys - NQ
    out = banded_attention(q, k, v, start, torch.arange(start, n_keys, device=q.device), window, SCALE, band_flash)
    assert_bounded(f"band W={size} sinks={sinks}", out, q, k, v, check.window_allowed(NQ, n_keys, window, q.device))


@torch.inference_mode()
def test_engine_windowed_prefill_on_its_cuda_routes(monkeypatch, fp32_reference):
    """A windowed identity fill (tail and a kept row: rows that are not windowed) in bf16 by the default CUDA
    routes (flash, flash_band) against the float32 runner by the masked route, bounded by the bf16 runner by the
    masked route (blocks)."""
    config = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, num_hidden_layers=4, max_position_embeddings=8192)
    low = tiny_model("llama", **config).to("cuda", torch.bfloat16)
    high = copy.deepcopy(low).float()
    ids = random_ids(3000).cuda()
    plan = lambda: FillPlan(IdentityFiller(2, 4), tail=64, keep_rows=(1500,), window=FilledWindow(256, 0, 1, 1))

    def logits(model, routes):
        monkeypatch.setenv(ENV, routes)
        runner = Runner(adapter_for(model), chunk=1024)
        return runner.prefill(ids, fill=plan(), logits_at="full").logits.float(), runner.routes

    ours, routes = logits(low, "")
    assert (routes.causal, routes.window) == ("flash", "flash_band")
    baseline, _ = logits(low, "window=blocks,causal=lower_right")
    ref, _ = logits(high, "window=blocks")
    err, base = check.errors(ours, ref), check.errors(baseline, ref)
    assert check.within(err, base, ref, torch.bfloat16), f"runner: {err} against the masked route's {base}"
