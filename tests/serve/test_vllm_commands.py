"""`generate --engine vllm` and `bench-ttft --engine vllm`: the same options and result documents as ridgefill's
own engine, with stock vLLM as exact and the plugin for fills."""

from __future__ import annotations

import json

import pytest
import torch

from ridgefill.commands import command
from ridgefill.errors import RidgefillError
from ridgefill.runtime.session import open_session
from vllm_fixtures import vllm_tiny  # noqa: F401  (fixture)

pytest.importorskip("vllm")


def test_generate_in_vllm_equals_ridgefills_engine(vllm_tiny, capsys):
    folder, maps = vllm_tiny["qwen2"]
    prompt = " ".join(["the king and the queen walked by the river at night"] * 30)
    options = dict(model=str(folder), maps=maps, tail=32, prompt=prompt, max_new_tokens=12, compare=True)
    ours = command("generate")(**options)
    theirs = command("generate")(**options, engine="vllm")
    assert theirs == ours  # exact (stock vLLM vs ridgefill exact) and filled (plugin vs engine), as text
    err = capsys.readouterr().err
    assert "(vLLM)" in err and "prompt rows filled" in err


def test_bench_ttft_in_vllm_writes_the_same_document(vllm_tiny, tmp_path):
    folder, maps = vllm_tiny["llama"]
    out = tmp_path / "ttft.json"
    doc = command("bench-ttft")(model=str(folder), maps=maps, tail=24, lengths="200,300", repeats=2, warmup=1,
                                data="random", engine="vllm", out=out)
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(doc["results"]))
    assert doc["config"]["engine"] == "vllm" and doc["variants"] == ["exact", "identity", "ridge"]
    engines = doc["vllm_engines"]
    assert engines["exact"]["plugin"] is False and engines["exact"]["fill"] is None
    assert engines["ridge"]["fill"]["tail"] == 24 and engines["ridge"]["enable_prefix_caching"] is False
    session = open_session(str(folder))
    vocab = session.shape.vocab
    from ridgefill.runtime.session import variant_plans

    plans, _ = variant_plans(session, str(maps), None, 24, [0], ("exact", "identity", "ridge"), 20.0)
    runs = 3  # warmup + repeats
    for entry in doc["results"]:
        n = entry["length"]
        assert set(entry["timings"]) == {"exact", "identity", "ridge"}
        assert all(len(t["samples_s"]) == 2 and t["median_s"] > 0 for t in entry["timings"].values())
        for name in ("identity", "ridge"):
            fill = entry["fill"][name]
            assert fill["filled_rows"] == n - 25
            assert fill["limit_speedup"] > 1 and fill["speedup_interval"]["estimate"] == fill["speedup"]
        ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n))  # bench's random prompt
        for name, plan in plans.items():  # vLLM's first token is ridgefill's engine's, for every variant
            want = int(session.engine.prefill(ids, plan).logits[0, -1].argmax())
            assert entry["first_token"][name] == want, (n, name)
    expected = runs * sum(e["length"] - 25 for e in doc["results"])
    assert doc["fill_rows"]["ridge"]["filled_rows"] + doc["fill_rows"]["ridge"]["outlier_rows_run_full"] == expected
    assert engines["ridge"]["tally"] == doc["fill_rows"]["ridge"]


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
