"""`ridgefill serve --engine llamacpp` as a user runs it (the patched llama-server behind the front), on the tiny Llama
GGUF with perturbed ridge maps (split 3 of 6, tail 8; a wrong fill shows): the OpenAI client's completion, chat
completion and stream; greedy tokens equal to `ridgefill generate --engine llamacpp`; prefix reuse equal to a fresh
prefill; /metrics counting each prompt token once; what it cannot serve refused in one line; bad configurations one
line and exit 2; bench-serve. The reuse rule alone: test_server_prefix.py; llama-server run directly:
test_llama_server.py; the queue bound, the key, hostile bodies, clients that go away, SIGTERM and the rest every
server must do: the conformance suite (tests/serve/conformance)."""

from __future__ import annotations

import json
import secrets

import pytest

import tiny_gguf
from helpers import refused_line
from served_llamacpp import perturbed_maps, start, stop

MISSING = tiny_gguf.missing_build()
# one worker runs the module (pytest-xdist --dist loadgroup): its server starts once
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}"),
              pytest.mark.xdist_group("llamacpp-server")]

PROMPT = "the cat sat on the mat and the dog ran to the park " * 3
TAIL = 8


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The GGUF conversions go to a cache of the session (test_backend.py's)."""
    return str(tmp_path_factory.getbasetemp() / "cache")


@pytest.fixture(scope="module")
def served(tiny_ggufs, tmp_path_factory, cache):
    import os

    root = tmp_path_factory.mktemp("llamacpp-server")
    _, gguf = tiny_ggufs["llama"]
    old = os.environ.get("RIDGEFILL_CACHE")
    os.environ["RIDGEFILL_CACHE"] = cache  # the maps read the conversion's identity
    try:
        maps = perturbed_maps(gguf, root / "maps.safetensors")
    finally:
        os.environ.pop("RIDGEFILL_CACHE") if old is None else os.environ.__setitem__("RIDGEFILL_CACHE", old)
    server = start(["--model", str(gguf), "--maps", str(maps), "--tail", str(TAIL)], root, secrets.token_hex(8),
                   {"RIDGEFILL_CACHE": cache})
    server.maps, server.gguf = maps, gguf
    try:
        yield server
    finally:
        stop(server.proc)


def test_the_openai_client_gets_a_completion_a_chat_completion_and_a_stream(served):
    from openai import OpenAI

    with OpenAI(base_url=served.base + "/v1", api_key=served.key, max_retries=0) as client:
        asked(client, served)


def asked(client, served) -> None:
    assert "with RidgeFill: ridge fill" in served.banner and "split 3 of 6 layers" in served.banner, served.banner
    assert [m.id for m in client.models.list().data] == [served.name]
    greedy = {"temperature": 0}
    done = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=6, **greedy)
    assert done.usage.completion_tokens == 6 and done.choices[0].text
    streamed = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=6, stream=True, **greedy)
    assert "".join(chunk.choices[0].text for chunk in streamed) == done.choices[0].text
    chat = client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": "the cat sat"}],
                                          max_tokens=4, **greedy)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
    assert "Traceback" not in served.log.read_text(errors="replace")


def test_greedy_tokens_equal_generate_on_the_same_prompt_maps_split_and_tail(served, tmp_path, monkeypatch, cache):
    """The server's filled answer is `generate --engine llamacpp`'s filled one, its answer with a tail over the
    prompt is generate's exact one, and the two differ (the maps are perturbed: a server that did not fill fails)."""
    from typer.testing import CliRunner

    from ridgefill.cli import app

    monkeypatch.setenv("RIDGEFILL_CACHE", cache)
    out = tmp_path / "generate.json"
    r = CliRunner().invoke(app, ["generate", "--engine", "llamacpp", "--model", str(served.gguf), "--maps",
                                 str(served.maps), "--tail", str(TAIL), "--prompt", PROMPT, "--max-new-tokens", "6",
                                 "--compare", "--out", str(out)])
    assert r.exit_code == 0, r.output
    runs = json.loads(out.read_text())["results"]
    assert runs["exact"]["text"] != runs["filled"]["text"], runs
    filled = served.complete(PROMPT, 6)
    assert filled["usage"]["prompt_tokens"] == runs["filled"]["prompt_tokens"]  # the same tokens
    assert filled["choices"][0]["text"] == runs["filled"]["text"]
    exact = served.complete(PROMPT, 6, ridgefill_tail=10_000)
    assert exact["choices"][0]["text"] == runs["exact"]["text"]


