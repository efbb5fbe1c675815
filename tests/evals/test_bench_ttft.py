"""bench-ttft: the FLOP count against a hand count, the JSON document end to end on the tiny checkpoint, and
bad input. Wall-clock values are never asserted."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tiny_models import tiny_model
from ridgefill.cli import app
from ridgefill.torchfill import MapFiller, ModelShape
from ridgefill.errors import RidgefillError
from ridgefill.evals.bench_ttft import COMMAND as bench_ttft_command
from ridgefill.evals.flops import prefill_flops, row_flops

SHAPE = ModelShape(layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)


def test_flop_count_matches_a_hand_count():
    # per row and layer: q 2·4·4=32, k 2·4·2=16, v 16, o 32, mlp 3·2·4·8=192 -> 288
    assert sum(row_flops(SHAPE).values()) == 288
    # attention of rows 0,1,2: 4·Hq·D·(1+2+3) = 4·2·2·6 = 96; one layer of 3 rows: 3·288 + 96 = 960
    # exact, 2 layers: 2·960 + LM head 2·4·10 = 2000
    assert prefill_flops(SHAPE, 3) == 2000
    # split 1, only row 2 full: layer 0 exact (960); layer 1: row 2 runs 288 + 4·2·2·3 = 336, rows 0,1 only K,V
    # 2·(16+16) = 64 -> 400; no maps (L-S-1 = 0): 960 + 400 + 80 = 1440
    full = np.array([False, False, True])
    assert prefill_flops(SHAPE, 3, full, split=1) == 1440
    three = ModelShape(3, 4, 2, 1, 2, 8, 10)
    assert prefill_flops(three, 3) == 3 * 960 + 80
    # 3 layers, split 1: layers 1 and 2 as above (2·400), one map per filled row: full rank 2·4·4 = 32,
    # rank 1: x·U (2·4·1) + z·V (2·1·4) = 16
    full_rank = MapFiller(1, 3, torch.eye(4).expand(1, 4, 4), torch.zeros(1, 4))
    rank_one = MapFiller(1, 3, None, torch.zeros(1, 4), (torch.ones(1, 4, 1), torch.ones(1, 1, 4)))
    assert full_rank.flops_per_row() == 32 and rank_one.flops_per_row() == 16
    assert prefill_flops(three, 3, full, 1, full_rank.flops_per_row()) == 960 + 800 + 2 * 32 + 80
    assert prefill_flops(three, 3, full, 1, rank_one.flops_per_row()) == 960 + 800 + 2 * 16 + 80
    # every row full, or split at the last layer: the exact count
    assert prefill_flops(three, 3, np.ones(3, bool), 1) == prefill_flops(three, 3)
    assert prefill_flops(three, 3, full, 3) == prefill_flops(three, 3)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_row_flops_are_twice_the_layer_weights(family):
    """The shapes the count reads agree with the model: one row through a layer's linear maps costs 2 FLOPs per
    weight (qwen3's head_dim differs from hidden/heads)."""
    model = tiny_model(family)
    from ridgefill.torchfill import Runner, adapter_for
    from ridgefill.runtime.session import Session

    session = Session(loaded=type("L", (), {"model": model})(), runner=Runner(adapter_for(model)))
    shape = session.shape
    assert shape.layer_kinds == ("attention",) * 6 and shape.dense and session.model is model
    layer = model.model.layers[0]
    weights = sum(m.weight.numel() for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                             layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                             layer.mlp.down_proj))
    assert sum(row_flops(shape).values()) == 2 * weights


