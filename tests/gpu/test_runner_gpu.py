"""The runner on a CUDA GPU in bf16, against float32 references computed from the same bf16 weights (so the bound
measures the arithmetic, not the weights' rounding): the exact prefill against transformers' own forward at several
chunk sizes (last logits and the K/V cache), the fused fill projection against the per-layer route, a filled
prefill through each, and calibrate's statistics on CUDA against the CPU's. Models: tiny_config with the heads of
real checkpoints (head_dim 128, GQA 4:1), 4 layers, ~3K-token prompts. Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_models import random_ids, tiny_model
from helpers import runner_for
from ridgefill.torchfill import Runner, FillPlan, MapFiller, adapter_for
from ridgefill.torchfill.projection import FillProjection

N = 3000  # prompt rows: not a multiple of any chunk below
FACTOR = 1.5  # our bf16 error may be this many times the baseline's
BF16_STEP = 2.0**-8  # bf16's relative rounding step: the floor, at the reference's scale
REALISTIC = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 num_hidden_layers=4, max_position_embeddings=8192)


def realistic(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(bf16 model, its float32 copy) on CUDA: the float32 copy holds the bf16 weights exactly."""
    low = tiny_model(family, **REALISTIC).to("cuda", torch.bfloat16)
    return low, copy.deepcopy(low).float()


def errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max, RMS) of the element-wise error of x against ref, in float32."""
    e = (x.float() - ref.float()).abs()
    return e.max().item(), e.square().mean().sqrt().item()


def assert_within(name: str, ours: torch.Tensor, baseline: torch.Tensor, ref: torch.Tensor) -> None:
    """Element-wise: our error against `ref` (max and RMS) is at most FACTOR x the baseline's, plus one bf16 step
    at the reference's scale (its largest magnitude for the max, its RMS for the RMS)."""
    ref = ref.float()
    (ours_max, ours_rms), (base_max, base_rms) = errors(ours, ref), errors(baseline, ref)
    max_floor = BF16_STEP * ref.abs().max().item()
    rms_floor = BF16_STEP * ref.square().mean().sqrt().item()
    report = f"{name}: ours max {ours_max:.3g} rms {ours_rms:.3g}, baseline max {base_max:.3g} rms {base_rms:.3g}"
    assert ours_max <= FACTOR * base_max + max_floor, report
    assert ours_rms <= FACTOR * base_rms + rms_floor, report


def hf_cache(output):
    """transformers' cache of a forward: `past_key_values` (5.17-5.19), `cache` from 5.2x."""
    return output.cache if "cache" in output else output.past_key_values


def random_maps(split: int, n_layers: int, hidden: int, seed: int = 0) -> MapFiller:
    """Maps near the identity (as fitted ones are), float32 on CUDA; .to() casts them for a bf16 runner."""
    g = torch.Generator().manual_seed(seed)
    m = n_layers - split - 1
    weights = torch.eye(hidden) + 0.02 * torch.randn(m, hidden, hidden, generator=g)
    return MapFiller(split, n_layers, weights, 0.05 * torch.randn(m, hidden, generator=g))


# --- exact prefill against transformers' forward ----------------------------------------------------------------
@pytest.mark.parametrize("chunk", [64, 256, N])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exact_prefill_matches_transformers_in_bf16(family, chunk, fp32_reference):
    """The runner's bf16 exact prefill (chunked: each chunk attends to the cached prefix) is as close to the float32
    forward as transformers' own bf16 forward is: last logits and every layer's K and V."""
    low, ref_model = realistic(family)
    ids = random_ids(N).cuda()
    with torch.inference_mode():
        ref, theirs = ref_model(ids, use_cache=True), low(ids, use_cache=True)
        ours = runner_for(low, chunk=chunk).prefill(ids)
    assert ours.cache.length == N
    assert_within("last logits", ours.logits[:, -1], theirs.logits[:, -1], ref.logits[:, -1])
    ref_cache, their_cache = hf_cache(ref), hf_cache(theirs)
    for layer, mine in enumerate(ours.cache.layers):
        for part in ("keys", "values"):
            assert_within(f"layer {layer} {part}", getattr(mine, part), getattr(their_cache.layers[layer], part),
                          getattr(ref_cache.layers[layer], part))


