"""`generate --engine vllm` and `bench-ttft --engine vllm`: the same options and result documents as ridgefill's
own engine, with stock vLLM as exact and the plugin for fills."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ridgefill.commands import command
from ridgefill.errors import RidgefillError
from ridgefill.runtime.session import open_session
from vllm_fixtures import vllm_tiny  # noqa: F401  (fixture)

pytest.importorskip("vllm")


def test_generate_in_vllm_prints_only_the_text_on_stdout_and_equals_ridgefills_engine(vllm_tiny, tmp_path):
    """`ridgefill generate --engine vllm` as a user runs it (identity fill at split 2 through an identity maps file):
    stdout carries the generated text alone (vLLM's log goes to stderr), the same text as ridgefill's own engine."""
    folder, _ = vllm_tiny["qwen2"]
    prompt = " ".join(["the king and the queen walked by the river at night"] * 30)
    options = dict(model=str(folder), split=2, tail=32, prompt=prompt, max_new_tokens=12)
    ours = command("generate")(**options)["filled"]
    r = subprocess.run([sys.executable, "-m", "ridgefill", "generate", "--engine", "vllm", "--model", str(folder),
                        "--split", "2", "--tail", "32", "--prompt", prompt, "--max-new-tokens", "12"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == ours + "\n", r.stdout[:2000]
    assert "(vLLM)" in r.stderr and "prompt rows filled" in r.stderr and "Traceback" not in r.stderr


def test_bench_ttft_in_vllm_writes_the_same_document(vllm_tiny, tmp_path):
    folder, maps = vllm_tiny["llama"]
    out = tmp_path / "ttft.json"
    doc = command("bench-ttft")(model=str(folder), maps=maps, tail=24, lengths="200,300", repeats=2, warmup=1,
                                data="random", engine="vllm", variants="exact,ridge", out=out)
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(doc["results"]))
    assert doc["config"]["engine"] == "vllm" and doc["variants"] == ["exact", "ridge"]
    engines = doc["vllm_engines"]
    assert engines["exact"]["plugin"] is False and engines["exact"]["fill"] is None
    assert engines["ridge"]["fill"]["tail"] == 24 and engines["ridge"]["enable_prefix_caching"] is False
    session = open_session(str(folder))
    vocab = session.shape.vocab
    from ridgefill.runtime.session import variant_plans

    plans, _ = variant_plans(session, str(maps), None, 24, [0], ("exact", "ridge"), 20.0)
    runs = 3  # warmup + repeats
    for entry in doc["results"]:
        n = entry["length"]
        assert set(entry["timings"]) == {"exact", "ridge"}
        assert all(len(t["samples_s"]) == 2 and t["median_s"] > 0 for t in entry["timings"].values())
        for name in ("ridge",):
            fill = entry["fill"][name]
            assert fill["filled_rows"] == n - 25
            assert fill["limit_speedup"] > 1 and fill["speedup_interval"]["estimate"] == fill["speedup"]
        ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n))  # bench's random prompt
        for name, plan in plans.items():  # vLLM's first token is ridgefill's engine's, for every variant
            want = int(session.engine.prefill(ids, plan).logits[0, -1].argmax())
            assert entry["first_token"][name] == want, (n, name)
    expected = runs * sum(e["length"] - 25 for e in doc["results"])
    assert doc["fill_rows"]["ridge"]["filled_rows"] + doc["fill_rows"]["ridge"]["outlier_rows_run_full"] == expected
    tally = engines["ridge"]["tally"]
    assert {k: tally[k] for k in doc["fill_rows"]["ridge"]} == doc["fill_rows"]["ridge"]
    assert tally["stock_steps"] == 0 and tally["full_prompt_rows"] == runs * 25 * len(doc["results"]) + \
        tally["outlier_rows_run_full"]


def test_bench_ttft_refuses_timings_of_a_fill_that_filled_nothing():
    from ridgefill.evals.bench_ttft_vllm import check_filled

    tally = {"filled_rows": 0, "full_prompt_rows": 600, "stock_steps": 3}
    with pytest.raises(RidgefillError, match="ridge filled none of the 525 prompt rows it should have filled in vLLM "
                                             r"\(600 ran in full, 3 steps ran stock\)"):
        check_filled("ridge", tally, 525)
    check_filled("ridge", tally, 0)  # nothing to fill (tail over the prompts): nothing to refuse
    check_filled("ridge", {**tally, "filled_rows": 1}, 525)


@pytest.mark.parametrize("options, message", [
    ({"engine": "sglang"}, "unknown --engine 'sglang'"),
    ({"engine": "vllm", "keep_rows": "3-5"}, "not supported with --engine vllm"),
])
def test_generate_engine_errors(options, message, tmp_path):
    with pytest.raises(RidgefillError, match=message):
        command("generate")(prompt="hi", split=2, **options)


def test_bench_projection_is_ridgefills_own(tmp_path):
    with pytest.raises(RidgefillError, match="drop it with --engine vllm"):
        command("bench-ttft")(split=2, engine="vllm", projection="torch", out=tmp_path / "x.json")
