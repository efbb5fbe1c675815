"""`--engine llamacpp` as a user runs it: generate, bench-ttft and loss on GGUF files the tests write (--model a
.gguf path, converted once for its identity and tokenizer), against torchfill on the same file, and the
command-level refusals (whole messages)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import tiny_gguf
from helpers import refused_line
from ridgefill.cli import app

MISSING = tiny_gguf.missing_build()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """The GGUF conversions go to a cache of the session (not the user's)."""
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def run(args):
    return CliRunner().invoke(app, args)


refused = refused_line  # `ridgefill ARGS`: exit 2 and its one line


def test_generate_compare(tiny_ggufs):
    _, path = tiny_ggufs["llama"]
    r = run(["generate", "--engine", "llamacpp", "--model", str(path), "--prompt", "the cat sat on the mat " * 6,
             "--split", "3", "--tail", "8", "--compare", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "=== exact ===" in r.output and "=== filled ===" in r.output
    assert "(llama.cpp) ttft" in r.output


def test_bench_ttft(tiny_ggufs, tmp_path):
    _, path = tiny_ggufs["qwen2"]
    out = tmp_path / "ttft.json"
    r = run(["bench-ttft", "--engine", "llamacpp", "--model", str(path), "--split", "3", "--tail", "8",
             "--lengths", "48,32", "--repeats", "2", "--warmup", "0", "--data", "random", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["variants"] == ["exact", "identity"] and doc["device"]["device"] == "cpu"
    for entry in doc["results"]:
        n = entry["length"]
        assert set(entry["timings"]) == {"transformers", "exact", "identity"} and entry["timings"]["transformers"] is None
        assert entry["fill"]["identity"]["filled_rows"] == n - 8 - 1
        assert entry["flops"]["exact"] > entry["flops"]["identity"] and entry["limit_speedup"] > 1
        assert entry["achieved_over_limit"] == pytest.approx(entry["speedup"] / entry["limit_speedup"])
    assert doc["engine"]["name"] == "llamacpp" and doc["engine"]["build"] == doc["computed_by"]
    settings = doc["engine"]["settings"]
    assert settings["identity"]["fill"] == {"split": 3, "rank": None} and settings["exact"]["fill"] is None
    assert settings["exact"]["gguf"] == str(path.resolve()) and settings["exact"]["n_batch"] == 2048


def test_loss_agrees_with_torchfill(tiny_ggufs, long_docs, tmp_path):
    """loss --engine llamacpp (the tail's next-token NLL from llama.cpp's logits) equals torchfill's on the same
    GGUF (its conversion) within llama.cpp's rounding, exact and filled."""
    _, path = tiny_ggufs["qwen3"]
    docs = {}
    for engine in ("llamacpp", "torchfill"):
        out = tmp_path / f"{engine}.json"
        r = run(["loss", "--engine", engine, "--model", str(path), "--split", "3", "--tail", "16", "--data",
                 str(long_docs), "--context", "96", "--short", "24", "--samples", "2", "--alpha", "0", "--beta",
                 "100", "--out", str(out)])
        assert r.exit_code == 0, r.output
        docs[engine] = json.loads(out.read_text())
    for variant in ("exact", "identity"):
        ours, theirs = docs["llamacpp"]["results"][variant], docs["torchfill"]["results"][variant]
        assert ours["tail_tokens"] == theirs["tail_tokens"]
        assert ours["tail_nll"] == pytest.approx(theirs["tail_nll"], abs=2e-3)
    assert docs["llamacpp"]["results"]["identity"]["tail_nll"] != docs["llamacpp"]["results"]["exact"]["tail_nll"]


@pytest.mark.parametrize("extra,message", [
    (["--filled-window", "8"], "--filled-window is not supported with --engine llamacpp: drop it"),
    (["--device", "cuda"], "--device cuda but --engine llamacpp runs llama.cpp on the CPU (GPU offload is not "
                           "supported): use --device auto or cpu"),
])
def test_refused_options(tiny_ggufs, extra, message, monkeypatch, capfd):
    _, path = tiny_ggufs["llama"]
    err = refused(["generate", "--engine", "llamacpp", "--model", str(path), "--prompt", "hi", "--split", "3",
                   *extra], monkeypatch, capfd)
    assert err == f"error: {message}"


def test_a_model_that_is_no_gguf(tiny_checkpoint, monkeypatch, capfd):
    err = refused(["generate", "--engine", "llamacpp", "--model", str(tiny_checkpoint), "--prompt", "hi", "--split",
                   "2"], monkeypatch, capfd)
    assert err == (f"error: --engine llamacpp runs GGUF files, not {tiny_checkpoint}: give --model a .gguf file or "
                   "an embedded alias (smollm2-135m)")


def test_lookback_maps(tiny_ggufs, tmp_path, monkeypatch, capfd):
    """Maps fitted with --lookback (from the GGUF's conversion) are refused before llama.cpp starts."""
    import torch

    from ridgefill.method.maps import save_maps
    from ridgefill.method.ridge import LayerFit
    from ridgefill.runtime.models import model_identity

    _, path = tiny_ggufs["llama"]
    info = model_identity(str(path)).info
    h, split, layers = 64, 3, 6
    fits = [LayerFit(layer=l, lam=1.0, weight=torch.zeros(2 * h, h), bias=torch.zeros(h), low_rank=None, error_identity=1.0,
                     error_map=0.5, error_full_rank=0.5) for l in range(split + 1, layers)]
    maps = tmp_path / "maps.safetensors"
    save_maps(maps, split, layers, fits, {"model": info, "lookback": 1}, "ridge")
    err = refused(["generate", "--engine", "llamacpp", "--model", str(path), "--prompt", "the cat sat on the mat", "--tail", "1", "--maps", str(maps)],
                  monkeypatch, capfd)
    assert err == ("error: maps with lookback 1 is not supported with --engine llamacpp: use maps fitted without "
                   "--lookback")


def test_maps_of_another_model(tiny_ggufs, tmp_path, monkeypatch, capfd):
    """Maps fitted on one GGUF's conversion are refused for another GGUF (its fingerprint), before llama.cpp starts."""
    import torch

    from ridgefill.method.maps import save_maps
    from ridgefill.method.ridge import LayerFit
    from ridgefill.runtime.models import model_identity

    _, llama = tiny_ggufs["llama"]
    _, qwen2 = tiny_ggufs["qwen2"]
    info = model_identity(str(llama)).info
    other = model_identity(str(qwen2)).info["weights_hash"]
    h, split, layers = 64, 3, 6
    fits = [LayerFit(layer=l, lam=1.0, weight=torch.eye(h), bias=torch.zeros(h), low_rank=None, error_identity=1.0,
                     error_map=0.5, error_full_rank=0.5) for l in range(split + 1, layers)]
    maps = tmp_path / "maps.safetensors"
    save_maps(maps, split, layers, fits, {"model": info}, "ridge")
    err = refused(["generate", "--engine", "llamacpp", "--model", str(qwen2), "--prompt", "the cat sat on the mat",
                   "--tail", "1", "--maps", str(maps)], monkeypatch, capfd)
    assert err == (f"error: {maps} was fitted for another model ({info['id']}, weights {info['weights_hash']}); this "
                   f"model's weights are {other}: calibrate and fit for this model")
