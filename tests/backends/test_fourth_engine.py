"""What engines share, seen from outside the seam: a fourth engine (tests/backends/fourth_engine/: its folder and one
line in the registry, backends.ENGINES) runs generate, bench-ttft, ruler and loss; and the JSON of `bench-ttft` and
of `generate --compare` has the same keys whichever engine ran, the engine a value (`engine`: name, build,
settings), never part of a key's name.

The key comparison runs torchfill for real against stand-ins of vLLM and llama.cpp (the fourth engine
under their name, capabilities and settings: the documents are built by the same code, evals/common.engine_record
and bench-ttft's entries, from each backend's capabilities and describe output), and against the real engines where
they are installed (skipped with the reason where not)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from ridgefill import backends
from ridgefill.commands import command
from ridgefill.errors import RidgefillError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the grass is green and the sky is blue, here we go there and back again " * 3
VARIABLE = (("engine", "settings"), ("engine", "build"), ("computed_by",))  # the engine's own, by their nature


@pytest.fixture
def fourth(monkeypatch):
    monkeypatch.setitem(backends.ENGINES, "fourth", ("fourth_engine.backend", "a test's fourth engine"))
    return backends.backend_class("fourth")


def assert_same_keys(a, b, path=()) -> None:
    """Every object of document `a` has the keys of the same object of `b`, recursively; a null on either side ends
    the comparison there (a value the engine does not give), and VARIABLE's subtrees are the engine's own."""
    if path in VARIABLE or a is None or b is None:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), (".".join(path), sorted(set(a) ^ set(b)))
        for key in a:
            assert_same_keys(a[key], b[key], (*path, key))
    elif isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            assert_same_keys(x, y, (*path, "[]"))


def bench(model: str, engine: str, out, **options) -> dict:
    command("bench-ttft")(model=model, engine=engine, split=2, tail=8, lengths="40,24", repeats=2, warmup=0,
                          data="random", variants="exact,identity", out=out, **options)
    return json.loads(out.read_text())


def generate(model: str, engine: str, out) -> dict:
    texts = command("generate")(model=model, engine=engine, split=2, tail=8, prompt=PROMPT, max_new_tokens=4,
                                compare=True, out=out)
    doc = json.loads(out.read_text())
    assert {name: r["text"] for name, r in doc["results"].items()} == texts
    return doc


# --- a fourth engine ----------------------------------------------------------------------------------------------
def test_a_fourth_engine_runs_generate_bench_ttft_ruler_and_loss(fourth, tiny_checkpoint, long_docs, tmp_path):
    model = str(tiny_checkpoint)
    own, theirs = generate(model, "torchfill", tmp_path / "g0.json"), generate(model, "fourth", tmp_path / "g.json")
    assert theirs["engine"]["name"] == "fourth" and theirs["engine"]["build"] == fourth.provenance()
    started = theirs["results"]["exact"]["prompt_tokens"] + 4  # prompt and new tokens
    assert theirs["engine"]["settings"]["filled"] == {"runs": "torchfill", "max_len": started,
                                                      "fill": True}
    for name in ("exact", "filled"):
        assert theirs["results"][name]["tokens"] == own["results"][name]["tokens"]
        assert theirs["results"][name]["filled_tokens"] == own["results"][name]["filled_tokens"]
        assert theirs["results"][name]["ttft_s"] > 0
    assert theirs["results"]["filled"]["filled_tokens"] > 0

    doc = bench(model, "fourth", tmp_path / "ttft.json")
    assert doc["engine"]["name"] == "fourth" and doc["config"]["engine"] == "fourth"
    for entry in doc["results"]:
        assert entry["timings"]["transformers"] is None and entry["exact_vs_transformers"] is None
        assert entry["timings"]["identity"]["engine_first_token_latency_median_s"] > 0
        assert entry["fill"]["identity"]["filled_rows"] == entry["length"] - 8 - 1
        assert entry["first_token"]["exact"] is not None

    ruler = {engine: command("ruler")(model=model, engine=engine, split=2, tail=16, lengths="256",
                                      tasks="niah_single_1", samples=2, max_new_tokens=4,
                                      out=tmp_path / f"ruler-{engine}.json") for engine in ("torchfill", "fourth")}
    assert ruler["fourth"]["engine"]["name"] == "fourth"
    assert ruler["fourth"]["results"] == ruler["torchfill"]["results"]

    loss = {engine: command("loss")(model=model, engine=engine, split=2, tail=16, data=str(long_docs), context=96,
                                    short=24, samples=2, out=tmp_path / f"loss-{engine}.json")
            for engine in ("torchfill", "fourth")}
    assert loss["fourth"]["engine"]["name"] == "fourth"
    for name, result in loss["torchfill"]["results"].items():
        assert loss["fourth"]["results"][name]["tail_nll"] == pytest.approx(result["tail_nll"], rel=1e-5)


def test_a_fourth_engine_is_refused_what_it_lacks_in_the_one_form(fourth, tiny_checkpoint, tmp_path):
    with pytest.raises(RidgefillError) as err:
        command("generate")(model=str(tiny_checkpoint), engine="fourth", split=2, prompt="hi", keep_rows="1-2")
    assert str(err.value) == "--keep-rows is not supported with --engine fourth: drop it"
    with pytest.raises(RidgefillError) as err:
        command("splice")(model=str(tiny_checkpoint), engine="fourth", split=2, data="wiki-leads", out=tmp_path / "s")
    assert "no option engine" in str(err.value)  # splice and longbench run on torchfill alone


# --- one schema ------------------------------------------------------------------------------------------------------
VLLM_SETTINGS = {"plugin": True, "fill": None, "dtype": "float32", "threads_bind": "0-1", "max_model_len": 48,
                 "max_num_batched_tokens": 512, "enable_chunked_prefill": True, "enforce_eager": False,
                 "enable_prefix_caching": True, "env": {}}
LLAMACPP_SETTINGS = {"gguf": "m.gguf", "llama_cpp_python": "0.3.36", "patch": "0" * 16, "threads": 2, "n_batch": 512,
                     "n_ubatch": 512, "kv_type": "f16", "flash_attn": True, "fill": None}


def stand_in(monkeypatch, name: str, settings: dict):
    """The fourth engine under engine `name`'s name, capabilities (on the CPU in fp32) and settings' form."""
    real = backends.backend_class(name)
    from fourth_engine.backend import FourthBackend

    caps = dataclasses.replace(real.caps, devices=("cpu",), dtypes=("fp32",))
    cls = type(f"StandIn{real.__name__}", (FourthBackend,), {
        "name": name, "title": real.title, "caps": caps,
        "provenance": classmethod(lambda c: {"engine": name, "torch": None, "transformers": None}),
        "describe": lambda self: {v: settings for v in self.plans}})
    monkeypatch.setattr(sys.modules[__name__], "BACKEND", cls, raising=False)
    monkeypatch.setitem(backends.ENGINES, name, (__name__, f"a stand-in of {name}"))
    return cls


@pytest.mark.parametrize("name, settings", [("vllm", VLLM_SETTINGS), ("llamacpp", LLAMACPP_SETTINGS),
                                            ("fourth", None)])
def test_bench_ttft_and_generate_write_the_same_keys_for_every_engine(name, settings, fourth, monkeypatch,
                                                                      tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint)
    own = {"bench": bench(model, "torchfill", tmp_path / "own.json"),
           "generate": generate(model, "torchfill", tmp_path / "own-g.json")}
    if settings is not None:
        stand_in(monkeypatch, name, settings)
    other = {"bench": bench(model, name, tmp_path / "other.json"),
             "generate": generate(model, name, tmp_path / "other-g.json")}
    for kind in own:
        assert own[kind]["engine"]["name"] == "torchfill" and other[kind]["engine"]["name"] == name
        assert not any(key.endswith("_engines") for key in other[kind])
        assert_same_keys(own[kind], other[kind])
        assert_same_keys(other[kind], own[kind])
    for entry in other["bench"]["results"]:  # the engine in no key's name
        for timing in entry["timings"].values():
            assert timing is None or not any(key.startswith(name) for key in timing)


def test_an_engine_in_another_process_describes_the_model_as_torchfill(tiny_checkpoint):
    """vLLM and llama.cpp read the model without its weights (runtime/session.model_facts): the result's `model`
    is what torchfill's loaded model gives."""
    from ridgefill.runtime.session import model_facts, open_session

    assert model_facts(str(tiny_checkpoint)).model_info == open_session(str(tiny_checkpoint)).model_info


