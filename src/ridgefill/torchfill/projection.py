"""The fused fill projection: the K/V that a chunk's filled rows write into every late attention layer, computed
for all those layers at once instead of a loop of small ops per layer.

For split S and the filled rows' split state x [R, H] (R = B·nF rows), with M' = L-S late layers:
1. inputs Y [M', R, H], layer-major: Y[0] = x (layer S), Y[j] the prediction for layer S+j, from the filler's
   own `late_inputs` (a MapFiller's maps as one batched GEMM against their stacked weights; identity fill a
   stride-0 view of x, no copy);
2. norm + K/V for the M late *attention* layers: RMSNorm(Y_l)·g_l·Wkv_lᵀ + b_l = r_l ⊙ (Y_l·(g_l∘Wkv_l)ᵀ) + b_l
   with r_l = rsqrt(mean(Y_l²) + ε) a per-row scale, so the norm weights are folded into the stacked K/V
   weights once per (runner, split) and the norm becomes a scale of one bmm [M, R, H] @ [M, H, 2·Hkv·D];
3. k-norm (Qwen3) batched over layers and heads, RoPE once per position for all layers.

Each late attention layer then gets its slice; the runner only writes it into the cache. The result equals the
per-layer route (adapter.input_norm, then adapter.key_value) up to float rounding. Layers of another kind
(hybrid linear layers), and every layer of a family whose adapter has no `kv_weights`, take their predicted
input from Y and run the per-layer route. The same torch path runs on every device: a fused Triton kernel of the
norm + K/V stage was measured on an H200 (bf16, the 8B shape) slower than this path (6.4 ms against 5.0 ms) and
less accurate against a float32 reference (max relative error 7-10e-2 against 0.6-1.1e-2), and was deleted.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ridgefill.torchfill.families.base import Adapter, apply_rope
from ridgefill.torchfill.fillers import Filler
from ridgefill.torchfill.kv_stack import StackedKV, stack_kv
from ridgefill.torchfill.routes import PROJECTION_KERNELS, projection_route
from ridgefill.torchfill.timing import Stopwatch



def norm_kv_torch(stack: StackedKV, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y [M, R, H] inputs of the stack's layers (R = B·n rows), cos/sin [B, n, Dr] -> k, v [M, B, Hkv, n, D]
    (input norm, K/V projection and bias, k-norm, RoPE)."""
    m, rows, h = y.shape
    n, d = rows // batch, stack.head_dim
    distinct = y[:1] if y.stride(0) == 0 else y  # identity fill: one input shared by every layer
    ms = torch.linalg.vector_norm(distinct, dim=-1, keepdim=True, dtype=torch.float32).square_().div_(h)
    scale = torch.rsqrt(ms + stack.eps)  # [M, R, 1] per-row RMSNorm scale
    kv = torch.bmm(y, stack.weight)  # [M, R, 2E]
    kv.mul_(scale)
    if stack.bias is not None:
        kv.add_(stack.bias)
    e = stack.heads * d
    k = kv[..., :e].view(m, batch, n, stack.heads, d)
    v = kv[..., e:].view(m, batch, n, stack.heads, d)
    if stack.k_norm is not None:
        kf = k.float()
        kf = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + stack.k_norm_eps)
        k = stack.k_norm.view(m, 1, 1, 1, d) * kf.to(k.dtype)
    return apply_rope(k.transpose(2, 3), cos, sin), v.transpose(2, 3)


def scale_keys(k: torch.Tensor, key_scale: torch.Tensor | None) -> torch.Tensor:
    """k [..., Hkv, n, D] times the maps' key-scale correction key_scale [Hkv] per KV head (None: k itself)."""
    if key_scale is None:
        return k
    return k * key_scale.view(-1, 1, 1).to(k.dtype)


