"""The fused fill projection equals the per-layer route (input norm, then the adapter's key_value) for every
dense family and filler."""

import pytest
import torch

from tiny_models import random_ids, tiny_model
from ridgefill.torchfill import Runner, FillPlan, IdentityFiller, MapFiller, OracleFiller, adapter_for
from ridgefill.torchfill.kv_stack import stack_weights
from ridgefill.torchfill.projection import FillProjection, layer_kv

TOL = 1e-5


def random_maps(split, n_layers, hidden, rank=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n_layers - split - 1
    bias = 0.1 * torch.randn(m, hidden, generator=g)
    if rank is None:
        weight = torch.eye(hidden) + 0.1 * torch.randn(m, hidden, hidden, generator=g)
        return MapFiller(split, n_layers, weight, bias)
    u = 0.3 * torch.randn(m, hidden, rank, generator=g)
    v = 0.3 * torch.randn(m, rank, hidden, generator=g)
    return MapFiller(split, n_layers, None, bias, (u, v))


def per_layer_reference(adapter, filler, x, positions, cos, sin):
    """The route the runner took before fusion: predict, then each layer's input norm and key_value."""
    predicted = filler.predict(x, positions) if filler.split + 1 < filler.n_layers else None
    out = {}
    for layer in range(filler.split, adapter.n_layers):
        inp = x if layer == filler.split else predicted[:, :, layer - filler.split - 1]
        out[layer] = adapter.key_value(layer, adapter.input_norm(layer, inp), cos, sin)
    return out


def filled_inputs(adapter, batch=2, n=9, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(batch, n, adapter.hidden_size, generator=g)
    positions = torch.arange(5, 5 + 2 * n, 2)  # filled rows need not be contiguous
    cos, sin = adapter.rope(positions.unsqueeze(0).expand(batch, n), x)
    return x, positions, cos, sin


def fillers(split, n_layers, hidden):
    return {"identity": IdentityFiller(split, n_layers), "ridge": random_maps(split, n_layers, hidden),
            "low-rank": random_maps(split, n_layers, hidden, rank=5)}


@pytest.mark.parametrize("split", [2, 5])
def test_fused_projection_equals_per_layer_route(dense_model, split):
    adapter = adapter_for(dense_model)
    x, positions, cos, sin = filled_inputs(adapter)
    projection = FillProjection(adapter, backend="torch")
    for name, filler in fillers(split, adapter.n_layers, adapter.hidden_size).items():
        ref = per_layer_reference(adapter, filler, x, positions, cos, sin)
        with torch.inference_mode():
            filled = projection.fill(filler, x, positions, cos, sin)
        assert sorted(filled.kv) == list(range(split, adapter.n_layers)), name  # every late layer is fused
        for layer, (k_ref, v_ref) in ref.items():
            k, v = filled.layer(layer)
            assert k.shape == k_ref.shape and v.shape == v_ref.shape
            assert (k - k_ref).abs().max() <= TOL, (name, layer)
            assert (v - v_ref).abs().max() <= TOL, (name, layer)


def test_other_layer_kinds_keep_the_per_layer_route():
    """Layers that are not attention (hybrid linear layers) get their predicted input; only the attention layers
    among the late ones are stacked and fused."""
    from ridgefill.torchfill.families import DenseAdapter

    class Mixed(DenseAdapter):
        def layer_kind(self, layer):
            return "linear" if layer in (3, 5) else "attention"

    adapter = Mixed(tiny_model("qwen3"))
    x, positions, cos, sin = filled_inputs(adapter)
    filler = random_maps(2, adapter.n_layers, adapter.hidden_size)
    ref = per_layer_reference(adapter, filler, x, positions, cos, sin)
    with torch.inference_mode():
        filled = FillProjection(adapter).fill(filler, x, positions, cos, sin)
    assert sorted(filled.kv) == [2, 4] and filled.inputs.shape[0] == 4
    predicted = filler.predict(x, positions)
    for layer in (3, 5):
        assert (filled.layer(layer) - predicted[:, :, layer - 3]).abs().max() <= TOL
    for layer in (2, 4):
        k, v = filled.layer(layer)
        assert (k - ref[layer][0]).abs().max() <= TOL and (v - ref[layer][1]).abs().max() <= TOL


def test_late_inputs_are_the_fillers_predictions(dense_model):
    adapter = adapter_for(dense_model)
    x, positions, _, _ = filled_inputs(adapter)
    b, n, h = x.shape
    for name, filler in fillers(2, adapter.n_layers, h).items():
        y = filler.late_inputs(x, positions)  # [L-S, B*n, H]
        assert y.shape == (adapter.n_layers - 2, b * n, h)
        assert torch.equal(y[0], x.reshape(b * n, h))
        ref = filler.predict(x, positions).permute(2, 0, 1, 3).reshape(-1, b * n, h)
        assert (y[1:] - ref).abs().max() <= TOL, name

    calls = []

    def make(weight, bias):  # a serving runner's prepared GEMM stands in: torch's, counted
        def gemm(f):
            calls.append(f.shape)
            return torch.nn.functional.linear(f, weight, bias)
        return gemm

    maps = fillers(2, adapter.n_layers, h)["ridge"]
    want = maps.late_inputs(x, positions)
    maps.use_gemm(make)  # one GEMM per map [R, F] x [F, H]: the same late inputs
    assert (maps.late_inputs(x, positions) - want).abs().max() <= TOL
    assert calls == [(b * n, h)] * (adapter.n_layers - 3)


def test_engine_prefill_fused_equals_per_layer(dense_model):
    """Whole filled prefill (chunked, keep rows, batch 2): fused and per-layer routes give the same caches."""
    ids = random_ids(40, batch=2)
    fused = Runner(adapter_for(dense_model), chunk=16)
    reference = Runner(adapter_for(dense_model), chunk=16, projection="layers")
    filler = random_maps(3, fused.n_layers, fused.adapter.hidden_size, rank=4)
    plan = FillPlan(filler, tail=6, keep_rows=(0, 20))
    a = fused.prefill(ids, fill=plan, logits_at="full")
    b = reference.prefill(ids, fill=plan, logits_at="full")
    assert (a.logits - b.logits).abs().max() <= TOL
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert (la.keys - lb.keys).abs().max() <= TOL
        assert (la.values - lb.values).abs().max() <= TOL


def test_oracle_fill_through_the_fused_path_is_exact(dense_model):
    ids = random_ids(30)
    eng = Runner(adapter_for(dense_model), chunk=11)
    exact = eng.prefill(ids, logits_at="full")
    with torch.no_grad():
        hidden = dense_model(ids, output_hidden_states=True).hidden_states
    filled = eng.prefill(ids, fill=FillPlan(OracleFiller(2, hidden), tail=5), logits_at="full")
    assert (filled.logits - exact.logits[:, filled.rows]).abs().max() <= TOL
    for la, lb in zip(filled.cache.layers, exact.cache.layers):
        assert (la.keys - lb.keys).abs().max() <= TOL


def test_stacked_weights_are_built_once_per_split(dense_model):
    eng = Runner(adapter_for(dense_model))
    plan = FillPlan(IdentityFiller(3, eng.n_layers), tail=4)
    eng.prefill(random_ids(20), fill=plan)
    stack = eng.projection.stack(3)
    eng.prefill(random_ids(20, seed=2), fill=plan)
    assert eng.projection.stack(3) is stack
    assert stack.layers == [3, 4, 5] and stack.weight.shape == (3, 64, 2 * 2 * eng.adapter.head_dim)
    assert stack.nbytes == sum(t.numel() * 4 for t in (stack.weight, stack.bias, stack.k_norm) if t is not None)


@pytest.mark.parametrize("backend", ["torch", "layers"])
def test_key_scale_multiplies_each_filled_key_head_and_nothing_else(dense_model, backend):
    """A filler's key scale [L-S, Hkv] multiplies the filled keys of each late layer per KV head (fused and
    per-layer route alike); values, the full rows' keys and the split layer's keys are untouched."""
    split, ids = 2, random_ids(30)
    runner = Runner(adapter_for(dense_model), chunk=16, projection=backend)
    filler = random_maps(split, runner.n_layers, runner.adapter.hidden_size)
    heads = runner.shape.kv_heads
    scale = torch.linspace(0.5, 1.5, (runner.n_layers - split) * heads).view(-1, heads)
    scale[0] = 1.0  # layer S: its keys are exact
    scaled = MapFiller(split, runner.n_layers, filler._stacked.view(runner.adapter.hidden_size, -1,
                                                                     runner.adapter.hidden_size).transpose(0, 1),
                       filler._biases, key_scale=scale)
    plain = FillPlan(filler, tail=6, keep_rows=(0,))
    a = runner.prefill(ids, fill=plain, logits_at=[])
    b = runner.prefill(ids, fill=FillPlan(scaled, tail=6, keep_rows=(0,)), logits_at=[])
    rows = ~plain.full_rows(30)
    for layer in range(runner.n_layers):
        ka, kb = a.cache[layer].keys, b.cache[layer].keys  # [1, Hkv, T, D]
        if layer <= split:
            assert torch.equal(ka, kb)
            continue
        want = ka[:, :, rows] * scale[layer - split].view(1, -1, 1, 1)
        assert (kb[:, :, rows] - want).abs().max() <= TOL, layer
        assert torch.equal(b.cache[layer].values[:, :, rows], a.cache[layer].values[:, :, rows])


def test_key_scale_of_ones_changes_nothing(dense_model):
    ids = random_ids(30)
    runner = Runner(adapter_for(dense_model), chunk=16)
    ones = torch.ones(runner.n_layers - 3, runner.shape.kv_heads)
    a = runner.prefill(ids, fill=FillPlan(IdentityFiller(3, runner.n_layers), tail=6), logits_at="full")
    b = runner.prefill(ids, fill=FillPlan(IdentityFiller(3, runner.n_layers, ones), tail=6), logits_at="full")
    assert torch.equal(a.logits, b.logits)


def test_one_layers_kv_as_the_vllm_plugin_writes_it_equals_the_per_layer_route(dense_model):
    """layer_kv on one layer's own stacked weights (what the vLLM plugin builds from its modules at load) gives each
    late layer's filled K/V and key scale exactly as the runner's per-layer route does (Llama, Qwen2 bias, Qwen3
    k-norm)."""
    adapter = adapter_for(dense_model)
    x, _, cos, sin = filled_inputs(adapter, batch=1)
    scale = torch.linspace(0.5, 1.5, adapter.n_kv_heads)
    for layer in range(2, adapter.n_layers):
        stack = stack_weights([adapter.kv_weights(layer)], [layer], None, adapter.n_kv_heads, adapter.head_dim,
                              adapter.dtype, adapter.device)
        with torch.inference_mode():
            k, v = layer_kv(stack, x[0], cos[0], sin[0], scale)  # [n, Hkv, D]
            want_k, want_v = adapter.key_value(layer, adapter.input_norm(layer, x), cos, sin)  # [1, Hkv, n, D]
        want_k = want_k * scale.view(1, -1, 1, 1)
        assert k.shape == (x.shape[1], adapter.n_kv_heads, adapter.head_dim)
        assert (k - want_k[0].transpose(0, 1)).abs().max() <= TOL
        assert (v - want_v[0].transpose(0, 1)).abs().max() <= TOL
