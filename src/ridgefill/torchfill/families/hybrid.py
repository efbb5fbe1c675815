"""Adapters for hybrid decoders that mix Gated DeltaNet (linear-attention) layers with full-attention layers:
Qwen3.5 (`qwen3_5` / `qwen3_5_text`) and Qwen3-Next (`qwen3_next`, sparse MoE MLP with a shared expert).

Full-attention layers: q_proj emits the query and a per-head output gate, q/k get a per-head RMSNorm, RoPE
is partial (the first `partial_rotary_factor` of each head), and the gate multiplies the attention output
through a sigmoid before o_proj.

Linear layers: the input projections give q, k, v (through a depthwise causal conv + SiLU), the output gate z
and per-head beta (write strength) and a (decay); the gated delta rule (`delta_rule.py`) mixes the rows and a
gated RMSNorm (the layer's `norm`, gated by z) and out_proj give the mixer output.

RidgeFill on a hybrid model. A linear layer has no per-row cache: its state must pass through every row in
position order. So the runner's `_state_layer` runs the mixer over *all* rows of a chunk, taking the true input
for full rows (the tail and `keep_rows`) and the predicted input (layer S: the split state) for filled rows,
merged back into row order; it keeps the mixer output of the full rows only. A `keep_rows` entry inside the
filled region therefore updates the state with its true input between filled rows, exactly where it sits in the
prompt. With exact (oracle) predictions every state is the exact model's. Filled rows write attention K/V only
in the full-attention layers of the filled range S..L-1; `filled_attention_layers(split)` lists them (it may be
empty: the split then only changes what the linear layers' states have seen).
"""

from __future__ import annotations

import torch
from torch import nn

from ridgefill.torchfill.families.base import Adapter, apply_rope
from ridgefill.torchfill.cache import StateCache
from ridgefill.torchfill.families.delta_rule import causal_conv, chunk_gated_delta_rule
from ridgefill.errors import RidgefillError

_KINDS = {"full_attention": "attention", "linear_attention": "linear"}


