"""Family adapters: where a Hugging Face decoder keeps its norms, projections, RoPE and MLP.

The runner only talks to an `Adapter`; it never touches a model's modules itself. An adapter exposes
the pieces of one decoder layer as small functions so the runner can run them on any subset of rows:

    h_normed = input_norm(l, h)                       # [B, n, H]
    q, gate  = query(l, h_normed, cos, sin)           # q [B, Hq, n, D] (RoPE applied); gate: None or
                                                      #   what attention_output needs (output gates)
    k, v     = key_value(l, h_normed, cos, sin)       # [B, Hkv, n, D] (k-norm and RoPE applied)
    h        = h + attention_output(l, attn, gate)    # attn [B, Hq, n, D]
    out      = state_mixer(l, h_normed, state)        # linear-attention layers only: [B, n, H],
                                                      #   advancing the layer's recurrent and conv state
    h        = mlp_block(l, h)                        # h + mlp(post_attention_norm(h))

To add a family, subclass `Adapter` (or `DenseAdapter` when the layer has the Llama shape) and
add its `model_type` to `_FAMILIES` in families/__init__.py (see docs/adding-a-family.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn



def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, n, D]; cos/sin [..., n, Dr] with Dr <= D (partial rotary rotates the first Dr dims).

    The rotate-half form x·cos + rotate_half(x)·sin, with rotate_half(x) = (-x2, x1) for the halves x1, x2 of
    the rotated dims, written as one product and two in-place multiply-adds on the halves: no concatenated
    temporaries (on the CPU this is ~7x faster than building rotate_half(x), and it runs once per layer)."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    rot = cos.shape[-1]
    half = rot // 2
    x_rot = x[..., :rot]
    out = x_rot * cos
    out[..., :half].addcmul_(x_rot[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x_rot[..., :half], sin[..., half:])
    if rot == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot:]), dim=-1)


def rms_norm(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The dense families' RMSNorm module (Llama, Qwen2, Qwen3: weight · (h·rsqrt(mean(h²)+ε)) computed in float32
    and cast back before the weight) through torch's fused kernel: one pass instead of five."""
    if h.dtype == torch.float32:
        return F.rms_norm(h, (h.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(h.float(), (h.shape[-1],), None, norm.variance_epsilon).to(h.dtype)


@dataclass(frozen=True)
class KVWeights:
    """What a layer's K/V of a filled row needs (for the fused fill projection): input RMSNorm, k/v Linear
    weights ([Hkv*D, H]) and biases, and the per-head k RMSNorm (Qwen3) if any."""

    norm_weight: torch.Tensor  # [H]
    norm_eps: float
    k_weight: torch.Tensor  # [Hkv*D, H]
    k_bias: torch.Tensor | None  # [Hkv*D]
    v_weight: torch.Tensor
    v_bias: torch.Tensor | None
    k_norm_weight: torch.Tensor | None = None  # [D]
    k_norm_eps: float = 0.0


class Adapter:
    """Base class: what every family provides. Subclasses fill in the layer pieces."""

    family = "base"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.decoder = model.model
        self.layers = self.decoder.layers
        self.n_layers = len(self.layers)
        self.hidden_size = self.config.hidden_size
        self.n_heads = self.config.num_attention_heads
        self.n_kv_heads = self.config.num_key_value_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.n_heads
        self.max_positions = getattr(self.config, "max_position_embeddings", None)

    # --- whole-model pieces -------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, n] -> [B, n, H]"""
        return self.decoder.embed_tokens(ids)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, n] -> cos, sin [B, n, Dr] using the checkpoint's own RoPE scaling."""
        return self.decoder.rotary_emb(like, position_ids=positions)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [B, n, H] -> [B, n, V]."""
        return self.model.lm_head(self.decoder.norm(h))

    def use_routes(self, routes) -> None:
        """The routes its runner chose (torchfill/routes.py, once per runner); a family with a route of its own (the
        hybrids' delta rule) keeps what it needs, so that an overridden route is the one that runs."""

    def layer_kind(self, layer: int) -> str:
        return "attention"

    # --- one layer's pieces ---------------------------------------------------------------------
    def input_norm(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].input_layernorm(h)

    def mlp_block(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        return h + block.mlp(block.post_attention_layernorm(h))

    def query(self, layer, h_normed, cos, sin):  # pragma: no cover - abstract
        raise NotImplementedError

    def key_value(self, layer, h_normed, cos, sin):  # pragma: no cover - abstract
        raise NotImplementedError

    def attention_output(self, layer: int, attn: torch.Tensor, gate=None) -> torch.Tensor:
        """attn [B, Hq, n, D] -> [B, n, H] through o_proj."""
        b, _, n, _ = attn.shape
        return self.layers[layer].self_attn.o_proj(attn.transpose(1, 2).reshape(b, n, -1))

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5

    def kv_weights(self, layer: int) -> KVWeights | None:
        """The K/V weights of an attention layer for the fused fill projection; None: this family has no
        fused path (filled rows then go through `input_norm` and `key_value` layer by layer)."""
        return None

    def describe(self) -> dict:
        return {
            "family": self.family,
            "layers": self.n_layers,
            "hidden_size": self.hidden_size,
            "heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "layer_kinds": [self.layer_kind(i) for i in range(self.n_layers)],
        }
