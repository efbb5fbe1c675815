"""Maps as a GGUF adapter in `--engine llamacpp`: `generate` and `serve` with the .gguf maps give the tokens they give
with the safetensors maps (F32; F16's tokens may part at a near tie: docs/llamacpp.md), and an adapter for another
architecture is one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import tiny_gguf
from helpers import refused_line
from ridgefill.cli import app
from ridgefill.runtime.models import model_identity
from served_llamacpp import perturbed_maps

MISSING = tiny_gguf.missing_build()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}")
PROMPTS = ["the cat sat on the mat " * 8, "one two three four five six seven eight nine ten " * 4]


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """The GGUF conversions go to a cache of the session (not the user's)."""
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def run(args):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    return r


def generate(gguf, maps, prompt, out) -> dict:
    run(["generate", "--engine", "llamacpp", "--model", str(gguf), "--maps", str(maps), "--prompt", prompt, "--tail",
         "6", "--max-new-tokens", "8", "--out", str(out)])
    return json.loads(out.read_text())["results"]["filled"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_reads_gguf_maps_as_the_safetensors_maps(family, tiny_ggufs, tmp_path):
    _, gguf = tiny_ggufs[family]
    maps = {"safetensors": perturbed_maps(gguf, tmp_path / "maps.safetensors", split=3)}
    for kind in ("f32", "f16"):
        maps[kind] = tmp_path / f"maps-{kind}.gguf"
        run(["convert-maps", "--maps", str(maps["safetensors"]), "--out", str(maps[kind]), "--gguf-type", kind])
    for i, prompt in enumerate(PROMPTS):
        got = {k: generate(gguf, path, prompt, tmp_path / f"{k}-{i}.json") for k, path in maps.items()}
        want = got["safetensors"]
        assert want["filled_tokens"] > 0
        assert got["f32"]["tokens"] == want["tokens"] and got["f32"]["filled_tokens"] == want["filled_tokens"]
        assert got["f16"]["filled_tokens"] == want["filled_tokens"]  # its tokens may part at a near tie


def test_an_adapter_for_another_architecture_is_refused(tiny_ggufs, tmp_path, monkeypatch, capfd):
    _, llama = tiny_ggufs["llama"]
    _, qwen2 = tiny_ggufs["qwen2"]
    maps = perturbed_maps(llama, tmp_path / "maps.safetensors", split=3)
    run(["convert-maps", "--maps", str(maps), "--out", str(tmp_path / "maps.gguf")])
    model_identity(str(qwen2))  # converted once for its identity, before the line is read (its progress bar)
    err = refused_line(["generate", "--engine", "llamacpp", "--model", str(qwen2), "--prompt", "the cat sat on the "
                        "mat", "--tail", "1", "--maps", str(tmp_path / "maps.gguf")], monkeypatch, capfd)
    assert err == (f"error: {tmp_path / 'maps.gguf'} holds maps for a llama model, this model is qwen2: fit maps for "
                   "this model (ridgefill calibrate, then ridgefill fit --out maps.gguf)")


def test_serve_serves_gguf_maps_as_the_safetensors_maps(tiny_ggufs, tmp_path):
    """`serve --engine llamacpp --maps maps.gguf` (F32): its greedy answer is `generate`'s with the safetensors maps,
    and /metrics counts the rows it filled."""
    import os
    import secrets

    from served_llamacpp import start, stop

    _, gguf = tiny_ggufs["llama"]
    maps = perturbed_maps(gguf, tmp_path / "maps.safetensors", split=3)
    run(["convert-maps", "--maps", str(maps), "--out", str(tmp_path / "maps.gguf"), "--gguf-type", "f32"])
    want = generate(gguf, maps, PROMPTS[0], tmp_path / "generate.json")
    server = start(["--model", str(gguf), "--maps", str(tmp_path / "maps.gguf"), "--tail", "6"], tmp_path,
                   secrets.token_hex(8), {"RIDGEFILL_CACHE": os.environ["RIDGEFILL_CACHE"]})
    try:
        got = server.complete(PROMPTS[0], 8)
        assert got["usage"]["prompt_tokens"] == want["prompt_tokens"]
        assert got["choices"][0]["text"] == want["text"]
        assert server.metrics()["ridgefill_filled_tokens_total"] == want["filled_tokens"]
    finally:
        stop(server.proc)