# --- the fill projection and a filled prefill ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # plain, q/k/v biases, k-norm
def test_fused_projection_error_is_the_per_layer_routes(family, fp32_reference):
    """Filled rows' late K/V through the fused projection (one bmm, norm weights folded in) in bf16: its error
    against the float32 per-layer route is at most 1.5x the bf16 per-layer route's."""
    low, ref_model = realistic(family)
    split, n = 1, 4096
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, n, low.config.hidden_size, generator=g).cuda()  # split states, O(1) as real ones
    positions = torch.arange(7, 7 + n, device="cuda")
    filler = random_maps(split, low.config.num_hidden_layers, low.config.hidden_size)
    outputs = {}
    for name, model, backend in (("fused", low, "torch"), ("layers", low, "layers"), ("ref", ref_model, "layers")):
        adapter = adapter_for(model)
        xs = x.to(adapter.dtype)
        cos, sin = adapter.rope(positions.unsqueeze(0), xs)
        with torch.inference_mode():
            filled = FillProjection(adapter, backend).fill(copy.deepcopy(filler).to(xs.device, xs.dtype), xs,
                                                            positions, cos, sin)
            outputs[name] = {layer: filled.layer(layer) for layer in range(split, adapter.n_layers)}
    for layer, (k_ref, v_ref) in outputs["ref"].items():
        (k, v), (k_layers, v_layers) = outputs["fused"][layer], outputs["layers"][layer]
        assert_within(f"layer {layer} keys", k, k_layers, k_ref)
        assert_within(f"layer {layer} values", v, v_layers, v_ref)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_filled_prefill_fused_matches_the_per_layer_route(family, fp32_reference):
    """A whole filled prefill (maps, tail, a kept row, chunked) in bf16: through the fused projection its last
    logits and caches are as close to the float32 per-layer prefill as the bf16 per-layer prefill's are."""
    low, ref_model = realistic(family)
    ids = random_ids(N).cuda()
    filler = random_maps(2, low.config.num_hidden_layers, low.config.hidden_size)
    results = {}
    for name, model, backend in (("fused", low, "torch"), ("layers", low, "layers"), ("ref", ref_model, "layers")):
        runner = Runner(adapter_for(model), chunk=1024, projection=backend)
        plan = FillPlan(copy.deepcopy(filler).to(torch.device("cuda"), runner.adapter.dtype), tail=256,
                        keep_rows=(1500,), keep_first=1)
        with torch.inference_mode():
            results[name] = runner.prefill(ids, fill=plan)
    fused, layers, ref = results["fused"], results["layers"], results["ref"]
    assert fused.n_filled == layers.n_filled == ref.n_filled > 0
    assert_within("last logits", fused.logits, layers.logits, ref.logits)
    for layer, (a, b, r) in enumerate(zip(fused.cache.layers, layers.cache.layers, ref.cache.layers)):
        assert_within(f"layer {layer} keys", a.keys, b.keys, r.keys)
        assert_within(f"layer {layer} values", a.values, b.values, r.values)


# --- calibration on CUDA ---------------------------------------------------------------------------------------
def test_calibrate_statistics_on_cuda_equal_the_cpus(tiny_checkpoint, tmp_path):
    """`ridgefill calibrate --device cuda` (float32) writes the statistics `--device cpu` writes, within float32
    rounding of the hidden states (the float64 sums of float32 rows computed by other kernels)."""
    from typer.testing import CliRunner

    from tiny_models import write_corpus
    from ridgefill.cli import app
    from ridgefill.runtime.artifacts import load_artifact

    text = write_corpus(tmp_path / "text.txt", seed=3, lines_per_document=12)
    stats = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"stats-{device}.safetensors"
        r = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_checkpoint), "--data", str(text), "--split",
                                     "2,3", "--tokens", "2048", "--seq-len", "128", "--out", str(out), "--holdout",
                                     "0.25", "--device", device, "--dtype", "fp32"])
        assert r.exit_code == 0, r.output
        stats[device] = load_artifact(out, "stats")[0]
    cpu, cuda = stats["cpu"], stats["cuda"]
    assert sorted(cpu) == sorted(cuda)
    for name, a in cpu.items():
        b = cuda[name]
        assert a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu", name
        if not a.is_floating_point():  # counts: the same rows kept and skipped
            assert torch.equal(a, b), name
            continue
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-5 * max(scale, 1.0), name  # fp32 rounding, summed in float64

