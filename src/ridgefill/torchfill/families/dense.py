"""Llama-shaped decoders: Llama-3.x / SmolLM2, Qwen2 (q/k/v biases in the Linear modules) and Qwen3 (per-head
RMSNorm on q and k before RoPE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridgefill.torchfill.families.base import Adapter, KVWeights, apply_rope, rms_norm
from ridgefill.errors import RidgefillError


class DenseAdapter(Adapter):
    """Llama-shaped layers: Llama-3.x / SmolLM2 / Qwen2 (q/k/v biases live in the Linear modules)
    and Qwen3 (per-head RMSNorm on q and k before RoPE)."""

    family = "llama"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        layer_types = getattr(self.config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise RidgefillError(
                f"this checkpoint uses sliding-window attention layers ({sorted(set(layer_types))}); "
                "ridgefill supports full attention only for dense families: disable use_sliding_window"
            )

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim)  # [B, n, heads, D]

    def input_norm(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.layers[layer].input_layernorm, h)

    def mlp_block(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h + down(act(gate(x)) · up(x)), x = post-attention norm of h: the module's own computation, with the
        activation and product in place on the gate's output (no two extra [n, I] temporaries)."""
        block = self.layers[layer]
        mlp, x = block.mlp, rms_norm(block.post_attention_layernorm, h)
        gate = mlp.gate_proj(x)  # [B, n, I]
        act = F.silu(gate, inplace=True) if self.config.hidden_act == "silu" else mlp.act_fn(gate)
        return h + mlp.down_proj(act.mul_(mlp.up_proj(x)))

    def query(self, layer, h_normed, cos, sin):
        attn = self.layers[layer].self_attn
        q = self._heads(attn.q_proj(h_normed), self.n_heads)
        if hasattr(attn, "q_norm"):
            q = rms_norm(attn.q_norm, q)
        return apply_rope(q.transpose(1, 2), cos, sin), None

    def key_value(self, layer, h_normed, cos, sin):
        attn = self.layers[layer].self_attn
        k = self._heads(attn.k_proj(h_normed), self.n_kv_heads)
        if hasattr(attn, "k_norm"):
            k = rms_norm(attn.k_norm, k)
        v = self._heads(attn.v_proj(h_normed), self.n_kv_heads)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def kv_weights(self, layer: int) -> KVWeights:
        block = self.layers[layer]
        attn, norm = block.self_attn, block.input_layernorm
        k_norm = getattr(attn, "k_norm", None)
        return KVWeights(
            norm.weight, norm.variance_epsilon, attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight,
            attn.v_proj.bias, None if k_norm is None else k_norm.weight,
            0.0 if k_norm is None else k_norm.variance_epsilon,
        )


class Qwen2Adapter(DenseAdapter):
    family = "qwen2"


class Qwen3Adapter(DenseAdapter):
    family = "qwen3"
