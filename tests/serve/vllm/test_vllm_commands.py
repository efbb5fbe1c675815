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

pytest.importorskip("vllm")


def test_generate_in_vllm_prints_only_the_text_on_stdout_and_equals_ridgefills_engine(vllm_tuned, vllm_tiny,
                                                                                    tmp_path):
    """`ridgefill generate --engine vllm --serving-config` with the identity config `ridgefill tune` wrote, run as a
    user runs it: stdout carries the generated text alone (vLLM's log goes to stderr), the text ridgefill's own
    engine generates from the same config (identity fill in vLLM goes through an identity maps file)."""
    folder, _ = vllm_tiny["llama"]
    prompt = " ".join(["the king and the queen walked by the river at night"] * 30)
    config = vllm_tuned["identity"]
    ours = command("generate")(model=str(folder), serving_config=config, prompt=prompt, max_new_tokens=12)["filled"]
    r = subprocess.run([sys.executable, "-m", "ridgefill", "generate", "--engine", "vllm", "--model", str(folder),
                        "--serving-config", str(config), "--prompt", prompt, "--max-new-tokens", "12"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == ours + "\n", r.stdout[:2000]
    assert "(vLLM)" in r.stderr and "prompt rows filled" in r.stderr and "Traceback" not in r.stderr


def test_bench_ttft_in_vllm_takes_tunes_ridge_config_and_writes_the_same_document(vllm_tuned, vllm_tiny, tmp_path):
    """`bench-ttft --engine vllm --serving-config` with the ridge config tune wrote (its maps by path and sha256):
    the document ridgefill's engine writes, and vLLM's first token equals ridgefill's engine's for both variants."""
    from ridgefill.method.fill import load_serving

    folder, _ = vllm_tiny["llama"]
    fill = load_serving(vllm_tuned["ridge"]).fill
    out = tmp_path / "ttft.json"
    doc = command("bench-ttft")(model=str(folder), serving_config=vllm_tuned["ridge"], lengths="200,300", repeats=2,
                                warmup=1, data="random", engine="vllm", out=out)
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(doc["results"]))
    assert doc["config"]["engine"] == "vllm" and doc["variants"] == ["exact", "ridge"]
    engines = doc["vllm_engines"]
    assert engines["exact"]["plugin"] is False and engines["exact"]["fill"] is None
    assert engines["ridge"]["fill"]["tail"] == fill.tail == 32
    assert engines["ridge"]["enable_prefix_caching"] is True and engines["ridge"]["enforce_eager"] is False
    assert engines["ridge"]["fill"]["maps_sha256"] == fill.maps_sha256
    session = open_session(str(folder))
    vocab = session.shape.vocab
    plans = {"exact": None, "ridge": fill.plan(session)[0]}
    runs = 3  # warmup + repeats
    for entry in doc["results"]:
        n = entry["length"]
        assert set(entry["timings"]) == {"exact", "ridge"}
        assert all(len(t["samples_s"]) == 2 and t["median_s"] > 0 for t in entry["timings"].values())
        ridge = entry["fill"]["ridge"]
        assert ridge["filled_rows"] == n - 33
        assert ridge["limit_speedup"] > 1 and ridge["speedup_interval"]["estimate"] == ridge["speedup"]
        ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n))  # bench's random prompt
        for name, plan in plans.items():  # vLLM's first token is ridgefill's engine's, for every variant
            want = int(session.engine.prefill(ids, plan).logits[0, -1].argmax())
            assert entry["first_token"][name] == want, (n, name)
    expected = runs * sum(e["length"] - 33 for e in doc["results"])
    assert doc["fill_rows"]["ridge"]["filled_rows"] + doc["fill_rows"]["ridge"]["outlier_rows_run_full"] == expected
    tally = engines["ridge"]["tally"]
    assert {k: tally[k] for k in doc["fill_rows"]["ridge"]} == doc["fill_rows"]["ridge"]
    assert tally["stock_steps"] == 0 and tally["full_prompt_rows"] == runs * 33 * len(doc["results"]) + \
        tally["outlier_rows_run_full"]


def test_bench_ttft_refuses_timings_of_a_fill_that_filled_nothing():
    from ridgefill.backends.vllm import check_filled

    tally = {"filled_rows": 0, "full_prompt_rows": 600, "stock_steps": 3}
    with pytest.raises(RidgefillError, match="ridge filled none of the 525 prompt rows it should have filled in vLLM "
                                             r"\(600 ran in full, 3 steps ran stock\)"):
        check_filled("ridge", tally, 525)
    check_filled("ridge", tally, 0)  # nothing to fill (tail over the prompts): nothing to refuse
    check_filled("ridge", {**tally, "filled_rows": 1}, 525)


@pytest.mark.parametrize("options, message", [
    ({"engine": "sglang"}, "unknown --engine 'sglang': use one of ridgefill, vllm"),
    ({"engine": "vllm", "keep_rows": "3-5"}, "--keep-rows is not supported with --engine vllm: drop it"),
    ({"engine": "vllm", "keep_text": "the"}, "--keep-text is not supported with --engine vllm: drop it"),
    ({"engine": "vllm", "filled_window": 32}, "--filled-window is not supported with --engine vllm: drop it"),
])
def test_generate_engine_errors(options, message, tmp_path):
    """What the vLLM backend lacks (backends/vllm.py's Capabilities) is refused in one line before anything loads."""
    with pytest.raises(RidgefillError) as err:
        command("generate")(prompt="hi", split=2, **options)
    assert str(err.value) == message


@pytest.mark.parametrize("name, options, message", [
    ("bench-ttft", {"projection": "torch"}, "--projection is not supported with --engine vllm: drop it"),
    ("bench-ttft", {"variants": "exact,drop"}, "the drop variant is not supported with --engine vllm: use exact, "
                                               "identity, ridge, mean"),
    ("ruler", {"variants": "exact,drop"}, "the drop variant is not supported with --engine vllm: use exact, "
                                          "identity, ridge, mean"),
    ("loss", {"filled_window": 16, "data": "wiki-leads"}, "--filled-window is not supported with --engine vllm: drop it"),
])
def test_measurements_refuse_what_vllm_lacks(name, options, message, tmp_path):
    with pytest.raises(RidgefillError) as err:
        command(name)(split=2, engine="vllm", out=tmp_path / "x.json", **options)
    assert str(err.value) == message