class HybridAdapter(Adapter):
    """Shared pieces of the Qwen3.5 / Qwen3-Next decoder; subclasses only split the linear layer's input
    projections (`_project`)."""

    family = "hybrid"
    delta_chunk = 64  # rows per chunk of the gated delta rule (math is exact for any value)
    delta_kernel = False  # the delta rule by fla's kernel: the runner's route is "fla" (use_routes)

    def __init__(self, model: nn.Module) -> None:
        if not hasattr(getattr(model, "model", None), "layers"):
            raise RidgefillError(
                f"{type(model).__name__} keeps its decoder elsewhere: load the checkpoint with "
                "AutoModelForCausalLM to get the text-only model"
            )
        super().__init__(model)
        types = list(self.config.layer_types)
        unknown = sorted(set(types) - set(_KINDS))
        if unknown:
            raise RidgefillError(f"unsupported layer types {unknown}: ridgefill supports {sorted(_KINDS)}")
        self.kinds = [_KINDS[t] for t in types]
        from transformers.activations import ACT2FN  # here, not at import: 3 s that commands without a model skip

        self.activation = ACT2FN[self.config.hidden_act]

    def use_routes(self, routes) -> None:
        self.delta_kernel = routes.delta_rule == "fla"

    def layer_kind(self, layer: int) -> str:
        return self.kinds[layer]

    def new_state_cache(self, layer: int) -> StateCache:
        return StateCache()

    def filled_attention_layers(self, split: int) -> list[int]:
        """The full-attention layers in the filled range split..L-1 (where filled rows write K/V)."""
        return [layer for layer in range(split, self.n_layers) if self.kinds[layer] == "attention"]

    def describe(self) -> dict:
        return {**super().describe(), "linear_layers": self.kinds.count("linear")}

    # --- full-attention layers ----------------------------------------------------------------------
    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim)  # [B, n, heads, D]

    def query(self, layer, h_normed, cos, sin):
        """q [B, Hq, n, D] (q-norm, partial RoPE) and the output gate [B, n, Hq*D] (before the sigmoid)."""
        attn = self.layers[layer].self_attn
        b, n, _ = h_normed.shape
        q, gate = attn.q_proj(h_normed).view(b, n, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = attn.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin), gate.reshape(b, n, -1)

    def key_value(self, layer, h_normed, cos, sin):
        attn = self.layers[layer].self_attn
        k = attn.k_norm(self._heads(attn.k_proj(h_normed), self.n_kv_heads))
        v = self._heads(attn.v_proj(h_normed), self.n_kv_heads)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def attention_output(self, layer: int, attn: torch.Tensor, gate=None) -> torch.Tensor:
        b, _, n, _ = attn.shape
        out = attn.transpose(1, 2).reshape(b, n, -1) * torch.sigmoid(gate)
        return self.layers[layer].self_attn.o_proj(out)

    # --- linear-attention layers --------------------------------------------------------------------
    def _project(self, layer: int, x: torch.Tensor):
        """x [B, n, H] -> mixed_qkv [B, n, 2*Hk*Dk + Hv*Dv] (conv input, q|k|v), z [B, n, Hv, Dv],
        b [B, n, Hv] (beta logits), a [B, n, Hv] (decay input)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def state_mixer(self, layer: int, x_normed: torch.Tensor, cache: StateCache) -> torch.Tensor:
        """The Gated DeltaNet mixer on n consecutive rows after `cache`; advances the cache in place.
        x_normed [B, n, H] -> [B, n, H] (after out_proj)."""
        lin = self.layers[layer].linear_attn
        bsz, n, _ = x_normed.shape
        mixed, z, b, a = self._project(layer, x_normed)
        conv_out, cache.conv = causal_conv(
            mixed.transpose(1, 2), lin.conv1d.weight.squeeze(1), lin.conv1d.bias, cache.conv, self.activation
        )
        q, k, v = conv_out.transpose(1, 2).split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        q = q.reshape(bsz, n, -1, lin.head_k_dim)  # [B, n, Hk, Dk]
        k = k.reshape(bsz, n, -1, lin.head_k_dim)
        v = v.reshape(bsz, n, -1, lin.head_v_dim)  # [B, n, Hv, Dv]
        beta = b.sigmoid()
        g = -lin.A_log.float().exp() * nn.functional.softplus(a.float() + lin.dt_bias)  # [B, n, Hv] log decay
        out, cache.recurrent = chunk_gated_delta_rule(q, k, v, g, beta, cache.recurrent, self.delta_chunk,
                                                     use_kernel=self.delta_kernel)
        cache.length += n
        out = lin.norm(out.reshape(-1, lin.head_v_dim), z.reshape(-1, lin.head_v_dim))  # gated RMSNorm
        return lin.out_proj(out.reshape(bsz, n, -1))

    def mlp_block(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        out = block.mlp(block.post_attention_layernorm(h))
        if isinstance(out, tuple):  # some MoE blocks also return router logits
            out = out[0]
        return h + out


class Qwen3_5Adapter(HybridAdapter):
    """Qwen3.5 text decoder: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, dense MLP.

    Its rotary embedding is multimodal (mrope: temporal/height/width sections). For text all three position
    streams equal the token position: `rope` passes plain positions [B, n], which the rotary module broadcasts
    to the three streams, giving the text-only forward's cos/sin."""

    family = "qwen3_5"

    def _project(self, layer, x):
        lin = self.layers[layer].linear_attn
        b, n, _ = x.shape
        z = lin.in_proj_z(x).view(b, n, -1, lin.head_v_dim)
        return lin.in_proj_qkv(x), z, lin.in_proj_b(x), lin.in_proj_a(x)


class Qwen3NextAdapter(HybridAdapter):
    """Qwen3-Next: fused in_proj_qkvz / in_proj_ba laid out per key-head group; sparse MoE MLP with a gated
    shared expert (the block returns the summed output; `mlp_block` also accepts a (out, logits) tuple)."""

    family = "qwen3_next"

    def _project(self, layer, x):
        lin = self.layers[layer].linear_attn
        b, n, _ = x.shape
        hk, hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
        r = hv // hk  # value heads per key head
        qkvz = lin.in_proj_qkvz(x).view(b, n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        ba = lin.in_proj_ba(x).view(b, n, hk, 2 * r)
        beta_logits, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(b, n, -1), k.reshape(b, n, -1), v.reshape(b, n, -1)], dim=-1)
        return mixed, z.reshape(b, n, hv, dv), beta_logits.reshape(b, n, hv), a.reshape(b, n, hv)