def test_options_and_defaults_are_those_of_the_command_line():
    defaults = {flag: o.default for flag, o in bench_ttft_command.options.items()}
    assert defaults == {
        "model": "smollm2-135m", "maps": None, "split": None, "tail": 256, "lengths": "1024,2048,4096,8192",
        "repeats": 5, "warmup": 1, "device": "auto", "dtype": "auto", "out": Path("ttft.json"), "variants": None,
        "data": "wiki-leads", "keep-first": 1, "chunk": 2048, "threads": 0, "projection": "auto", "seed": 0,
        "outlier-factor": 20.0,  # issue #12: outlier rows run in full by default
        "serving-config": None,  # issue #13: the settings `ridgefill tune` chose
        "engine": "torchfill",  # issue #11: vllm times stock vLLM against the plugin
        "filled-window": 0, "filled-window-layers": None,  # issue #27: local attention below the split, off
    }  # device and dtype auto (issue 38): cuda and bf16 where a GPU runs them, else cpu and fp32
    helps = {flag: o.help for flag, o in bench_ttft_command.options.items()}
    assert helps["split"] == "Split S (the maps carry it; identity fill needs it without them)."  # the fill's own (issue 40)
    assert helps["seed"] == "Seed of random prompts and bootstrap intervals."
    assert helps["out"] == "Result JSON (raw samples included)."
    assert helps["projection"].startswith("Fill projection: auto or torch")


def _write_maps(path: Path, checkpoint: Path, split: int, rank: int | None) -> Path:
    """A maps file for the tiny checkpoint (random maps, recorded held-out errors)."""
    from transformers import AutoModelForCausalLM

    from ridgefill.method.maps import save_maps
    from ridgefill.runtime.models import checkpoint_fingerprint
    from ridgefill.method.ridge import LayerFit

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    h, n_layers = model.config.hidden_size, model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    fits = []
    for layer in range(split + 1, n_layers):
        low = (0.1 * torch.randn(h, rank, generator=g), 0.1 * torch.randn(rank, h, generator=g)) if rank else None
        weight = None if rank else torch.eye(h) + 0.05 * torch.randn(h, h, generator=g)
        fits.append(LayerFit(layer, 1e-3, weight, 0.01 * torch.randn(h, generator=g), low, 0.5, 0.25, 0.2))
    meta = {"model": {"id": str(checkpoint), "weights_hash": checkpoint_fingerprint(checkpoint)}, "rank": rank}
    save_maps(path, split, n_layers, fits, meta, "ridge")
    return path