def layer_kv(stack: StackedKV, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             key_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's filled K/V, the runner's own math (norm_kv_torch on a one-layer stack, then scale_keys), as the
    vLLM plugin writes it: u [n, H] the rows' predicted layer input, cos/sin [n, Dr] their RoPE, key_scale [Hkv]
    (None: none) -> k, v [n, Hkv, D]."""
    y = u.to(stack.weight.dtype).unsqueeze(0)  # [1, n, H]
    k, v = norm_kv_torch(stack, y, cos.unsqueeze(0), sin.unsqueeze(0), 1)  # [1, 1, Hkv, n, D]
    return scale_keys(k[0, 0], key_scale).transpose(0, 1), v[0, 0].transpose(0, 1)


class FilledRows:
    """What one chunk's filled rows bring to each late layer l >= S: `layer(l)` gives an attention layer its
    (k, v) [B, Hkv, nF, D] and any other layer its predicted input [B, nF, H]. key_scale [L-S, Hkv] (None: none)
    multiplies each attention layer's filled keys per KV head."""

    def __init__(self, adapter: Adapter, split: int, inputs: torch.Tensor, shape: tuple[int, int, int],
                 kv: dict[int, tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor,
                 key_scale: torch.Tensor | None = None) -> None:
        self.adapter, self.split, self.inputs, self.shape = adapter, split, inputs, shape
        self.kv, self.cos, self.sin, self.key_scale = kv, cos, sin, key_scale

    def input(self, layer: int) -> torch.Tensor:
        return self.inputs[layer - self.split].reshape(self.shape)

    def layer(self, layer: int):
        a = self.adapter
        if a.layer_kind(layer) != "attention":
            return self.input(layer)
        if layer in self.kv:
            k, v = self.kv[layer]
        else:  # per-layer route
            k, v = a.key_value(layer, a.input_norm(layer, self.input(layer)), self.cos, self.sin)
        return scale_keys(k, None if self.key_scale is None else self.key_scale[layer - self.split]), v


class FillProjection:
    """Owned by a Runner: the stacked K/V weights of each split it has filled at (built once), and the fused
    projection of a chunk's filled rows. backend: auto or torch (the fused torch path; torchfill/routes.py resolves
    auto), or layers (no fused K/V: every layer takes the per-layer route, the reference). timer: a Stopwatch
    that the wall time spent here is added to (None: not timed)."""

    def __init__(self, adapter: Adapter, backend: str = "auto", timer: Stopwatch | None = None) -> None:
        if backend not in PROJECTION_KERNELS:
            raise ValueError(f"backend {backend!r} not in {PROJECTION_KERNELS}")
        self.adapter, self.backend, self.timer = adapter, projection_route(backend), timer
        self._stacks: dict[int, StackedKV | None] = {}

    def with_timer(self, timer: Stopwatch | None) -> "FillProjection":
        """The same projection (backend, and the stacked weights already built, shared) timed by `timer`."""
        other = FillProjection(self.adapter, self.backend, timer)
        other._stacks = self._stacks
        return other

    def stack(self, split: int) -> StackedKV | None:
        """The stacked K/V weights of the split's late attention layers; None: no fused path (no attention layer
        among them, or a family without `kv_weights`)."""
        if split not in self._stacks:
            self._stacks[split] = stack_kv(self.adapter, split)
        return self._stacks[split]

    def backend_for(self, split: int) -> str:
        """The route the filled rows of `split` take: "layers" (per layer: asked for, or no fused path) or "torch"
        (the fused projection)."""
        stack = self.stack(split) if self.backend != "layers" else None
        return "layers" if stack is None else "torch"

    def fill(self, filler: Filler, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, previous: torch.Tensor | None = None) -> FilledRows:
        """x [B, nF, H] split state of the filled rows at `positions` [nF]; cos/sin [B, nF, Dr] their RoPE;
        previous [B, nF, K·H]: their lookback windows' split states (maps with lookback K > 0)."""
        with self.timer.span() if self.timer is not None else nullcontext():
            b, n, _ = x.shape
            inputs = filler.late_inputs(x, positions, previous)  # [L-S, B·nF, H]
            kv = {}
            stack = self.stack(filler.split) if n and self.backend != "layers" else None
            if stack is not None:
                y = inputs if stack.index is None else inputs[stack.index]  # [M, B·nF, H]
                k, v = norm_kv_torch(stack, y, cos, sin, b)  # [M, B, Hkv, nF, D]
                kv = {layer: (k[j], v[j]) for j, layer in enumerate(stack.layers)}
        return FilledRows(self.adapter, filler.split, inputs, x.shape, kv, cos, sin, filler.key_scale)