def tokens(served, text: str) -> list[int]:
    status, body = served.post("/tokenize", {"content": text, "add_special": True})
    assert status == 200, body
    return body["tokens"]


def test_a_prompt_sharing_a_long_prefix_reuses_only_what_a_fresh_prefill_computes_alike(served):
    """A, then B sharing most of A with a longer tail of its own: B's answer equals B's answer after a prompt that
    shares nothing (a fresh prefill); the rows reused stop where B's plan runs a row in full that A filled."""
    a = PROMPT * 2
    b = a[:-40] + " while the bird sang in the old tree"
    unrelated = "Z" + b[1:]
    served.complete(unrelated, 2)
    before = served.metrics()
    fresh = served.complete(b, 6, ridgefill_tail=30)
    shared = 1 if tokens(served, "Z")[0] == tokens(served, "a")[0] else 0  # a BOS token
    assert served.metrics()["ridgefill_cached_prompt_tokens_total"] - \
        before["ridgefill_cached_prompt_tokens_total"] == shared  # B after a prompt that shares nothing: fresh
    served.complete(a, 2)
    middle = served.metrics()
    reused = served.complete(b, 6, ridgefill_tail=30)
    after = served.metrics()
    assert reused["choices"][0]["text"] == fresh["choices"][0]["text"]
    ta, tb = tokens(served, a), tokens(served, b)
    common = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    cut = min(common, len(tb) - 30)  # B's tail ran filled in A
    assert after["ridgefill_cached_prompt_tokens_total"] - middle["ridgefill_cached_prompt_tokens_total"] == cut
    filled = after["ridgefill_filled_tokens_total"] - middle["ridgefill_filled_tokens_total"]
    assert filled == len(tb) - 30 - cut  # the filled rows after the cut, each counted once


