"""The K/V weights of a split's late attention layers, stacked once with each layer's input-norm weight folded
in, for the fused fill projection (projection.py); the vLLM plugin
stacks each late layer's own (shard of its) weights the same way and projects with the same function."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ridgefill.torchfill.families.base import Adapter, KVWeights


@dataclass
class StackedKV:
    """The K/V weights of the late attention layers of one split, stacked once (E = Hkv·D)."""

    layers: list[int]  # the late attention layers, ascending
    index: torch.Tensor | None  # [M] their offsets among the late layers S..L-1 (None: every late layer)
    weight: torch.Tensor  # [M, H, 2E]: (g_l ∘ Wk_l)ᵀ | (g_l ∘ Wv_l)ᵀ, g_l the layer's input-norm weight
    bias: torch.Tensor | None  # [M, 1, 2E] (Qwen2)
    eps: torch.Tensor  # [M, 1, 1] float32 input-norm ε
    k_norm: torch.Tensor | None  # [M, D] per-head k RMSNorm weights (Qwen3)
    k_norm_eps: torch.Tensor | None  # [M, 1, 1, 1, 1] float32
    heads: int  # Hkv
    head_dim: int  # D

    @property
    def nbytes(self) -> int:
        parts = (self.weight, self.bias, self.k_norm)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def stack_kv(adapter: Adapter, split: int) -> StackedKV | None:
    """Stack the K/V weights of the attention layers in split..L-1; None when there are none or the family
    exposes no `kv_weights`."""
    late = list(range(split, adapter.n_layers))
    layers = [layer for layer in late if adapter.layer_kind(layer) == "attention"]
    weights = [adapter.kv_weights(layer) for layer in layers]
    if not layers or any(w is None for w in weights):
        return None
    index = None if len(layers) == len(late) else torch.tensor([l - split for l in layers], device=adapter.device)
    return stack_weights(weights, layers, index, adapter.n_kv_heads, adapter.head_dim, adapter.dtype, adapter.device)


def stack_weights(weights: list[KVWeights], layers: list[int], index: torch.Tensor | None, heads: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device) -> StackedKV:
    """Stack the K/V weights of `layers` (one KVWeights each, `heads` KV heads of `head_dim`): the runner's late
    attention layers of a split, or one layer's (tensor-parallel shard of its) weights in the vLLM plugin."""
    with torch.no_grad():
        # k = RMSNorm(y)·g·Wkᵀ: the norm weight scales Wk's columns (input dims); fold it in float32, round once.
        w = torch.stack([torch.cat([kw.k_weight, kw.v_weight]).float() * kw.norm_weight.float() for kw in weights])
        weight = w.transpose(1, 2).contiguous().to(dtype)  # [M, H, 2E]
        bias = None
        if any(kw.k_bias is not None or kw.v_bias is not None for kw in weights):
            bias = torch.stack([torch.cat([_or_zeros(kw.k_bias, kw.k_weight), _or_zeros(kw.v_bias, kw.v_weight)])
                                for kw in weights]).unsqueeze(1).to(dtype)
        k_norm = k_norm_eps = None
        if weights[0].k_norm_weight is not None:
            k_norm = torch.stack([kw.k_norm_weight for kw in weights]).to(dtype)
            k_norm_eps = torch.tensor([kw.k_norm_eps for kw in weights], device=device).view(-1, 1, 1, 1, 1)
    eps = torch.tensor([kw.norm_eps for kw in weights], device=device).view(-1, 1, 1)
    return StackedKV(layers, index, weight, bias, eps, k_norm, k_norm_eps, heads, head_dim)


def _or_zeros(bias: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    return bias if bias is not None else weight.new_zeros(weight.shape[0])
