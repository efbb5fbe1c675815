"""Every refusal of the llama.cpp path is one line that names the problem and the fix (whole messages)."""

from __future__ import annotations

import numpy as np
import pytest

import tiny_gguf
from helpers import without_package
from ridgefill.backends.llamacpp import library
from ridgefill.backends.llamacpp.driver import LlamaCpp, Maps
from ridgefill.errors import RidgefillError

MISSING = tiny_gguf.missing_build()
needs_build = pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}")
INSTALL = "run `make install` (it builds llama-cpp-python with ridgefill's patch)"


def test_missing_llama_cpp_python(monkeypatch):
    without_package(monkeypatch, "llama_cpp")
    with pytest.raises(RidgefillError) as err:
        library.check_installed()
    assert str(err.value) == f"llama-cpp-python is not installed: {INSTALL}"


@needs_build
def test_a_missing_dependency_of_llama_cpp_python(monkeypatch):
    """llama-cpp-python installed, one of its own dependencies (diskcache, jinja2) not: named as such."""
    without_package(monkeypatch, "diskcache", forget=("llama_cpp",))
    with pytest.raises(RidgefillError) as err:
        library.check_installed()
    assert str(err.value) == f"llama-cpp-python needs the package diskcache, which is not installed: {INSTALL}"


@needs_build
def test_another_version(monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "__version__", "0.3.99")
    with pytest.raises(RidgefillError) as err:
        library.check_installed()
    assert str(err.value) == f"llama-cpp-python 0.3.99 is installed, ridgefill's patch is written for 0.3.36: {INSTALL}"


@needs_build
def test_another_patch(monkeypatch):
    built = library.patch_id()
    monkeypatch.setattr(library, "patch_id", lambda: "0123456789abcdef")
    with pytest.raises(RidgefillError) as err:
        library.check_installed()
    assert str(err.value) == (f"the installed llama-cpp-python was built with ridgefill patch {built}, this "
                              f"ridgefill has patch 0123456789abcdef: {INSTALL}")


@needs_build
def test_stock_build(monkeypatch):
    import llama_cpp.llama_cpp as ll

    class Stock:  # a library without the patch's functions
        pass

    monkeypatch.setattr(ll, "_lib", Stock())
    with pytest.raises(RidgefillError) as err:
        library.check_installed()
    assert str(err.value) == f"the installed llama-cpp-python 0.3.36 was built without ridgefill's patch: {INSTALL}"


def write_header_only(path, arch: str):
    """A GGUF file with only its architecture (enough for the family check, which reads no weights)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@needs_build
@pytest.mark.parametrize("arch", ["qwen35", "qwen3next", "mamba", "gemma3"])
def test_hybrid_and_other_families(tmp_path, arch):
    path = write_header_only(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(RidgefillError) as err:
        LlamaCpp(path, n_ctx=64, threads=1)
    assert str(err.value) == (f"{path} is a {arch} model: --engine llamacpp fills llama, qwen2, qwen3 models (not "
                              "hybrid or recurrent ones); use --engine torchfill")


@needs_build
def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file")
    with pytest.raises(RidgefillError) as err:
        LlamaCpp(path, n_ctx=64, threads=1)
    assert str(err.value).startswith(f"{path} is not a readable GGUF file (")
    assert str(err.value).endswith("): point --model at a .gguf file or an embedded alias")


@needs_build
def test_quantized_kv_and_gpu_offload(tiny_ggufs):
    _, path = tiny_ggufs["llama"]
    with pytest.raises(RidgefillError) as err:
        LlamaCpp(path, n_ctx=64, threads=1, kv_type="q8_0")
    assert str(err.value) == ("a q8_0 K/V cache is not supported with --engine llamacpp: the fill writes an "
                              "unquantized cache (f16, f32)")
    with pytest.raises(RidgefillError) as err:
        LlamaCpp(path, n_ctx=64, threads=1, gpu_layers=99)
    assert str(err.value) == ("GPU offload (99 layers) is not supported with --engine llamacpp: it runs llama.cpp "
                              "on the CPU")


@needs_build
def test_maps_of_another_shape(tiny_ggufs):
    _, path = tiny_ggufs["qwen2"]
    with LlamaCpp(path, n_ctx=64, threads=1) as lc:
        with pytest.raises(RidgefillError) as err:
            lc.set_maps(Maps(3, w=np.zeros((2, 32, 32), np.float32), b=np.zeros((2, 32), np.float32)))
        assert str(err.value) == ("maps of split 3 hold w of shape [2, 32, 32], not [2, 64, 64], for this 6-layer "
                                  "model of width 64: fit maps for this model")
        with pytest.raises(RidgefillError) as err:
            lc.set_maps(Maps(6))
        assert str(err.value) == "split 6 is outside this model's 1..5: fit maps for this model"
        with pytest.raises(RidgefillError) as err:
            lc.prefill([5, 6, 7], full=[True, False, True])
        assert str(err.value) == "no maps are set for a filled prefill"
