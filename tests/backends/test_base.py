"""The seam (backends/base.py): what a backend lacks is refused from its flags in one line, before any model loads;
the one timing loop; the registry. A fake backend registered for the test stands for an engine that serves little
(as llama.cpp will: no kept rows, no filled window, no lookback)."""

from __future__ import annotations

import sys

import pytest

from ridgefill import backends
from ridgefill.backends.base import Backend, Capabilities, Timed, time_first_tokens
from ridgefill.commands import command
from ridgefill.errors import RidgefillError


class Little(Backend):
    name = "little"
    caps = Capabilities(variants=("identity", "ridge"), devices=("cpu",), dtypes=("fp32",))

    def __init__(self, config=None, projection: str = "auto") -> None:
        super().__init__(config, projection)
        self.calls = []

    def first_token(self, name, prompt, tag):
        self.calls.append((name, tag))
        return Timed(float(len(self.calls)), 7)


BACKEND = Little


@pytest.fixture
def little(monkeypatch):
    monkeypatch.setitem(backends.ENGINES, "little", (__name__, "a test's engine"))
    assert backends.backend_class("little") is Little and sys.modules[__name__].BACKEND is Little


@pytest.mark.parametrize("name, options, message", [
    ("generate", {"keep_rows": "1-2"}, "--keep-rows is not supported with --engine little: drop it"),
    ("generate", {"keep_text": "hi"}, "--keep-text is not supported with --engine little: drop it"),
    ("generate", {"filled_window": 8}, "--filled-window is not supported with --engine little: drop it"),
    ("bench-ttft", {"projection": "layers"}, "--projection is not supported with --engine little: drop it"),
    ("bench-ttft", {"variants": "exact,drop"}, "the drop variant is not supported with --engine little: use exact, "
                                               "identity, ridge"),
    ("ruler", {"variants": "exact,identity,drop"}, "the drop variant is not supported with --engine little: use "
                                                   "exact, identity, ridge"),
    ("ruler", {"dtype": "bf16"}, "--device cpu --dtype bf16 is not supported with --engine little: use a device of "
                                 "cpu and a dtype of fp32"),
    ("loss", {}, "logprobs, which this command needs, is not supported with --engine little: use --engine torchfill"),
])
def test_what_a_backend_lacks_is_refused_in_one_line_from_its_flags(little, name, options, message, tmp_path):
    given = {"prompt": "hi"} if name == "generate" else {"out": tmp_path / "x.json", "data": "wiki-leads"}
    if name != "loss":
        given.pop("data", None)
    with pytest.raises(RidgefillError) as err:
        command(name)(engine="little", split=2, device="cpu", **{**given, **options})
    assert str(err.value) == message
    assert not (tmp_path / "x.json").exists()


def test_an_unknown_engine_names_the_known_ones(tmp_path):
    with pytest.raises(RidgefillError) as err:
        command("loss")(engine="sglang", split=2, data="wiki-leads", out=tmp_path / "x.json")
    assert str(err.value) == "unknown --engine 'sglang': use one of torchfill, vllm, llamacpp"


def test_maps_a_backend_cannot_serve_are_refused_when_the_variants_are_given():
    class Filler:
        lookback, key_scale = 2, None

    plan = type("Plan", (), {"filler": Filler()})()
    with pytest.raises(RidgefillError) as err:
        Little().use({"exact": None, "ridge": object()}, {"exact": None, "ridge": plan})
    assert str(err.value) == ("maps with lookback 2 is not supported with --engine little: use maps fitted without "
                              "--lookback")
    Filler.lookback, Filler.key_scale = 0, object()
    with pytest.raises(RidgefillError, match="^maps with a key-scale correction is not supported with --engine "
                                             "little: use the maps before ridgefill key-scale$"):
        Little().use({"ridge": object()}, {"ridge": plan})


def test_the_timing_loop_warms_up_then_rotates_the_order_each_round():
    backend = Little()
    runs, tokens = time_first_tokens(backend, ["a", "b", "c"], [1, 2, 3, 4], repeats=4, warmup=1,
                                     advance=lambda: None)
    order = [name for name, _ in backend.calls]
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    tags = [tag for _, tag in backend.calls]
    assert tags[:3] == ["ridgefill-bench:4:warmup0"] * 3 and tags[3:6] == ["ridgefill-bench:4:0"] * 3
    assert len(set(tags)) == 5  # one cache salt per round: no timed run hits another's prefix cache
    assert {k: len(v) for k, v in runs.items()} == {"a": 4, "b": 4, "c": 4} and tokens == {"a": 7, "b": 7, "c": 7}
    assert [r.seconds for r in runs["a"]] == [4.0, 9.0, 11.0, 13.0]  # warm-up runs are not kept


def test_an_engine_module_is_imported_only_when_that_engine_is_asked_for():
    """The registry imports an engine's module only when asked: a command on torchfill never imports
    the vLLM backend (nor vLLM)."""
    import subprocess

    code = ("import sys; from ridgefill.commands import command; command('loss').make(out='x', data='d'); "
            "print(sorted(m for m in sys.modules if m.startswith(('ridgefill.backends.', 'vllm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['ridgefill.backends.base', 'ridgefill.backends.torchfill']"