def test_the_key_comparison_sees_a_key_one_engine_lacks():
    with pytest.raises(AssertionError):
        assert_same_keys({"a": {"b": 1, "c": 2}}, {"a": {"b": 1}})
    assert_same_keys({"a": None, "engine": {"settings": {"x": 1}}}, {"a": {"b": 1}, "engine": {"settings": {}}})


def real_engine(name: str, request, tmp_path, monkeypatch) -> str:
    """The model the installed engine `name` runs (skipped with the reason where it is not installed)."""
    if name == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed")
        folder, _ = request.getfixturevalue("vllm_tiny")["llama"]
        return str(folder)
    try:
        backends.backend_class("llamacpp").check_installed()
    except RidgefillError as exc:
        pytest.skip(f"llama.cpp with ridgefill's patch is not installed: {exc}")
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "llamacpp"))
    import tiny_gguf

    return str(tiny_gguf.build("llama", tmp_path / "tiny-llama.gguf")[1])


# vLLM's run is the heavy tier's (make test-heavy): its documents' keys are checked against stand-ins above
@pytest.mark.parametrize("name", [pytest.param("vllm", marks=pytest.mark.heavy), "llamacpp"])
def test_the_installed_engines_write_the_same_keys_as_ridgefills(name, request, tmp_path, monkeypatch):
    model = real_engine(name, request, tmp_path, monkeypatch)
    for kind, run in (("bench", bench), ("generate", generate)):
        own, other = run(model, "torchfill", tmp_path / f"{kind}-own.json"), run(model, name, tmp_path / f"{kind}.json")
        assert other["engine"]["name"] == name and other["engine"]["build"] == other["computed_by"]
        assert other["engine"]["settings"]["exact"] and other["engine"]["settings"]["identity" if kind == "bench"
                                                                                     else "filled"]
        assert_same_keys(own, other)
        assert_same_keys(other, own)
