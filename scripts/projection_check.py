"""The fill projection's accuracy and time: the fused torch projection (torchfill/projection.py norm_kv_torch: every
late layer's input norm + K/V in one bmm, k-norm, RoPE) against the per-layer route (each layer's input_norm and
key_value, the engine's reference), both in bf16 on the same bf16 weights and inputs, each against a float32
reference (the per-layer route on the float32 copy of those weights and inputs). Variants: Llama, Qwen2 (q/k/v
biases), Qwen3 (per-head k-norm).

Shape 8b: 15 late layers, 8,192 filled rows, H 4,096, 8 KV heads of 128 (Llama-3.1-8B's late layers at split 17);
tiny: a CPU dry run. Two stages are timed (median of --repeats, after warm-up; CUDA events on a GPU):
norm_kv, the norm + K/V stage on 15 distinct layer inputs, and fill, FillProjection.fill with near-identity maps
(the maps' batched GEMM, then norm + K/V; the per-layer route also computes every layer's K/V). Errors: max_rel =
max|x - ref| / max|ref|, rms_rel = RMS(x - ref) / RMS(ref), for K and V.

    PYTHONPATH=src python scripts/projection_check.py --device cuda --out projection.json
    PYTHONPATH=src python scripts/projection_check.py --device cpu --shape tiny --out projection.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from ridgefill.torchfill import MapFiller, adapter_for
from ridgefill.torchfill.kv_stack import stack_kv
from ridgefill.torchfill.projection import FillProjection, norm_kv_torch
from ridgefill.runtime.provenance import device_info, versions

SHAPES = {  # hidden, query heads, KV heads, head dim, late layers, filled rows
    "8b": (4096, 32, 8, 128, 15, 8192),
    "tiny": (256, 4, 2, 64, 3, 512),
}
VARIANTS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
SPLIT = 1  # the model has SPLIT + late layers; layers 0..SPLIT-1 are never run


def build(variant: str, shape: str, device: str) -> torch.nn.Module:
    """A bf16 model whose late layers have the shape's attention (MLPs and vocabulary small: never run), its norm
    weights, biases and k-norm perturbed from their init so that each shows in the result."""
    hidden, heads, kv_heads, head_dim, late, _ = SHAPES[shape]
    config = VARIANTS[variant](vocab_size=256, hidden_size=hidden, intermediate_size=256,
                               num_hidden_layers=SPLIT + late, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=131072,
                               rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def timed(run, device: str, warmup: int, repeats: int) -> float:
    """Median milliseconds of run() (CUDA events on a GPU)."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            samples.append(1000 * (time.perf_counter() - t0))
    return statistics.median(samples)


def per_layer(adapter, y: torch.Tensor, cos, sin) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """y [M, R, H] -> each late layer's (k, v) [1, Hkv, R, D] through its input_norm and key_value."""
    return [adapter.key_value(SPLIT + j, adapter.input_norm(SPLIT + j, y[j].unsqueeze(0)), cos, sin)
            for j in range(y.shape[0])]


def rel_errors(x: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    """(max_rel, rms_rel) of the tensors x against ref, over all of them."""
    err = torch.cat([(a.float() - r).flatten() for a, r in zip(x, ref)])
    r = torch.cat([t.flatten() for t in ref])
    return (err.abs().max() / r.abs().max()).item(), (err.square().mean().sqrt() / r.square().mean().sqrt()).item()


def near_identity_maps(hidden: int, late: int, device: str) -> MapFiller:
    g = torch.Generator().manual_seed(1)
    weights = torch.eye(hidden) + (0.5 / hidden**0.5) * torch.randn(late - 1, hidden, hidden, generator=g)
    return MapFiller(SPLIT, SPLIT + late, weights, 0.05 * torch.randn(late - 1, hidden, generator=g)).to(
        torch.device(device), torch.bfloat16)


def check_variant(variant: str, shape: str, device: str, warmup: int, repeats: int) -> list[dict]:
    hidden, _, _, _, late, rows = SHAPES[shape]
    model = build(variant, shape, device)
    adapter, ref_adapter = adapter_for(model), adapter_for(copy.deepcopy(model).float())
    g = torch.Generator().manual_seed(2)
    y = torch.randn(late, rows, hidden, generator=g).to(device, torch.bfloat16)  # [M, R, H] distinct inputs
    positions = torch.arange(64, 64 + rows, device=device)
    cos, sin = adapter.rope(positions.unsqueeze(0), y)
    ref_cos, ref_sin = ref_adapter.rope(positions.unsqueeze(0), y.float())
    stack = stack_kv(adapter, SPLIT)
    with torch.inference_mode():
        reference = per_layer(ref_adapter, y.float(), ref_cos, ref_sin)
        k, v = norm_kv_torch(stack, y, cos, sin, 1)  # [M, 1, Hkv, R, D]
        routes = {"torch": [(k[j], v[j]) for j in range(late)], "layers": per_layer(adapter, y, cos, sin)}
        stages = {"torch": lambda: norm_kv_torch(stack, y, cos, sin, 1),
                  "layers": lambda: per_layer(adapter, y, cos, sin)}
        maps, x = near_identity_maps(hidden, late, device), y[0].unsqueeze(0)  # [1, R, H] split states
        out = []
        for route, kv in routes.items():
            projection = FillProjection(adapter, route)

            def fill(projection=projection):
                filled = projection.fill(maps, x, positions, cos, sin)
                return [filled.layer(SPLIT + j) for j in range(late)]

            k_err = rel_errors([a for a, _ in kv], [r for r, _ in reference])
            v_err = rel_errors([b for _, b in kv], [r for _, r in reference])
            out.append({"variant": variant, "route": route, "k_max_rel": k_err[0], "k_rms_rel": k_err[1],
                        "v_max_rel": v_err[0], "v_rms_rel": v_err[1],
                        "norm_kv_ms": timed(stages[route], device, warmup, repeats),
                        "fill_ms": timed(fill, device, warmup, repeats)})
        out[0]["auto_route"] = FillProjection(adapter, "auto").backend_for(SPLIT)
    del model, adapter, ref_adapter
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("projection.json"))
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in full float32
    results = [r for variant in VARIANTS for r in check_variant(variant, a.shape, a.device, a.warmup, a.repeats)]
    hidden, heads, kv_heads, head_dim, late, rows = SHAPES[a.shape]
    doc = {"check": "projection", "device": device_info(a.device), "versions": versions(),
           "shape": {"name": a.shape, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                     "late_layers": late, "rows": rows, "dtype": "bf16"},
           "repeats": a.repeats, "warmup": a.warmup, "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1))
    print(f"fill projection, {a.shape} shape, bf16 on {doc['device']['name']} (errors against float32) -> {a.out}")
    print(f"{'variant':8} {'route':7} {'K max rel':>10} {'K rms rel':>10} {'V max rel':>10} {'V rms rel':>10} "
          f"{'norm+KV ms':>10} {'fill ms':>9}")
    for r in results:
        print(f"{r['variant']:8} {r['route']:7} {r['k_max_rel']:10.2e} {r['k_rms_rel']:10.2e} {r['v_max_rel']:10.2e} "
              f"{r['v_rms_rel']:10.2e} {r['norm_kv_ms']:10.2f} {r['fill_ms']:9.2f}")


if __name__ == "__main__":
    main()
