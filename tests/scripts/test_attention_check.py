"""scripts/attention_check.py's error bound for the fp32 CUDA route (torch's memory-efficient kernel, which multiplies
fp32 in 3xTF32 on sm80+), run on the CPU with that arithmetic emulated: the kernel's own rounding passes the bound,
while a wrong alignment (one key too early or too late, top-left) or plain TF32 fails it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ridgefill.torchfill.attention import causal_attention

_spec = importlib.util.spec_from_file_location(
    "attention_check", Path(__file__).resolve().parents[2] / "scripts" / "attention_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

SHAPE = dict(heads=8, kv_heads=2, head_dim=128)
SCALE = 128 ** -0.5


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to TF32 (10 explicit mantissa bits), to nearest."""
    return ((x.contiguous().view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def product(a: torch.Tensor, b: torch.Tensor, three: bool) -> torch.Tensor:
    """a @ b as the tensor cores compute it: 3xTF32 (CUTLASS's OpMultiplyAddFastF32: big*big + big*small +
    small*big, fp32 accumulation) or plain TF32."""
    a_big, b_big = tf32(a), tf32(b)
    if not three:
        return a_big @ b_big
    return a_big @ b_big + (a_big @ tf32(b - b_big) + tf32(a - a_big) @ b_big)


def kernel(q, k, v, allowed, three: bool = True) -> torch.Tensor:
    """Attention with both products in the kernel's arithmetic, softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = product(q, k.transpose(-1, -2), three) * SCALE
    return product(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), v, three)


def shifted(nq: int, n_keys: int, by: int) -> torch.Tensor:
    """The causal mask of queries at positions n_keys-nq+by .. n_keys-1+by (by=0: the right one)."""
    q = torch.arange(n_keys - nq + by, n_keys + by).unsqueeze(1)
    return torch.arange(n_keys).unsqueeze(0) <= q


@pytest.mark.parametrize("nq,n_keys,seed", [(128, 512, 0), (256, 1024, 1)])
@torch.inference_mode()
def test_the_fp32_bound_takes_3xtf32_and_refuses_a_wrong_alignment(nq, n_keys, seed):
    q, k, v = check.inputs(nq, n_keys, SHAPE, torch.float32, torch.device("cpu"), seed=seed)
    allowed = check.causal_allowed(nq, n_keys, q.device)
    assert torch.equal(allowed, shifted(nq, n_keys, 0))
    ref = check.reference(q, k, v, allowed, SCALE)  # float64
    base = check.errors(check.reference(q, k, v, allowed, SCALE, eager=True), ref)  # eager fp32

    def ok(out):
        return check.within(check.errors(out, ref), base, ref, torch.float32, three_tf32=True)

    assert ok(kernel(q, k, v, allowed))  # the kernel's documented arithmetic, aligned right
    assert ok(causal_attention("lower_right", q, k, v, SCALE))  # the route itself (plain fp32 on the CPU)
    for by in (-1, 1):  # a key too few, a key too many
        assert not ok(kernel(q, k, v, shifted(nq, n_keys, by)))
    top_left = torch.arange(n_keys).unsqueeze(0) <= torch.arange(nq).unsqueeze(1)
    assert not ok(kernel(q, k, v, top_left))
    assert not ok(kernel(q, k, v, allowed, three=False))  # plain TF32 would be a real loss of precision


def test_the_factor_is_the_kernels_unit_roundoff_over_fp32s():
    assert check.THREE_TF32 == 12.0 and check.FACTOR < check.THREE_TF32
    assert not check.fast_fp32(torch.device("cpu"), torch.float32)
    err, base, ref = (1e-5, 1e-7), (1e-6, 1e-8), torch.zeros(1)
    assert check.within(err, base, ref, torch.float32, three_tf32=True)
    assert not check.within(err, base, ref, torch.float32)
