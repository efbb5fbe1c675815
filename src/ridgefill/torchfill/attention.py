"""Causal attention of a block of query rows that are the last nq of a layer's n_keys cached positions (every chunk
row before the split; a tail that ends its chunk), when the queries do not start at position 0 (SDPA's is_causal
aligns top-left, which is wrong there). torchfill/routes.py chooses which of these a device runs (`causal_attention`):

- "flash": CUDA, fp16/bf16: one call of torch's flash-attention op with the unrepeated GQA K/V. Flash-attention 2
  aligns its causal mask lower-right when nq < n_keys, which is exactly this case: torch's own
  nn/attention/bias.py (CausalBias._dispatch, causal_lower_right) calls the same op with is_causal=True for it,
  and aten/src/ATen/native/transformers/cuda/sdp_utils.cpp says so in check_flash_causal_non_square_seqlens
  ("FlashAttention 2 ... is now aligned to lower_right"), which is why SDPA itself refuses is_causal with
  nq != n_keys. The same file's can_use_flash_attention checks heads with
  check_batch_size_and_num_heads_dense<backend_supports_grouped_query_attention = true>, and attention.cpp's
  scaled_dot_product_attention(..., enable_gqa) passes key and value to _scaled_dot_product_flash_attention as
  they are (no repeat_interleave): the kernel reads K/V head h // (Hq / Hkv) itself. No mask, no K/V copy.
- "cpu_split" (CPU): the unmasked prefix and the causal block through the CPU flash kernel, merged by their
  log-sum-exps (`prefix_then_block`): no masked work, no mask.
- "cudnn_split" (CUDA, a candidate for measurement): the same split through the cuDNN op, whose causal mask is
  top-left (so the square block is right, and the prefix takes none).
- "lower_right" (anywhere; the CUDA route in fp32, where flash has no kernel): torch's lower-right causal bias,
  GQA heads repeated (its efficient-attention call takes as many K/V heads as query heads). fp32 on a GPU is the
  reference dtype, not the speed target; this route is correct there and needs no kernel of its own.

A kernel here is (q, k, v, causal, scale) -> (out [B, Hq, nq, D], lse [B, Hq, nq] float32); causal is top-left
(only ever asked of a square block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLASH_CPU = "_scaled_dot_product_flash_attention_for_cpu"  # returns (out, logsumexp); takes GQA heads


def flash_cpu(q, k, v, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """The CPU flash kernel: (out, lse); mask (optional) an additive or boolean [nq, nk] mask."""
    return getattr(torch.ops.aten, FLASH_CPU)(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]


def cudnn(q, k, v, causal: bool, scale: float):
    """torch's cuDNN attention op (CUDA), its log-sum-exp asked for: (out, lse)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    return out, lse.reshape(out.shape[:-1])  # cuDNN's lse carries a trailing singleton dim


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's (out [..., nq, D], lse [..., nq]): each
    part weighted by its share of the softmax mass, sigmoid(lse_a - lse_b) for a. A part whose lse is -inf (no
    key) weighs 0. In float32 (written into out_b when it is float32): merged in bf16, the two rounded parts' sum
    rounds again, which measured 9x the error of one kernel call (scripts/attention_check.py, CPU, bf16)."""
    w = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)  # [..., nq, 1] a's share
    if out_b.dtype == torch.float32:
        return out_b.add_((out_a - out_b).mul_(w))
    return out_b.float().lerp_(out_a.float(), w).to(out_b.dtype)


def prefix_then_block(q, keys, values, prefix: int, scale: float, kernel=flash_cpu) -> torch.Tensor:
    """Queries at positions prefix..prefix+nq-1 over keys 0..prefix+nq-1: unmasked attention to the prefix and
    causal attention within the block, merged by their log-sum-exps."""
    out_p, lse_p = kernel(q, keys[:, :, :prefix], values[:, :, :prefix], False, scale)
    out_b, lse_b = kernel(q, keys[:, :, prefix:], values[:, :, prefix:], True, scale)
    return merge(out_p, lse_p, out_b, lse_b)


def flash_lower_right(q, keys, values, scale: float) -> torch.Tensor:
    """CUDA, fp16/bf16, head dim a multiple of 8 (routes.py checks, once per runner): the last nq positions over
    keys 0..n_keys-1, one flash call, GQA K/V as they are (see the module's docstring)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, True, False, scale=scale)[0]


def lower_right_causal(q, keys, values, scale: float) -> torch.Tensor:
    """The last nq positions over keys 0..n_keys-1 through torch's lower-right causal bias (its fused kernels
    need as many K/V heads as query heads, so GQA heads are repeated)."""
    from torch.nn.attention.bias import causal_lower_right

    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(q.shape[2], keys.shape[2]),
                                          scale=scale)


def causal_attention(route: str, q, keys, values, scale: float) -> torch.Tensor:
    """q [B, Hq, nq, D], the last nq of the n_keys positions of keys/values [B, Hkv, n_keys, D], causally, by
    `route` (routes.CAUSAL_ROUTES). One query, or as many as keys, is plain SDPA (no prefix: top-left is right)."""
    nq, n_keys = q.shape[2], keys.shape[2]
    if nq == 1 or nq == n_keys:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=nq > 1, scale=scale,
                                              enable_gqa=q.shape[1] != keys.shape[1])
    if route == "flash":
        return flash_lower_right(q, keys, values, scale)
    if route == "cpu_split":
        return prefix_then_block(q, keys, values, keys.shape[2] - q.shape[2], scale)
    if route == "cudnn_split":
        return prefix_then_block(q, keys, values, keys.shape[2] - q.shape[2], scale, kernel=cudnn)
    return lower_right_causal(q, keys, values, scale)
