"""Measure the engine's attention routes (torchfill/routes.py) on this device: each route's error against a float32
reference and its time, at the 8B shape (32 query heads, 8 KV heads, head dim 128):

- causal chunk attention: a chunk of 2,048 queries, the last of 8K / 32K / 128K keys, by every causal route the
  device runs (CUDA: flash, cudnn_split, lower_right; CPU: cpu_split, lower_right);
- the filled window (W = 2,048, 1 sink): the same chunk as the last of 32K keys, by every window route (CUDA:
  flash_band, blocks), against full causal attention of that chunk by the default causal route.

Error: max and RMS of the element-wise error against attention computed in float32 from the same inputs; the
baseline is transformers' eager attention in the run's dtype (scores and weights rounded to it), and a route is
"ok" when its max and RMS errors are at most 1.5x the baseline's plus one rounding step of the dtype at the
reference's scale (in fp32 on sm80+, the lower_right route's memory-efficient kernel multiplies in 3xTF32: THREE_TF32
x the baseline, see `within`). Time: CUDA events (the CPU: wall clock), warmup, median of repeats, ms per call.

Exit status 1 when a route the engine takes by default on this device fails or exceeds the bound (a candidate
route is only reported). What a GPU run decides: the causal route (flash against cudnn_split; lower_right is today's), and whether the band
route is faster than full attention (and by how much of its FLOP limit, keys per row full / window) at 32K keys.

Runs from src/ with PYTHONPATH (no vLLM, no network):
    PYTHONPATH=src python scripts/attention_check.py --device cuda --dtype bf16 --out attention.json
    PYTHONPATH=src python scripts/attention_check.py --device cpu --tiny   # a dry run in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from ridgefill.torchfill.attention import causal_attention
from ridgefill.torchfill.routes import Routes, flash_applies
from ridgefill.torchfill.window import BAND_KERNELS, FilledWindow, banded_attention, window_blocks, windowed_attention

SHAPES = {
    "8b": dict(heads=32, kv_heads=8, head_dim=128, chunk=2048, keys=(8192, 32768, 131072), window=2048,
               window_keys=32768, sinks=1),
    "tiny": dict(heads=4, kv_heads=2, head_dim=16, chunk=64, keys=(128, 512), window=32, window_keys=512, sinks=1),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FACTOR = 1.5


# --- references and errors --------------------------------------------------------------------------------------
def causal_allowed(nq: int, n_keys: int, device) -> torch.Tensor:
    """[nq, n_keys] bool: the last nq positions over keys 0..n_keys-1, causally."""
    q = torch.arange(n_keys - nq, n_keys, device=device).unsqueeze(1)
    return torch.arange(n_keys, device=device).unsqueeze(0) <= q


def window_allowed(nq: int, n_keys: int, window: FilledWindow, device) -> torch.Tensor:
    """[nq, n_keys] bool: the last nq positions, each over its sinks and the W keys before it, and itself."""
    q = torch.arange(n_keys - nq, n_keys, device=device).unsqueeze(1)
    k = torch.arange(n_keys, device=device).unsqueeze(0)
    return (k <= q) & ((k >= q - window.size) | (k < window.sinks))


def reference(q, k, v, allowed, scale: float, eager: bool = False) -> torch.Tensor:
    """Attention with the mask `allowed` [nq, n_keys], one KV head at a time (bounded memory): exact from the
    inputs' values (float32; float64 for float32 inputs), or (eager) transformers' eager attention in the inputs'
    dtype (scores in it, softmax in float32, weights rounded back to it). -> [B, Hq, nq, D] float32."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dtype = q.dtype if eager else (torch.float64 if q.dtype == torch.float32 else torch.float32)
    for h in range(k.shape[1]):
        qh = q[:, h * groups:(h + 1) * groups].to(dtype)  # [B, g, nq, D]
        scores = (qh @ k[:, h:h + 1].to(dtype).transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, -1, dtype=torch.float32 if eager else dtype).to(dtype)
        out[:, h * groups:(h + 1) * groups] = (weights @ v[:, h:h + 1].to(dtype)).float()
        del scores, weights
    return out


def errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max, RMS) of the element-wise error of x against ref, in float32."""
    e = (x.float() - ref).abs()
    return e.max().item(), e.square().mean().sqrt().item()


# The fp32 route on CUDA ("lower_right": SDPA with a lower-right bias) runs torch's memory-efficient kernel (flash has
# no fp32 kernel). On sm80+ that kernel does not multiply in plain fp32: aten/src/ATen/native/transformers/cuda/
# mem_eff_attention/gemm_kernel_utils.h specialises DefaultGemmType<ArchTag, float> for kMinComputeCapability >= 80
# with OpClassTensorOp and Operator = cutlass::arch::OpMultiplyAddFastF32, CUTLASS's "3xTF32" fast fp32: each fp32
# operand is split into a TF32 part (11 significant bits) and a TF32 remainder, and a*b is computed as
# a_big*b_big + a_big*b_small + a_small*b_big on the tensor cores (fp32 accumulation), a_small*b_small dropped. So an
# operand keeps 22 of its 24 significant bits (a relative error up to 2^-22 each) and a product carries up to about
# 3 x 2^-22 relative error, where fp32 rounds a product to 2^-24: THREE_TF32 = 12 times fp32's unit roundoff, on both
# of the kernel's products (q.k and p.v). Its error is bounded by that many times eager fp32's (whose error is its
# products' and sums' rounding at 2^-24), which a wrong alignment (a key too many or too few: an O(1) error) or
# plain TF32 (2^-11 per operand: ~2,000x fp32's) exceeds by orders of magnitude (tests/scripts/test_attention_check).
THREE_TF32 = 3 * 2.0 ** -22 / 2.0 ** -24


def fast_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the memory-efficient kernel multiplies this dtype in 3xTF32 here: fp32 on a CUDA GPU of sm80+."""
    return (dtype == torch.float32 and torch.device(device).type == "cuda"
            and torch.cuda.get_device_capability(device) >= (8, 0))


def within(err: tuple[float, float], base: tuple[float, float], ref: torch.Tensor, dtype: torch.dtype,
           three_tf32: bool = False) -> bool:
    """err (max, RMS) at most FACTOR x the baseline's (THREE_TF32 x where the kernel multiplies fp32 in 3xTF32,
    `fast_fp32`), plus one rounding step of dtype (half its eps: 2^-8 for bf16) at the reference's scale."""
    step = torch.finfo(dtype).eps / 2
    factor = THREE_TF32 if three_tf32 else FACTOR
    floor_max, floor_rms = step * ref.abs().max().item(), step * ref.square().mean().sqrt().item()
    return err[0] <= factor * base[0] + floor_max and err[1] <= factor * base[1] + floor_rms


# --- timing -----------------------------------------------------------------------------------------------------
def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median ms of fn() over `repeats` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --- the routes as the engine calls them -------------------------------------------------------------------------
def causal_routes(device: torch.device, dtype: torch.dtype, s: dict) -> list[str]:
    if device.type == "cuda":
        fast = ["flash", "cudnn_split"] if flash_applies(device, dtype, s["heads"], s["kv_heads"], s["head_dim"]) else []
        return fast + ["lower_right"]
    return ["cpu_split", "lower_right"]


def window_call(route: str, q, k, v, window: FilledWindow, scale: float):
    """The engine's windowed attention of every chunk row (the last nq of the keys) by `route`."""
    nq, n_keys = q.shape[2], k.shape[2]
    start = n_keys - nq
    positions = torch.arange(start, n_keys, device=q.device)
    if route == "blocks":
        blocks = window_blocks(torch.arange(nq, device=q.device), positions, window, q.dtype)

        def run():
            out = torch.empty_like(q)
            windowed_attention(q, k, v, blocks, scale, out)
            return out
        return run
    return lambda: banded_attention(q, k, v, start, positions, window, scale, BAND_KERNELS[route])


def window_routes(device: torch.device, dtype: torch.dtype, s: dict) -> list[str]:
    if device.type == "cuda" and flash_applies(device, dtype, s["heads"], s["kv_heads"], s["head_dim"]):
        return ["flash_band", "blocks"]
    return ["masked_band", "blocks"]


def inputs(nq: int, n_keys: int, s: dict, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, s["heads"], nq, s["head_dim"], generator=g, device=device).to(dtype)
    k = torch.randn(1, s["kv_heads"], n_keys, s["head_dim"], generator=g, device=device).to(dtype)
    v = torch.randn(1, s["kv_heads"], n_keys, s["head_dim"], generator=g, device=device).to(dtype)
    return q, k, v


def measure(route: str, fn, ref, base, dtype, device, args) -> dict:
    """One route: its error against ref (ok: within the baseline's bound) and its time; a route that raises is
    recorded with its error message."""
    try:
        out = fn()
        err = errors(out, ref)
        ms = time_ms(fn, device, args.warmup, args.repeats)
    except (RuntimeError, NotImplementedError) as e:  # a kernel this device or build lacks
        return {"route": route, "error": str(e).splitlines()[0][:200]}
    return {"route": route, "ms": round(ms, 4), "max_err": err[0], "rms_err": err[1], "baseline_max_err": base[0],
            "baseline_rms_err": base[1],
            "ok": within(err, base, ref, dtype, three_tf32=route == "lower_right" and fast_fp32(device, dtype))}


