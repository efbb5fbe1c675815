"""Gated DeltaNet math: the short causal conv and the chunked gated delta rule, with state in and out.

Both continue from a previous state, so a sequence can be run in pieces (runner chunks, decode steps) and give
the same result as one pass. Shapes follow transformers' Qwen3-Next / Qwen3.5 layers:

    q, k: [B, n, Hk, Dk]   v: [B, n, Hv, Dv]   g (log decay, <= 0), beta: [B, n, Hv]   state: [B, Hv, Dk, Dv]

Per value head, with q and k L2-normalised and q scaled by Dk^-1/2, the gated delta rule is

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T,   a_t = exp(g_t);   o_t = S_t^T q_t.

`chunk_gated_delta_rule` evaluates it chunk by chunk (the WY/UT form: one triangular solve per chunk and a
scan over chunks, never over tokens; chunks are `chunk_size` rows, the last one zero-padded, as in transformers'
torch fallback; a single row takes one recurrent step). With `use_kernel` (the runner's delta rule route is "fla":
CUDA with flash-linear-attention installed, torchfill/routes.py) it uses fla's kernel.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv continuing from `state`.

    x [B, C, n]; weight [C, K]; state [B, C, K-1] (the previous K-1 inputs; None = zeros).
    Returns activation(conv) [B, C, n] and the new state [B, C, K-1] (the last K-1 inputs).
    """
    b, c, _ = x.shape
    kernel = weight.shape[-1]
    if state is None:
        state = x.new_zeros(b, c, kernel - 1)
    full = torch.cat([state.to(x.dtype), x], dim=-1)  # [B, C, K-1+n]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), bias, groups=c)  # [B, C, n]
    return activation(out).to(x.dtype), full[:, :, full.shape[-1] - (kernel - 1) :].clone()


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n rows from `initial_state` (None = zeros), q/k L2-normalised inside; with
    `use_kernel`, by fla's fused kernel (the caller's route says so).

    Returns out [B, n, Hv, Dv] (dtype of v) and the final state [B, Hv, Dk, Dv] (float32).
    """
    if use_kernel:
        return _run_fla(_fla_kernel(), q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    b, n, _, dk = k.shape
    hv, dv = v.shape[-2:]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    state = q.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.float()
    if n == 0:
        out = v
    elif n == 1:  # a decode row: one step of the recurrence
        out, state = _step(q, k, v, g, beta, state)
    else:
        out, state = _chunked(q, k, v, g, beta, state, chunk_size)
    return out.transpose(1, 2).to(out_dtype), state


def _heads_first(q, k, v, g, beta):
    """fp32, heads before rows: q, k [B, Hv, n, Dk] (L2-normalised, q scaled by Dk^-1/2), v [B, Hv, n, Dv],
    g, beta [B, Hv, n]."""
    hk, hv = k.shape[2], v.shape[2]
    if hv != hk:  # grouped value heads: each q/k head serves hv // hk consecutive value heads
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k), v, g, beta


def _chunked(q, k, v, g, beta, state, chunk_size):
    """Chunk-parallel form (shapes as `_heads_first`; state [B, Hv, Dk, Dv]) -> out [B, Hv, n, Dv], state."""
    b, hv, n, dv = v.shape
    c = chunk_size
    pad = (-n) % c  # padded rows: beta = 0 (no write) and g = 0 (no decay), so the state is unchanged
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n_chunks = (n + pad) // c
    q, k, v = (t.reshape(b, hv, n_chunks, c, -1) for t in (q, k, v))  # [B, Hv, N, C, D]
    g, beta = (t.reshape(b, hv, n_chunks, c) for t in (g, beta))  # [B, Hv, N, C]

    cum = g.cumsum(-1)  # [B, Hv, N, C] log decay from the chunk start through row i
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= i
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # [.., C, C] i<-j
    k_beta = k * beta.unsqueeze(-1)
    # UT transform: (I + A) W = beta*K with A[i, j] = beta_i k_i.k_j decay(i<-j), j < i
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = a + torch.eye(c, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, Hv, N, C, C] intra-chunk, diagonal included
    q_decayed = q * cum.exp().unsqueeze(-1)  # reads the state entering the chunk
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes decayed to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, Hv, N, 1, 1]

    out = torch.empty_like(v)  # [B, Hv, N, C, Dv]
    for i in range(n_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state  # [B, Hv, C, Dv] what the state does not yet predict
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, hv, n_chunks * c, dv)[:, :, :n], state


def _step(q, k, v, g, beta, state):
    """One row: q, k [B, H, 1, Dk], v [B, H, 1, Dv], g, beta [B, H, 1], state [B, H, Dk, Dv] (all fp32)."""
    state = state * g.exp()[..., None]  # [B, H, 1, 1] broadcast: decay
    k_col = k.transpose(-1, -2)  # [B, H, Dk, 1]
    delta = (v - k @ state) * beta.unsqueeze(-1)  # [B, H, 1, Dv] correction of what the state predicts
    state = state + k_col @ delta
    return q @ state, state  # [B, H, 1, Dv]


# --- optional kernel hook (flash-linear-attention) -------------------------------------------------------
# NOT exercised by the test suite (fla needs CUDA + Triton). Where the runner's delta rule route is "fla"
# (torchfill/routes.py: CUDA, fla importable), `chunk_gated_delta_rule` hands the work to fla's fused kernel, which
# computes the same rule.
def _fla_kernel():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    return fla_chunk


def _run_fla(kernel, q, k, v, g, beta, initial_state):
    hv, hk = v.shape[-2], k.shape[-2]
    if hv != hk:
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    out, state = kernel(
        q, k, v, g=g.float(), beta=beta, initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out.to(v.dtype), state.float()
