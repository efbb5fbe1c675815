"""engine/routes.py: the one place that chooses each piece's route, what it chooses on the CPU, its overrides, and
that the engine takes the routes it chose."""

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

from conftest import random_ids, tiny_hybrid_model
from ridgefill.engine import Engine, FilledWindow, FillPlan, IdentityFiller, adapter_for
from ridgefill.engine.families import delta_rule
from ridgefill.engine.routes import ENV, Routes, delta_rule_route, flash_applies, projection_route
from ridgefill.errors import RidgefillError


def cpu_routes(**kwargs):
    return Routes.for_model("cpu", torch.float32, 4, 2, 16, **kwargs)


def test_the_cpu_routes(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    routes = cpu_routes()
    assert routes.describe() == {"device": "cpu", "dtype": "float32", "causal": "cpu_split", "window": "blocks",
                                 "projection": "torch", "delta_rule": "torch"}
    assert cpu_routes(projection="layers").projection == "layers"
    with pytest.raises(dataclasses.FrozenInstanceError):
        routes.causal = "flash"


def test_flash_is_for_cuda_half_precision_and_head_dims_it_takes_unpadded():
    assert not flash_applies(torch.device("cpu"), torch.bfloat16, 32, 8, 128)
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda")
    assert not flash_applies(cuda, torch.float32, 32, 8, 128)
    assert not flash_applies(cuda, torch.bfloat16, 32, 8, 100)  # would need the K/V padded: another route
    assert not flash_applies(cuda, torch.bfloat16, 32, 6, 128)  # 6 does not divide 32


def test_projection_and_delta_rule_choices():
    assert projection_route("auto") == "torch" and projection_route("layers") == "layers"
    with pytest.raises(RidgefillError, match="not one of auto, torch, layers"):
        projection_route("triton")
    assert delta_rule_route(torch.device("cpu")) == "torch"
    assert inspect.signature(delta_rule.chunk_gated_delta_rule).parameters["use_kernel"].default is False  # the
    # delta rule asks its caller (the engine's route), not the device itself


def test_overrides_replace_routes_and_refuse_what_the_device_cannot_run(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert cpu_routes(overrides="window=masked_band, causal=lower_right").describe()["window"] == "masked_band"
    with pytest.raises(RidgefillError, match="'flash' runs on CUDA only, not on cpu: pick one of cpu_split"):
        cpu_routes(overrides="causal=flash")
    with pytest.raises(RidgefillError, match="not one of flash_band, masked_band, blocks"):
        cpu_routes(overrides="window=flex")
    with pytest.raises(RidgefillError, match="is not name=route"):
        cpu_routes(overrides="speed=fast")
    monkeypatch.setenv(ENV, "causal=lower_right")
    assert cpu_routes().causal == "lower_right"


def test_the_engine_takes_its_routes(dense_model, monkeypatch):
    """The engine chooses once and its chunk rows run the route it chose: the same logits by every route, and a
    route's function is what ran."""
    from ridgefill.engine import chunk_rows

    ids = random_ids(40)
    monkeypatch.delenv(ENV, raising=False)
    eng = Engine(adapter_for(dense_model))
    assert eng.routes == cpu_routes() and eng.with_timer(None).routes is eng.routes
    plan = FillPlan(IdentityFiller(3, eng.n_layers), tail=6, window=FilledWindow(5, 0, 2))
    base = eng.prefill(ids, fill=plan, logits_at="full", chunk=16).logits
    calls = []
    band = chunk_rows.banded_attention
    monkeypatch.setattr(chunk_rows, "banded_attention", lambda *a: calls.append(1) or band(*a))
    monkeypatch.setenv(ENV, "causal=lower_right,window=masked_band")
    other = Engine(adapter_for(dense_model))
    assert (other.prefill(ids, fill=plan, logits_at="full", chunk=16).logits - base).abs().max() <= 1e-5
    assert len(calls) == 3 * 3  # 3 chunks x the 3 windowed layers below the split


def test_a_hybrid_engine_records_its_delta_rule_route_and_its_adapter_runs_it():
    adapter = adapter_for(tiny_hybrid_model("qwen3_5"))
    adapter.use_routes(SimpleNamespace(delta_rule="fla"))  # as a CUDA engine's routes would
    assert adapter.delta_kernel
    eng = Engine(adapter)
    assert eng.routes.delta_rule == "torch" and eng.routes.describe()["device"] == "cpu"
    assert not adapter.delta_kernel  # the route the engine chose (and records) is the one its layers run
