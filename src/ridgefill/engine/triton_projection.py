"""The fill projection's norm + K/V stage as one Triton kernel (CUDA; the tests run it on the CPU with
TRITON_INTERPRET=1, which must be set before this module is imported).

One program computes one K or V head of BLOCK_R rows of one late layer: it streams the rows' inputs y [BLOCK_R, H]
against the head's columns of the stacked, norm-folded K/V weights, accumulating in float32 the two half-heads
(lo = dims 0..D/2-1, hi = D/2..D-1) and the rows' sum of squares; the epilogue applies the RMSNorm scale
rsqrt(mean(y²)+ε), the bias, and for K heads the k-norm and RoPE (rotate_half pairs dim i with i+D/2, so the
two half accumulators rotate in registers), and stores the head into k or v [M, R, Hkv, D].
Same math as projection.norm_kv_torch; it needs full-head RoPE and D/2 a power of two >= 16 (`supports`).
Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly, so when interpreting the kernel upcasts its dot
operands to float32 first (a product of two bf16 values is exact in float32: same result as the GPU's bf16 dot).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ridgefill.engine.kv_stack import StackedKV

BLOCK_R, BLOCK_H = 64, 64


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def supports(stack: StackedKV, rotary_dim: int) -> bool:
    half = stack.head_dim // 2
    return available() and rotary_dim == stack.head_dim and half >= 16 and half & (half - 1) == 0


if available():
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_kv_kernel(y_ptr, w_ptr, bias_ptr, eps_ptr, knorm_ptr, knorm_eps_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr,
                        R, H, stride_ym, stride_yr, stride_wm, stride_wh,
                        KV_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KNORM: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_r = tl.program_id(0)
        head = tl.program_id(1)  # 0..Hkv-1: K heads, Hkv..2Hkv-1: V heads
        m = tl.program_id(2)  # late layer
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        half = tl.arange(0, HALF)
        col_lo = head * D + half  # columns of the stacked [H, 2E] weight
        col_hi = col_lo + HALF
        acc_lo = tl.zeros((BLOCK_R, HALF), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_R, HALF), dtype=tl.float32)
        ss = tl.zeros((BLOCK_R,), dtype=tl.float32)
        y_rows = y_ptr + m * stride_ym + rows * stride_yr
        w_layer = w_ptr + m * stride_wm
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < H
            y = tl.load(y_rows[:, None] + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            yf = y.to(tl.float32)
            ss += tl.sum(yf * yf, axis=1)
            w_lo = tl.load(w_layer + hs[:, None] * stride_wh + col_lo[None, :], mask=h_ok[:, None], other=0.0)
            w_hi = tl.load(w_layer + hs[:, None] * stride_wh + col_hi[None, :], mask=h_ok[:, None], other=0.0)
            if UPCAST:
                y, w_lo, w_hi = yf, w_lo.to(tl.float32), w_hi.to(tl.float32)
            acc_lo = tl.dot(y, w_lo, acc_lo, input_precision=PRECISION)
            acc_hi = tl.dot(y, w_hi, acc_hi, input_precision=PRECISION)
        scale = tl.rsqrt(ss / H + tl.load(eps_ptr + m))  # the input RMSNorm, as a per-row scale
        lo = acc_lo * scale[:, None]
        hi = acc_hi * scale[:, None]
        if HAS_BIAS:
            lo += tl.load(bias_ptr + m * 2 * KV_HEADS * D + col_lo).to(tl.float32)[None, :]
            hi += tl.load(bias_ptr + m * 2 * KV_HEADS * D + col_hi).to(tl.float32)[None, :]
        out = (m * R + rows[:, None]) * (KV_HEADS * D)  # k, v: [M, R, Hkv, D]
        if head < KV_HEADS:
            if HAS_KNORM:
                kscale = tl.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / D
                                  + tl.load(knorm_eps_ptr + m))
                lo = lo * kscale[:, None] * tl.load(knorm_ptr + m * D + half).to(tl.float32)[None, :]
                hi = hi * kscale[:, None] * tl.load(knorm_ptr + m * D + HALF + half).to(tl.float32)[None, :]
            rope = rows[:, None] * D + half[None, :]
            c_lo = tl.load(cos_ptr + rope, mask=row_ok[:, None], other=0.0).to(tl.float32)
            c_hi = tl.load(cos_ptr + rope + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
            s_lo = tl.load(sin_ptr + rope, mask=row_ok[:, None], other=0.0).to(tl.float32)
            s_hi = tl.load(sin_ptr + rope + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
            k_lo = lo * c_lo - hi * s_lo
            k_hi = hi * c_hi + lo * s_hi
            dst = k_ptr + out + head * D + half[None, :]
            tl.store(dst, k_lo.to(k_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(dst + HALF, k_hi.to(k_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            dst = v_ptr + out + (head - KV_HEADS) * D + half[None, :]
            tl.store(dst, lo.to(v_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(dst + HALF, hi.to(v_ptr.dtype.element_ty), mask=row_ok[:, None])


def norm_kv_triton(stack: StackedKV, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as projection.norm_kv_torch: y [M, R, H], cos/sin [B, n, D] -> k, v [M, B, Hkv, n, D]."""
    if not available():
        raise RuntimeError("triton is not installed")
    m, rows, h = y.shape
    d, heads = stack.head_dim, stack.heads
    n = rows // batch
    if y.stride(2) != 1:
        y = y.contiguous()
    k = y.new_empty(m, rows, heads, d)
    v = y.new_empty(m, rows, heads, d)
    cos2, sin2 = cos.reshape(rows, d).contiguous(), sin.reshape(rows, d).contiguous()
    weight = stack.weight
    grid = (triton.cdiv(rows, BLOCK_R), 2 * heads, m)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    _norm_kv_kernel[grid](
        y, weight, stack.bias if stack.bias is not None else weight, stack.eps,
        stack.k_norm if stack.k_norm is not None else weight,
        stack.k_norm_eps if stack.k_norm_eps is not None else stack.eps, cos2, sin2, k, v,
        rows, h, y.stride(0), y.stride(1), weight.stride(0), weight.stride(1),
        KV_HEADS=heads, D=d, HALF=d // 2, BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, HAS_BIAS=stack.bias is not None,
        HAS_KNORM=stack.k_norm is not None, PRECISION="ieee" if y.dtype == torch.float32 or interpreting else "tf32",
        UPCAST=interpreting and y.dtype != torch.float32,
    )
    shape = (m, batch, n, heads, d)
    return k.view(shape).transpose(2, 3), v.view(shape).transpose(2, 3)
