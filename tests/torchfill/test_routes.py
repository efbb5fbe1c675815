"""torchfill/routes.py: the one place that chooses each piece's route, what it chooses on the CPU, its overrides, and
that the runner takes the routes it chose."""

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

from tiny_models import random_ids, tiny_model
from ridgefill.torchfill import Runner, FilledWindow, FillPlan, IdentityFiller, adapter_for
from ridgefill.torchfill.families import delta_rule
from ridgefill.torchfill.routes import ENV, Routes, delta_rule_route, flash_applies, projection_route
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
    # delta rule asks its caller (the runner's route), not the device itself


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
    """The runner chooses once and its chunk rows run the route it chose: the same logits by every route, and a
    route's function is what ran."""
    from ridgefill.torchfill import chunk_rows

    ids = random_ids(40)
    monkeypatch.delenv(ENV, raising=False)
    eng = Runner(adapter_for(dense_model))
    assert eng.routes == cpu_routes() and eng.with_timer(None).routes is eng.routes
    plan = FillPlan(IdentityFiller(3, eng.n_layers), tail=6, window=FilledWindow(5, 0, 2))
    base = eng.prefill(ids, fill=plan, logits_at="full", chunk=16).logits
    calls = []
    band = chunk_rows.banded_attention
    monkeypatch.setattr(chunk_rows, "banded_attention", lambda *a: calls.append(1) or band(*a))
    monkeypatch.setenv(ENV, "causal=lower_right,window=masked_band")
    other = Runner(adapter_for(dense_model))
    assert (other.prefill(ids, fill=plan, logits_at="full", chunk=16).logits - base).abs().max() <= 1e-5
    assert len(calls) == 3 * 3  # 3 chunks x the 3 windowed layers below the split


def test_a_hybrid_engine_records_its_delta_rule_route_and_its_adapter_runs_it():
    adapter = adapter_for(tiny_model("qwen3_5"))
    adapter.use_routes(SimpleNamespace(delta_rule="fla"))  # as a CUDA runner's routes would
    assert adapter.delta_kernel
    eng = Runner(adapter)
    assert eng.routes.delta_rule == "torch" and eng.routes.describe()["device"] == "cpu"
    assert not adapter.delta_kernel  # the route the runner chose (and records) is the one its layers run


def test_overrides_are_checked_against_the_dtype():
    """causal=flash in fp32 would fail inside mha_fwd on the first chunk: one line naming the fix instead. Routes of a
    CUDA runner are built here without a GPU (the dataclass checks, no kernel runs)."""
    fp32 = Routes("cuda", "float32", "lower_right", "blocks", "torch", "torch")
    with pytest.raises(RidgefillError) as info:
        fp32.overridden("causal=flash")
    assert str(info.value) == ("causal route 'flash' runs in float16 or bfloat16 only, not in float32: run with "
                               "--dtype bf16, or pick lower_right for float32")
    with pytest.raises(RidgefillError) as info:
        fp32.overridden("window=flash_band")
    assert str(info.value) == ("window route 'flash_band' runs in float16 or bfloat16 only, not in float32: run with "
                               "--dtype bf16, or pick masked_band or blocks for float32")
    with pytest.raises(RidgefillError, match="'cudnn_split' runs in float16 or bfloat16 only, not in float32"):
        fp32.overridden("causal=cudnn_split")
    with pytest.raises(RidgefillError) as info:
        fp32.overridden("causal=cpu_split")
    assert str(info.value) == ("causal route 'cpu_split' runs on the CPU only, not on cuda: pick one of flash, "
                               "cudnn_split, lower_right")
    bf16 = Routes("cuda", "bfloat16", "flash", "flash_band", "torch", "torch")
    assert bf16.overridden("causal=cudnn_split").causal == "cudnn_split"
    with pytest.raises(RidgefillError) as info:
        bf16.overridden("delta_rule=fla")  # this runner's probe found no fla
    assert str(info.value) == ("RIDGEFILL_ROUTES asks for delta_rule=fla but flash-linear-attention does not import "
                               "here: install fla, or leave delta_rule out (the torch rule)")


@pytest.mark.parametrize("body,kind", [("raise RuntimeError('Triton 3.6 is too new\\nmore')", "RuntimeError"),
                                       ("raise AttributeError('triton has no attribute autotune')", "AttributeError"),
                                       ("import triton_that_is_not_here", "ModuleNotFoundError")])
def test_an_fla_that_fails_to_import_falls_back_with_one_warning(tmp_path, monkeypatch, body, kind):
    """Any failure of an installed fla's import (not only ImportError) is the torch rule and one warning; an fla that
    is not installed is the torch rule silently."""
    import sys
    import warnings

    ops = tmp_path / "fla" / "ops"
    ops.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (ops / "__init__.py").write_text("")
    (ops / "gated_delta_rule.py").write_text(body + "\n")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert delta_rule_route(torch.device("cuda")) == "torch"
    first = {"RuntimeError": "Triton 3.6 is too new", "AttributeError": "triton has no attribute autotune",
             "ModuleNotFoundError": "No module named 'triton_that_is_not_here'"}[kind]
    assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, (
        f"flash-linear-attention (fla) is installed but does not import ({kind}: {first}): the Gated DeltaNet rule "
        "takes the torch route (slower on CUDA); reinstall fla for this torch and Triton, or uninstall it"))]
    (ops / "gated_delta_rule.py").unlink()
    (tmp_path / "fla").rename(tmp_path / "not_fla")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert delta_rule_route(torch.device("cuda")) == "torch" and not caught
