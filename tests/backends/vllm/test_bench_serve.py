"""`ridgefill bench-serve`: both servers started and stopped by the command on loopback, driven by vLLM's own
benchmark client with the same seeded stream; the JSON, the table and the PNG; and its one-line refusals. The
measurement itself is a benchmark (docs/performance.md), not timed here."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from ridgefill.errors import RidgefillError
from ridgefill.evals.bench_serve import BenchServeConfig, request_prompts

pytest.importorskip("vllm")


@pytest.mark.heavy  # make test-heavy: bench-serve through the seam is make test's (test_fourth_server.py, llama.cpp's)
def test_bench_serve_drives_both_servers_and_writes_json_table_and_png(vllm_tiny, tmp_path):
    folder, maps = vllm_tiny["llama"]
    corpus = folder.parent / "corpus.txt"
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "ridgefill", "bench-serve", "--model", str(folder), "--maps", str(maps),
                        "--tail", "32", "--data", str(corpus), "--rates", "16,4", "--requests", "3",
                        "--prompt-tokens", "150", "--output-tokens", "4", "--out", str(out), "--enforce-eager"],
                       capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"] == "bench-serve" and doc["variants"] == ["exact", "ridge"]
    assert [(e["rate"], e["variant"]) for e in doc["results"]] == [(4.0, "exact"), (16.0, "exact"), (4.0, "ridge"),
                                                                    (16.0, "ridge")]
    for e in doc["results"]:
        assert e["requests"] == 3 and 0 < e["ttft_p50_s"] <= e["ttft_p90_s"] <= e["ttft_p99_s"]
        assert e["throughput_rps"] > 0 and e["goodput_rps"] == e["within_slo"] / e["duration_s"]
        assert e["tpot_mean_s"] > 0 and len(e["ttfts_s"]) == 3
    for ratio in doc["ratios"]:
        iv = ratio["interval"]
        assert iv["low"] <= ratio["ttft_p50_ratio"] == iv["estimate"] <= iv["high"]
    assert len(doc["prompts"]["tokens"]) == 3 and all(112 <= n <= 188 for n in doc["prompts"]["tokens"])
    assert (tmp_path / "bench.json.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench-serve: RidgeFill in vLLM against stock vLLM" in r.stdout and "Traceback" not in r.stderr
    for variant in ("exact", "ridge"):  # both servers were stopped: nothing listens on their ports any more
        port = int(doc["servers"][variant]["argv"][doc["servers"][variant]["argv"].index("--port") + 1])
        with socket.socket() as s:  # SO_REUSEADDR, as servers bind: a closed connection's TIME_WAIT on the port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # does not block it, a listening socket does
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("options, match", [
    ({"rates": "0,1"}, "--rates '0,1' must list positive request rates"),
    ({"rates": "fast"}, "--rates 'fast' is not a comma-separated list of numbers"),
    ({"requests": 0}, "--requests 0 must be at least 1"),
    ({"slo_ttft": -1.0}, "--slo-ttft -1 and --time-limit 1800 must be positive"),
    ({"maps": None}, "give --maps"),
    ({"tail": 0}, "--tail 0"),
])
def test_bad_options_are_one_line(options, match, tmp_path):
    values = {"maps": tmp_path / "m.safetensors", "out": tmp_path / "b.json", **options}
    with pytest.raises(RidgefillError, match=match) as caught:
        BenchServeConfig(**values).check()
    assert "\n" not in str(caught.value)


def test_prompts_are_seeded_cut_in_order_and_refused_when_the_text_is_short(tmp_path):
    class Words:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(w) for w in text.split()]}

    text = tmp_path / "t.txt"
    text.write_text("\n\n\n".join(" ".join([f"word{i}"] * 400) for i in range(60)))
    first = request_prompts(Words(), str(text), 5, 100, seed=3)
    assert first == request_prompts(Words(), str(text), 5, 100, seed=3)
    assert [len(p) for p in first] != [len(p) for p in request_prompts(Words(), str(text), 5, 100, seed=4)]
    assert all(75 <= len(p) <= 125 for p in first)
    with pytest.raises(RidgefillError, match="fewer than the"):
        request_prompts(Words(), str(text), 500, 1000, seed=3)