def settled(served, wait: float = 10.0) -> dict[str, float]:
    """/metrics once the finished request has left admission (its place is freed after its last byte is sent, so a
    client can read /metrics a moment before): the admitted gauge must come back to 0."""
    import time

    deadline = time.monotonic() + wait
    while (metrics := served.metrics())["ridgefill_admitted_requests"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics["ridgefill_admitted_requests"] == 0, metrics
    return metrics


def test_metrics_count_each_prompt_token_once(served):
    """A prompt after one that shares nothing: keep-first 1 and the tail run in full, the rest filled, none cached;
    the same prompt again is cached but for its last row, which gives the first token."""
    before = served.metrics()
    body = served.complete("Q" + PROMPT, 2)
    n = body["usage"]["prompt_tokens"]
    mid = settled(served)
    delta = {k.split("ridgefill_")[1]: mid[k] - before[k] for k in mid if k.endswith("_total")}
    assert delta == {"filled_tokens_total": n - TAIL - 1, "full_tokens_total": TAIL + 1,
                     "cached_prompt_tokens_total": 0, "outlier_tokens_total": 0}, delta
    served.complete("Q" + PROMPT, 2)
    again = settled(served)
    assert again["ridgefill_cached_prompt_tokens_total"] - mid["ridgefill_cached_prompt_tokens_total"] == n - 1
    assert again["ridgefill_full_tokens_total"] - mid["ridgefill_full_tokens_total"] == 1


def test_what_llamacpp_cannot_serve_is_refused_in_one_line_and_logprobs_are_served(served):
    """Refusals (the conformance suite checks that every refusal is one clean 4xx line): embeddings (a generation
    server), more choices than llama-server has slots (one here). The log-probabilities of generated tokens come from
    rows that run in full: served."""
    cases = [("/v1/embeddings", {"input": "x"}, "embeddings and reranking are not served"),
             ("/v1/completions", {"prompt": "x", "n": 2}, "Field 'n': Value must be between 1 <= value <= 1")]
    for path, body, message in cases:
        status, answered = served.post(path, body)
        assert status == 400 and answered["error"]["message"].startswith(message), (path, answered)
    body = served.complete(PROMPT, 3, logprobs=2)
    assert len(body["choices"][0]["logprobs"]["content"]) == 3, body


def refused(args: list[str], monkeypatch, capfd) -> str:
    """`ridgefill serve --engine llamacpp ARGS`: exit 2 and its one line."""
    return refused_line(["serve", "--engine", "llamacpp", *args], monkeypatch, capfd)


def test_bad_configurations_are_one_line_and_exit_2(served, tiny_ggufs, tiny_checkpoint, monkeypatch, capfd, cache):
    from ridgefill.runtime.models import model_identity

    monkeypatch.setenv("RIDGEFILL_CACHE", cache)
    gguf, qwen2 = str(served.gguf), str(tiny_ggufs["qwen2"][1])
    model_identity(qwen2)  # converted once beforehand (the conversion's progress bar is no refusal's)
    assert refused(["--model", str(tiny_checkpoint), "--split", "2"], monkeypatch, capfd) == (
        f"error: --engine llamacpp runs GGUF files, not {tiny_checkpoint}: give --model a .gguf file or an embedded "
        "alias (smollm2-135m)")
    assert refused(["--model", gguf, "--split", "3", "--max-model-len", "4096"], monkeypatch, capfd) == (
        "error: --max-model-len is not an option of --engine llamacpp's server, which takes --api-key KEY, --n-ctx N "
        "and --parallel N (vLLM's options need --engine vllm)")
    from ridgefill.backends import server_of
    from ridgefill.backends.llamacpp.server import split_args

    assert split_args(server_of("llamacpp").context_args(4096)) == {"--n-ctx": "4096"}  # bench-serve's sizing
    assert refused(["--model", gguf, "--split", "3", "--n-ctx", "0"], monkeypatch, capfd) == (
        "error: --n-ctx '0' is not a number of tokens: give e.g. --n-ctx 4096")
    assert refused(["--model", gguf, "--split", "3", "--parallel", "0"], monkeypatch, capfd) == (
        "error: --parallel '0' is not a number of slots: give 1..64, e.g. --parallel 2")
    assert refused(["--model", gguf, "--split", "3", "--dtype", "bf16"], monkeypatch, capfd).startswith(
        "error: --dtype bf16 is not supported with --engine llamacpp")
    assert refused(["--model", gguf, "--split", "3", "--kv-cache-gib", "1"], monkeypatch, capfd).startswith(
        "error: --kv-cache-gib is not supported with --engine llamacpp")
    assert refused(["--model", qwen2, "--maps", str(served.maps), "--port", str(served.port())], monkeypatch,
                   capfd).startswith(f"error: {served.maps} was fitted for another model")
    assert refused(["--model", gguf, "--split", "3", "--port", str(served.port())], monkeypatch, capfd).startswith(
        f"error: cannot listen on 127.0.0.1:{served.port()}")
    assert refused(["--model", gguf, "--split", "3", "--filled-window", "64"], monkeypatch, capfd).startswith(
        "error: --filled-window is not supported with --engine llamacpp")


def test_a_serving_config_and_the_stock_server_bench_serve_compares(served, tmp_path, monkeypatch, cache):
    """serve reads tune's serving config as vLLM's serve does (its fill into the server's SPEC, the maps checked by
    sha256 and written as the GGUF adapter llama-server reads); the same server without a fill (serve.stock_plan:
    --stock, no guard, no RidgeFill counter) answers a prompt as the filled server answers it with a tail over the
    whole prompt (exact), and refuses RidgeFill's options."""
    from helpers import free_port
    from ridgefill.backends.llamacpp.server import KEY_ENV
    from ridgefill.method.fill import SERVING_KIND, FillSettings
    from ridgefill.runtime.models import model_identity
    from ridgefill.serve.process import running
    from ridgefill.serve.serve import ServeConfig, serve_plan, stock_plan

    monkeypatch.setenv("RIDGEFILL_CACHE", cache)
    weights = model_identity(str(served.gguf)).info["weights_hash"]
    fill = FillSettings("ridge", 3, served.maps, tail=12, keep_first=1, outlier_factor=20.0)
    config = tmp_path / "serving.json"
    config.write_text(json.dumps({"kind": SERVING_KIND, "version": 2, "model": {"weights_hash": weights},
                                  **fill.to_serving()}))
    c = ServeConfig(model=str(served.gguf), serving_config=config, port=free_port(), engine="llamacpp",
                    log_file=tmp_path / "filled.log", server_args=["--api-key", served.key])
    c.check()
    plan = serve_plan(c, tmp_path)
    spec = json.loads((tmp_path / "llamacpp-server.json").read_text())
    assert spec["fill"]["tail"] == 12 and spec["fill"]["adapter"] == str(tmp_path / "maps.gguf")
    from ridgefill.method.maps import load_maps

    ours, theirs = load_maps(served.maps)[0], load_maps(tmp_path / "maps.gguf")[0]
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)  # F32: the same numbers
    assert plan.env[KEY_ENV] == served.key and served.key not in " ".join(plan.argv)
    assert "--guard" in plan.argv and "tail 12" in plan.banner
    stock = stock_plan(c, tmp_path, tmp_path / "stock.log")
    assert "--guard" not in stock.argv and stock.argv[-1] == "--stock" and stock.marker is None
    exact = served.complete(PROMPT, 6, ridgefill_tail=10_000)
    with running(stock):
        base = stock.health.removesuffix("/health")
        server = type(served)(served.proc, base, served.key, stock.log, stock.banner, served.name)
        assert server.complete(PROMPT, 6)["choices"][0]["text"] == exact["choices"][0]["text"]
        assert not any(k.endswith("_total") for k in server.metrics())  # llama-server without --ridgefill
        status, body = server.post("/v1/completions", {"prompt": "x", "ridgefill_tail": 4})
        assert status == 400 and "runs without RidgeFill" in body["error"]["message"], body