def check_causal(s: dict, dtype, device, args) -> list[dict]:
    rows, scale = [], s["head_dim"] ** -0.5
    for n_keys in s["keys"]:
        q, k, v = inputs(s["chunk"], n_keys, s, dtype, device)
        allowed = causal_allowed(s["chunk"], n_keys, device)
        ref, base = reference(q, k, v, allowed, scale), None
        base = errors(reference(q, k, v, allowed, scale, eager=True), ref)
        del allowed
        for route in causal_routes(device, dtype, s):
            row = measure(route, lambda: causal_attention(route, q, k, v, scale), ref, base, dtype, device, args)
            rows.append({"keys": n_keys, "queries": s["chunk"], **row})
        del q, k, v, ref
    return rows


def check_window(s: dict, dtype, device, args, full_route: str) -> list[dict]:
    window, scale, n_keys = FilledWindow(s["window"], 0, 0, s["sinks"]), s["head_dim"] ** -0.5, s["window_keys"]
    q, k, v = inputs(s["chunk"], n_keys, s, dtype, device, seed=1)
    allowed = window_allowed(s["chunk"], n_keys, window, device)
    ref = reference(q, k, v, allowed, scale)
    base = errors(reference(q, k, v, allowed, scale, eager=True), ref)
    full_ms = time_ms(lambda: causal_attention(full_route, q, k, v, scale), device, args.warmup, args.repeats)
    full_keys = n_keys - (s["chunk"] - 1) / 2  # keys per row, full attention (the chunk ends the keys)
    limit = full_keys / (window.size + 1 + window.sinks)  # keys per row, windowed (far from position 0)
    rows = []
    for route in window_routes(device, dtype, s):
        row = measure(route, window_call(route, q, k, v, window, scale), ref, base, dtype, device, args)
        if "ms" in row:
            row.update(full_route=full_route, full_ms=round(full_ms, 4), speedup=round(full_ms / row["ms"], 3),
                       flop_limit=round(limit, 3), of_limit=round(full_ms / row["ms"] / limit, 3))
        rows.append({"keys": n_keys, "queries": s["chunk"], "window": window.size, "sinks": window.sinks, **row})
    return rows


def table(result: dict) -> str:
    lines = [f"device {result['device']} ({result['device_name']}), torch {result['torch']}, {result['dtype']}, "
             f"shape {result['shape']}", f"default routes: {result['routes']}", "",
             "causal chunk attention: route, keys, ms, max err, rms err (baseline max, rms), ok"]
    for r in result["causal"]:
        lines.append(_row(r, f"{r['route']:<12} {r['keys']:>7}"))
    lines += ["", f"window W={result['shape']['window']}: route, keys, ms, full ms, speedup (FLOP limit), errors, ok"]
    for r in result["window"]:
        extra = f"full {r['full_ms']:.3f} ms, {r['speedup']:.2f}x of {r['flop_limit']:.1f}x" if "ms" in r else ""
        lines.append(_row(r, f"{r['route']:<12} {r['keys']:>7}") + ("  " + extra if extra else ""))
    return "\n".join(lines)


def _row(r: dict, head: str) -> str:
    if "error" in r:
        return f"{head}  failed: {r['error']}"
    return (f"{head} {r['ms']:>10.3f} ms  max {r['max_err']:.2e} rms {r['rms_err']:.2e} "
            f"(baseline {r['baseline_max_err']:.2e}, {r['baseline_rms_err']:.2e})  {'ok' if r['ok'] else 'OVER'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--tiny", action="store_true", help="a tiny shape (a dry run in seconds)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA GPU: run on a GPU machine or pass --device cpu --tiny",
              file=sys.stderr)
        return 2
    device, dtype, s = torch.device(args.device), DTYPES[args.dtype], SHAPES["tiny" if args.tiny else "8b"]
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in full float32
    routes = Routes.for_model(device, dtype, s["heads"], s["kv_heads"], s["head_dim"])
    result = {"device": device.type, "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "shape": s, "routes": routes.describe(),
              "factor": FACTOR, "warmup": args.warmup, "repeats": args.repeats}
    with torch.inference_mode():
        result["causal"] = check_causal(s, dtype, device, args)
        result["window"] = check_window(s, dtype, device, args, routes.causal)
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    chosen = [r for r in result["causal"] if r["route"] == routes.causal]
    chosen += [r for r in result["window"] if r["route"] == routes.window]
    return 0 if all(r.get("ok", False) for r in chosen) else 1  # the default routes within bounds (candidates: reported)


if __name__ == "__main__":
    sys.exit(main())
