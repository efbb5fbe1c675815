"""Adapter pieces against transformers' own functions."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

from tiny_models import tiny_model
from ridgefill.torchfill.families import adapter_for
from ridgefill.torchfill.families.base import apply_rope, rms_norm


@pytest.mark.parametrize("rot", [64, 32, 16])  # full rotary, and partial (Qwen3.5 rotates a quarter of the head)
def test_rope_equals_transformers(rot):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 7, 64, generator=gen).transpose(1, 2)  # [B, heads, n, D], a transposed view as in use
    k = torch.randn(2, 3, 5, 64, generator=gen)
    angles = torch.rand(2, 5, rot // 2, generator=gen) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [B, n, rot]
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(q_out[..., rot:], q[..., rot:])  # the pass-through dims are untouched


def test_rope_broadcasts_over_leading_layer_dims():
    """The fused projection rotates keys of every late layer at once: [M, B, heads, n, D] with cos [B, n, D]."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(4, 2, 3, 6, 32, generator=gen)
    cos, sin = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)
    out = apply_rope(k, cos, sin)
    for m in range(4):
        torch.testing.assert_close(out[m], apply_rope(k[m], cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_module(dtype):
    norm = LlamaRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 48))
    h = (torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    out = rms_norm(norm, h)
    assert out.dtype == norm(h).dtype
    torch.testing.assert_close(out, norm(h), atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_mlp_block_equals_the_decoder_layers_mlp(act):
    model = tiny_model("llama", hidden_act=act)
    adapter = adapter_for(model)
    h = torch.randn(1, 11, 64, generator=torch.Generator().manual_seed(3))
    block = model.model.layers[2]
    with torch.no_grad():
        ref = h + block.mlp(block.post_attention_layernorm(h))
        torch.testing.assert_close(adapter.mlp_block(2, h), ref, atol=1e-5, rtol=1e-5)