def test_bench_serve_runs_the_filled_and_the_stock_server_under_poisson_load(served, tmp_path, cache):
    """`ridgefill bench-serve --engine llamacpp`: both servers started one after the other (the stock one with
    --stock, no guard), the same seeded stream at two rates through ridgefill's load client, and the result: each
    TTFT percentile with an interval, the fill/stock ratio per rate, the engine's provenance, the PNG."""
    import os
    import subprocess
    import sys

    from tiny_models import write_corpus

    text = write_corpus(tmp_path / "text.txt", seed=7, lines_per_document=6)
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "ridgefill", "bench-serve", "--engine", "llamacpp", "--model",
                        str(served.gguf), "--maps", str(served.maps), "--tail", str(TAIL), "--data", str(text),
                        "--rates", "4,8", "--requests", "3", "--prompt-tokens", "40", "--output-tokens", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RIDGEFILL_CACHE": cache})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [(e["rate"], e["variant"]) for e in doc["results"]] == [(4.0, "exact"), (8.0, "exact"), (4.0, "ridge"),
                                                                  (8.0, "ridge")]
    for e in doc["results"]:
        assert e["requests"] == 3 and 0 < e["ttft_p50_s"] <= e["ttft_p90_s"] <= e["ttft_p99_s"]
        for q in ("p50", "p90", "p99"):
            iv = e["ttft_intervals_s"][q]
            assert iv["low"] <= iv["estimate"] <= iv["high"]
    assert [x["rate"] for x in doc["ratios"]] == [4.0, 8.0] and all(x["ttft_p50_ratio"] > 0 for x in doc["ratios"])
    assert doc["computed_by"]["engine"] == "llamacpp" and doc["config"]["dtype"] == "gguf"
    assert "--stock" in doc["servers"]["exact"]["argv"] and "--stock" not in doc["servers"]["ridge"]["argv"]
    assert "--guard" in doc["servers"]["ridge"]["argv"] and "--guard" not in doc["servers"]["exact"]["argv"]
    assert (tmp_path / "bench.json.png").stat().st_size > 0
    assert "RidgeFill in llama.cpp against stock llama.cpp" in r.stdout