def test_bench_ttft_writes_the_document(tiny_checkpoint, tmp_path):
    maps = _write_maps(tmp_path / "maps.safetensors", tiny_checkpoint, split=2, rank=4)
    out = tmp_path / "ttft.json"
    result = CliRunner().invoke(app, ["bench-ttft", "--model", str(tiny_checkpoint), "--maps", str(maps),
                                      "--tail", "8", "--lengths", "40,24", "--repeats", "2", "--warmup", "0",
                                      "--data", "random", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    for key in ("command", "model", "maps", "config", "variants", "results", "intervals", "seed",
                "ridgefill_version", "started_at", "duration_s", "map_memory", "device", "versions"):
        assert key in doc
    assert doc["command"] == "bench-ttft" and doc["variants"] == ["exact", "identity", "ridge"]
    assert doc["split"] == 2 and doc["versions"]["torch"] == torch.__version__
    assert [r["length"] for r in doc["results"]] == [24, 40]
    for entry in doc["results"]:
        n = entry["length"]
        assert entry["headline_variant"] == "ridge" and entry["prompt"] == "random"
        assert set(entry["timings"]) == {"transformers", "exact", "identity", "ridge"}
        for t in entry["timings"].values():
            assert len(t["samples_s"]) == 2 and t["min_s"] <= t["median_s"] <= t["p90_s"]
            assert t["tokens_per_s"] == pytest.approx(n / t["median_s"])
        exact, ridge = entry["timings"]["exact"], entry["timings"]["ridge"]
        assert entry["speedup"] == pytest.approx(exact["median_s"] / ridge["median_s"])
        assert entry["fill"]["ridge"]["filled_rows"] == n - 8 - 1  # tail 8, keep-first 1
        assert entry["first_token"]["exact"] == entry["first_token"]["transformers"]
        # FLOP limit: from the count; low-rank maps cost less than full ones, identity none
        flops = entry["flops"]
        assert flops["exact"] > flops["identity"] and flops["ridge"] > flops["identity"]
        assert entry["limit_speedup"] == pytest.approx(flops["exact"] / flops["ridge"])
        assert entry["achieved_over_limit"] == pytest.approx(entry["speedup"] / entry["limit_speedup"])
        assert 0 < entry["fill"]["ridge"]["projection_share"] < 1
        assert entry["map_bytes"] == doc["map_memory"]["map_bytes"] > 0
        iv = doc["intervals"]["speedup"]["ridge"][str(n)]
        assert iv["low"] <= iv["estimate"] <= iv["high"]
        assert str(n) in doc["intervals"]["exact_vs_transformers"]
    memory = doc["map_memory"]
    h, maps_count = 64, 6 - 2 - 1
    assert memory["map_bytes"] == 4 * (h * maps_count * 4 + maps_count * 4 * h + maps_count * h)  # U, V, bias
    assert memory["rank"] == 4
    assert memory["heldout_error"] == pytest.approx({"map": 0.25, "full_rank": 0.2, "identity": 0.5})
    assert memory["fused_kv_bytes"] > 0


def test_bench_ttft_identity_needs_only_a_split(tiny_checkpoint, tmp_path):
    doc = bench_ttft_command(model=str(tiny_checkpoint), split=3, tail=4, lengths="20", repeats=1, warmup=1,
                             out=tmp_path / "t.json", data="random", keep_first=0)
    assert doc["variants"] == ["exact", "identity"] and doc["maps"] is None
    (entry,) = doc["results"]
    assert entry["headline_variant"] == "identity" and entry["fill"]["identity"]["filled_rows"] == 16
    assert doc["map_memory"]["map_bytes"] == 0 and doc["map_memory"]["heldout_error"] is None
    written = json.loads((tmp_path / "t.json").read_text())  # one run per entry: an estimate, no interval
    iv = written["intervals"]["speedup"]["identity"]["20"]
    assert iv["estimate"] == pytest.approx(entry["speedup"]) and iv["low"] is None and iv["high"] is None


@pytest.mark.parametrize("options,message", [
    (dict(lengths="5000"), "exceeds the model's context of 4096"),
    (dict(lengths="a,b"), "not a comma-separated list"),
    (dict(lengths="1"), "at least 2 tokens"),
    (dict(variants="exact"), "needs at least one of identity, ridge"),
    (dict(variants="exact,magic"), "unknown variant"),
    (dict(variants="exact,ridge"), "needs --maps"),
    (dict(repeats=0), "--repeats must be >= 1"),
    (dict(dtype="fp64"), "unknown dtype"),
    (dict(projection="fast"), "unknown --projection"),
])
def test_bad_input_is_one_line(tiny_checkpoint, tmp_path, options, message):
    kwargs = dict(model=str(tiny_checkpoint), split=2, lengths="16", repeats=1, out=tmp_path / "t.json",
                  data="random")
    kwargs.update(options)
    with pytest.raises(RidgefillError, match=message):
        bench_ttft_command(**kwargs)
    assert not (tmp_path / "t.json").exists()


def test_the_deleted_triton_projection_is_an_unknown_projection(tiny_checkpoint, tmp_path):
    """The Triton kernel lost to the torch path on an H200 (slower, less accurate) and was deleted (issue 38)."""
    with pytest.raises(RidgefillError, match="unknown --projection 'triton': use one of auto, torch, layers"):
        bench_ttft_command(model=str(tiny_checkpoint), split=2, lengths="16", repeats=1, out=tmp_path / "t.json",
                           data="random", projection="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_gpu_exits_2_with_one_line(tiny_checkpoint, tmp_path):
    exe = Path(sys.executable).parent / "ridgefill"
    proc = subprocess.run([str(exe), "bench-ttft", "--model", str(tiny_checkpoint), "--split", "2", "--device",
                           "cuda", "--out", str(tmp_path / "t.json")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --device cuda but no CUDA GPU is visible: use --device cpu"]
