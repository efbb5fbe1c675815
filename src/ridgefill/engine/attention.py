"""Causal attention of a block of query rows over a layer's cached keys when the queries do not start at position 0
(SDPA's is_causal aligns top-left, which is wrong there): the CPU path through the flash kernel's log-sum-exp,
the CUDA path through torch's lower-right causal bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLASH_CPU = "_scaled_dot_product_flash_attention_for_cpu"  # returns (out, logsumexp); takes GQA heads


def prefix_then_block(q, keys, values, prefix: int, scale: float) -> torch.Tensor:
    """Queries at positions prefix..prefix+nq-1 over keys 0..prefix+nq-1: unmasked attention to the prefix and
    causal attention within the block, merged by softmax weights from their log-sum-exps."""
    flash = getattr(torch.ops.aten, FLASH_CPU)
    out_p, lse_p = flash(q, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False, scale=scale)[:2]
    out_b, lse_b = flash(q, keys[:, :, prefix:], values[:, :, prefix:], 0.0, True, scale=scale)[:2]
    w = torch.sigmoid(lse_p - lse_b).unsqueeze(-1).to(out_p.dtype)  # [B, Hq, nq, 1] share of the prefix
    return out_b.add_((out_p - out_b).mul_(w))


def lower_right_causal(q, keys, values, scale: float) -> torch.Tensor:
    """The last nq positions over keys 0..n_keys-1 through torch's lower-right causal bias (its fused kernels
    need as many K/V heads as query heads, so GQA heads are repeated)."""
    from torch.nn.attention.bias import causal_lower_right

    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(q.shape[2], keys.shape[2]),
                                          scale=scale)
