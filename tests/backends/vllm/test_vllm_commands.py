"""`generate --engine vllm` and `bench-ttft --engine vllm`: the same options and result documents as torchfill's,
with stock vLLM as exact and the plugin for fills."""

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
    the document torchfill writes, and vLLM's first token equals torchfill's for both variants."""
    from ridgefill.method.fill import load_serving

    folder, _ = vllm_tiny["llama"]
    fill = load_serving(vllm_tuned["ridge"]).fill
    out = tmp_path / "ttft.json"
    doc = command("bench-ttft")(model=str(folder), serving_config=vllm_tuned["ridge"], lengths="200,300", repeats=2,
                                warmup=1, data="random", engine="vllm", out=out)
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(doc["results"]))
    assert doc["config"]["engine"] == "vllm" and doc["variants"] == ["exact", "ridge"]
    assert doc["engine"]["name"] == "vllm" and doc["engine"]["build"] == doc["computed_by"]
    settings = doc["engine"]["settings"]
    assert settings["exact"]["plugin"] is False and settings["exact"]["fill"] is None
    assert settings["ridge"]["fill"]["tail"] == fill.tail == 32
    assert settings["ridge"]["enable_prefix_caching"] is True and settings["ridge"]["enforce_eager"] is False
    assert settings["ridge"]["fill"]["maps_sha256"] == fill.maps_sha256
    session = open_session(str(folder))
    vocab = session.shape.vocab
    plans = {"exact": None, "ridge": fill.plan(session)[0]}
    runs = 3  # warmup + repeats
    for entry in doc["results"]:
        n = entry["length"]
        assert set(entry["timings"]) == {"transformers", "exact", "ridge"} and entry["timings"]["transformers"] is None
        assert all(len(t["samples_s"]) == 2 and t["median_s"] > 0 and t["engine_first_token_latency_median_s"] > 0
                   for name, t in entry["timings"].items() if name != "transformers")
        ridge = entry["fill"]["ridge"]
        assert ridge["filled_rows"] == n - 33
        assert ridge["limit_speedup"] > 1 and ridge["speedup_interval"]["estimate"] == ridge["speedup"]
        ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n))  # bench's random prompt
        for name, plan in plans.items():  # vLLM's first token is torchfill's, for every variant
            want = int(session.runner.prefill(ids, plan).logits[0, -1].argmax())
            assert entry["first_token"][name] == want, (n, name)
    expected = runs * sum(e["length"] - 33 for e in doc["results"])
    assert doc["fill_rows"]["ridge"]["filled_tokens"] + doc["fill_rows"]["ridge"]["outlier_tokens"] == expected
    tally = settings["ridge"]["tally"]
    assert {k: tally[k] for k in doc["fill_rows"]["ridge"]} == doc["fill_rows"]["ridge"]
    assert tally["stock_steps"] == 0 and tally["full_tokens"] == runs * 33 * len(doc["results"]) + \
        tally["outlier_tokens"]


def test_bench_ttft_refuses_timings_of_a_fill_that_filled_nothing():
    from ridgefill.backends.base import check_filled
    from ridgefill.backends.vllm.backend import unfilled_detail

    def check(tally: dict, planned: int) -> None:  # as VllmBackend.check_filled reads the plugin's counters
        check_filled("vLLM", "ridge", tally["filled_tokens"], planned, *unfilled_detail(tally))

    tally = {"filled_tokens": 0, "full_tokens": 600, "stock_steps": 3}
    with pytest.raises(RidgefillError, match="ridge filled none of the 525 prompt rows it should have filled in vLLM "
                                             r"\(600 ran in full, 3 steps ran stock\)"):
        check(tally, 525)
    check(tally, 0)  # nothing to fill (tail over the prompts): nothing to refuse
    check({**tally, "filled_tokens": 1}, 525)


@pytest.mark.parametrize("options, message", [
    ({"engine": "sglang"}, "unknown --engine 'sglang': use one of torchfill, vllm, llamacpp"),
    ({"engine": "vllm", "keep_rows": "3-5"}, "--keep-rows is not supported with --engine vllm: drop it"),
    ({"engine": "vllm", "keep_text": "the"}, "--keep-text is not supported with --engine vllm: drop it"),
    ({"engine": "vllm", "filled_window": 32}, "--filled-window is not supported with --engine vllm: drop it"),
])
def test_generate_engine_errors(options, message, tmp_path):
    """What the vLLM backend lacks (backends/vllm/backend.py's Capabilities) is refused in one line before anything loads."""
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


LOGPROB_TOL = 1e-3  # nats: the agreement of vLLM's first-token log-probs with torchfill (test_vllm_plugin)


def test_loss_in_vllm_equals_ridgefills_engine(vllm_tiny, tmp_path):
    """`loss --engine vllm` (exact: stock vLLM's prompt log-probs; ridge: the plugin, a request per tail row) scores
    every passage's tail as torchfill does, per passage within the log-prob agreement of the plugin
    tests, and marks the same distant-context tokens; what vLLM filled is the plan's rows."""
    folder, maps = vllm_tiny["llama"]
    options = dict(model=str(folder), maps=maps, data=str(folder.parent / "corpus.txt"), context=320, tail=48,
                   short=64, samples=2, alpha=0.5, beta=8.0)
    ours = command("loss")(out=tmp_path / "own.json", **options)
    theirs = command("loss")(out=tmp_path / "vllm.json", engine="vllm", **options)
    assert theirs["config"]["engine"] == "vllm" and ours["variants"] == theirs["variants"] == ["exact", "identity",
                                                                                                   "ridge"]
    assert theirs["distant_spread"] == ours["distant_spread"]
    for name in ours["variants"]:
        mine, other = ours["results"][name], theirs["results"][name]
        per, theirs_per = mine["per_passage"], other["per_passage"]
        assert per["distant_tokens"] == theirs_per["distant_tokens"]
        for key, counts in (("tail_nll_sum", [47] * 2), ("distant_nll_sum", per["distant_tokens"])):
            found = [abs(a - b) / max(1, n) for a, b, n in zip(per[key], theirs_per[key], counts)]
            print(f"loss {name} {key}: largest per-token gap between the two {max(found):.2e}")
            assert max(found) < LOGPROB_TOL, (name, key, found)
    exact, ridge = (ours["results"][v]["per_passage"]["tail_nll_sum"] for v in ("exact", "ridge"))
    assert max(abs(a - b) for a, b in zip(exact, ridge)) / 47 > 10 * LOGPROB_TOL  # a fill vLLM skipped would show
    assert theirs["fill_rows"]["ridge"]["filled_tokens"] > 0


def test_ruler_in_vllm_equals_ridgefills_engine(vllm_tiny, tmp_path):
    """`ruler --engine vllm` answers RULER samples with stock vLLM (exact) and the plugin (ridge) as ridgefill's own
    engine answers them: the same scores, and greedy answers equal for all but at most one sample per variant (the
    plugin tests' bar for greedy continuations)."""
    folder, maps = vllm_tiny["llama"]
    options = dict(model=str(folder), maps=maps, lengths="1024", tasks="niah_single_1,vt", samples=3, tail=64,
                   max_new_tokens=12, variants="exact,ridge")
    ours = command("ruler")(out=tmp_path / "own.json", **options)
    theirs = command("ruler")(out=tmp_path / "vllm.json", engine="vllm", **options)
    for name in ("exact", "ridge"):
        same = sum(a["predictions"][name] == b["predictions"][name]
                   for a, b in zip(ours["samples"], theirs["samples"]))
        print(f"ruler {name}: {same} of {len(ours['samples'])} greedy answers agree")
        assert same >= len(ours["samples"]) - 1, (name, same)
    # the same rows are to be filled; vLLM serves some of them from its prefix cache (RULER prompts of a task share
    # their start), filled by an earlier request with the same maps
    planned = ours["fill_rows"]["ridge"]["filled_tokens"] + ours["fill_rows"]["ridge"]["outlier_tokens"]
    tally = theirs["engine"]["settings"]["ridge"]["tally"]
    served = tally["filled_tokens"] + tally["outlier_tokens"]
    assert theirs["fill_rows"]["ridge"]["filled_tokens"] == tally["filled_tokens"] > 0
    assert served <= planned <= served + tally["cached_prompt_tokens"], (tally, planned)
