"""The patch's C API refuses what it cannot serve, and the fill proves itself: every refusal is a code llama.cpp
returns before it touches the cache, turned by the driver into one line (whole messages); the rows llama.cpp
reports filled are the rows the plan fills; the filled graph holds no attention, output projection or FFN of the
late layers."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

import tiny_gguf
from helpers import run_captured
from ridgefill.backends.llamacpp import driver, library
from ridgefill.backends.llamacpp.driver import LlamaCpp, Maps
from ridgefill.errors import RidgefillError

MISSING = tiny_gguf.missing_build()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}")

N, SPLIT, TAIL, LAYERS, H, HKV = 40, 3, 8, 6, 64, 2


def ids(n=N, seed=1):
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_rows(n=N, tail=TAIL):
    return [p < 1 or p >= n - tail for p in range(n)]


def open_tiny(path, **kw):
    return LlamaCpp(path, n_ctx=128, threads=1, n_batch=64, n_ubatch=16, **kw)


def maps(split=SPLIT, layers=LAYERS, h=H, hkv=HKV, seed=0):
    """Full-rank maps with a key scale for a model of `layers` layers, width h and hkv KV heads."""
    g = np.random.default_rng(seed)
    m = layers - split - 1
    w = (np.eye(h) + 0.05 * g.standard_normal((m, h, h))).astype(np.float32)
    return Maps(split, w=w, b=(0.05 * g.standard_normal((m, h))).astype(np.float32),
                key_scale=(0.5 + g.random((layers - split, hkv))).astype(np.float32))


# --- set_maps checks the number and shapes of the maps against the model ---------------------------------------
@pytest.mark.parametrize("field, value, why", [
    ("n_layers", 7, "their number is not that of this model's layers after the split"),
    ("n_embd", 32, "their width is not this model's"),
    ("n_head_kv", 4, "their key scale's KV heads are not this model's"),
])
def test_set_maps_checks_the_shapes_in_llama_cpp(tiny_ggufs, field, value, why):
    """Maps whose arrays agree with a wrong idea of the model (here the driver's own numbers changed, so its
    Python check passes) are refused by llama.cpp itself, which reads n_maps, n_embd and n_head_kv from the call."""
    _, path = tiny_ggufs["llama"]
    with open_tiny(path) as lc:
        setattr(lc, field, value)
        with pytest.raises(RidgefillError) as err:
            lc.set_maps(maps(layers=lc.n_layers, h=lc.n_embd, hkv=lc.n_head_kv))
        assert str(err.value) == f"llama.cpp refused the maps of split {SPLIT}: {why}: fit maps for this model"


def test_set_maps_codes(tiny_ggufs):
    """The C function's own codes for a call that skips the driver (LLAMA_RIDGEFILL_ERR_*), and the maps kept
    unchanged after a refused call."""
    _, path = tiny_ggufs["qwen2"]
    with open_tiny(path) as lc:
        good = maps()
        lc.set_maps(good)
        before = lc.prefill(ids(), full=full_rows(), outputs=[N - 1]).logits
        f32 = ctypes.POINTER(ctypes.c_float)
        w, b = good.w.ctypes.data_as(f32), good.b.ctypes.data_as(f32)
        set_maps = lc.lib.llama_ridgefill_set_maps
        assert set_maps(lc.ctx, SPLIT, 3, H, 0, HKV, w, None, None, b, None) == -4
        assert set_maps(lc.ctx, SPLIT, 2, 32, 0, HKV, w, None, None, b, None) == -5
        assert set_maps(lc.ctx, SPLIT, 2, H, 0, 3, w, None, None, b, None) == -6
        assert set_maps(lc.ctx, SPLIT, 2, H, 0, HKV, w, None, None, None, None) == -1  # weights without a bias
        assert set_maps(lc.ctx, 0, 4, H, 0, HKV, None, None, None, None, None) == -1
        assert torch.equal(lc.prefill(ids(), full=full_rows(), outputs=[N - 1]).logits, before)


# --- llama_decode in fill mode refuses what a filled ubatch cannot serve ------------------------------------------
def test_logits_of_a_filled_row(tiny_ggufs):
    _, path = tiny_ggufs["qwen3"]
    with open_tiny(path) as lc:
        lc.set_maps(Maps(SPLIT))
        with pytest.raises(RidgefillError) as err:
            lc.prefill(ids(), full=full_rows(), outputs=[5, N - 1])
        assert str(err.value) == "a row of a filled run asks for logits: logits come only from rows that run in full"
        assert lc.prefill(ids(), full=full_rows(), outputs=[N - 1]).filled == N - TAIL - 1  # the context still works


def test_an_embeddings_context(tiny_ggufs):
    _, path = tiny_ggufs["llama"]
    with open_tiny(path) as lc:
        lc.set_maps(Maps(SPLIT))
        lc.ll.llama_set_embeddings(lc.ctx, True)
        with pytest.raises(RidgefillError) as err:
            lc.prefill(ids(), full=full_rows())
        assert str(err.value) == "llama.cpp fills no rows of an embeddings context: use a generation context"
        lc.ll.llama_set_embeddings(lc.ctx, False)  # fill mode entered first, embeddings turned on after it
        assert lc.lib.llama_ridgefill_set_fill(lc.ctx, True) == 0
        lc.ll.llama_set_embeddings(lc.ctx, True)
        b = lc.batch
        for i in range(4):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = 5 + i, i, 1, False
            b.seq_id[i][0] = 0
        b.n_tokens = 4
        assert lc.ll.llama_decode(lc.ctx, b) == -21
        lc.lib.llama_ridgefill_set_fill(lc.ctx, False)


def test_a_batch_of_several_sequences(tiny_ggufs):
    """A filled batch holding rows of two sequences is refused (its norms would be recorded without their
    sequence), in a context of two sequences; one sequence per batch is filled."""
    _, path = tiny_ggufs["llama"]
    with open_tiny(path) as lc:
        ll, lib = lc.ll, lc.lib
        cparams = ll.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 128, 64, 16, 2
        cparams.n_threads = cparams.n_threads_batch = 1
        ctx = ll.llama_init_from_model(lc.model, cparams)
        batch = ll.llama_batch_init(16, 0, 2)
        try:
            m = maps()
            f32 = ctypes.POINTER(ctypes.c_float)
            args = [m.w.ctypes.data_as(f32), None, None, m.b.ctypes.data_as(f32), m.key_scale.ctypes.data_as(f32)]
            assert lib.llama_ridgefill_set_maps(ctx, SPLIT, 2, H, 0, HKV, *args) == 0
            assert lib.llama_ridgefill_set_fill(ctx, True) == 0

            def decode(seqs):
                for i, seq in enumerate(seqs):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 5 + i, i, 1, False
                    batch.seq_id[i][0] = seq
                batch.n_tokens = len(seqs)
                return ll.llama_decode(ctx, batch)

            assert decode([0, 0, 1, 1]) == -22
            assert lib.llama_ridgefill_n_norms(ctx) == 0
            assert decode([1, 1, 1, 1]) == 0 and lib.llama_ridgefill_n_norms(ctx) == 4
        finally:
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)
    assert driver.DECODE_REFUSALS[-22] == ("a filled run holds rows of several sequences: fill one sequence per "
                                           "llama_decode")


# --- the fill proves itself ------------------------------------------------------------------------------------------
def test_rows_llama_cpp_did_not_fill_are_refused(tiny_ggufs, monkeypatch):
    """A graph without the fill hook computes the rows in full and records no norms: llama.cpp's plan refuses
    (LLAMA_RIDGEFILL_ERR_FILLED) and the driver says so in one line naming the architecture, instead of timing exact
    prefill as filled. The plan's check itself runs in every filled prefill (the C side); here the library answers
    as a build without the hook would."""
    _, path = tiny_ggufs["qwen2"]
    with open_tiny(path) as lc:
        lc.set_maps(Maps(SPLIT))
        assert lc.prefill(ids(), full=full_rows()).filled == N - TAIL - 1  # llama.cpp's own count
        monkeypatch.setattr(lc, "lib", NoFill(lc.lib))
        for factor in (0.0, 3.0):
            with pytest.raises(RidgefillError) as err:
                lc.prefill(ids(), full=full_rows(), outlier_factor=factor)
            assert str(err.value) == ("llama.cpp did not fill the rows its plan fills from position 0: its qwen2 "
                                      "graph does not run ridgefill's fill; use --engine torchfill for this model")


class NoFill:
    """The patched library as a build without a family's fill hook answers: its plan finds no filled row recorded."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    @staticmethod
    def llama_ridgefill_prefill(*args):
        return driver.ERR_FILLED


def test_the_filled_graph_computes_no_late_layer(tiny_ggufs):
    """In a filled ubatch the layers from the split on compute their input norm, K/V projection and RoPE only: no
    query, attention, output projection, FFN, layer output or logits. Counted two ways on the nodes llama.cpp's
    graph callback sees: their ops (attention and matmuls) and their names (`name-layer`)."""
    from llama_cpp._ggml import libggml
    import llama_cpp.llama_cpp as ll

    for fn in (libggml.ggml_get_name, libggml.ggml_op_desc):
        fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_char_p
    seen: list[tuple[str, str]] = []

    def observe(tensor, ask, user_data):
        if ask:
            seen.append((libggml.ggml_get_name(tensor).decode(), libggml.ggml_op_desc(tensor).decode()))
        return True

    callback = ll.ggml_backend_sched_eval_callback(observe)
    _, path = tiny_ggufs["llama"]
    with open_tiny(path, eval_callback=callback) as lc:
        lc.set_maps(maps())
        lc.prefill(ids()[:16], outputs=[15])  # one full ubatch
        full = list(seen)
        seen.clear()
        lc.clear()
        assert lc.prefill(ids()[:16], full=driver.Rows(0, 0), chunk=16).filled == 16  # one filled ubatch
        filled = list(seen)

    def count(nodes, op):
        return sum(1 for _, o in nodes if o == op)

    # attention: one per layer in a full graph, one per layer below the split in a filled one
    assert count(full, "FLASH_ATTN_EXT") == LAYERS and count(filled, "FLASH_ATTN_EXT") == SPLIT
    # matmuls: Q, K, V, output and 3 FFN projections per layer (and the logits) in full; below the split the same,
    # then per late layer its K and V projections and the map (none at the split itself)
    assert count(full, "MUL_MAT") == 7 * LAYERS + 1
    assert count(filled, "MUL_MAT") == 7 * SPLIT + 2 * (LAYERS - SPLIT) + (LAYERS - SPLIT - 1)
    late = {(m.group(1), int(m.group(2))) for n, _ in filled if (m := re.fullmatch(r"(.+)-(\d+)", n)) and
            int(m.group(2)) >= SPLIT}
    names = {name for name, _ in late}
    assert {"ridgefill_inp", "ridgefill_k", "ridgefill_v", "norm"} <= names, names
    assert {layer for _, layer in late} == set(range(SPLIT, LAYERS))
    forbidden = {"Qcur", "kqv_out", "attn_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out",
                 "l_out"}
    assert not names & forbidden, names & forbidden
    assert forbidden <= {re.sub(r"-\d+$", "", n) for n, _ in full}  # the names a full graph gives them
    assert not {"result_norm", "result_output"} & {n for n, _ in filled}


# --- what the build is and where it runs ------------------------------------------------------------------------
def test_the_build_names_itself():
    info = library.build_info()
    assert info["llama_cpp_python"] == library.VERSION and info["patch"] == library.patch_id()
    lib = library.load()[1]
    assert tuple(info["cpu_features"]) == library.build_features(lib)
    assert set(info["cpu_features"]) <= set(library.cpu_features(lib))  # it runs here, so this CPU has them all
    assert "avx2" in library.cpu_features(lib) or "avx2" not in info["cpu_features"]


def test_a_build_for_another_cpu_is_refused_at_start(tiny_ggufs, capfd, monkeypatch, tmp_path):
    """`ridgefill generate --engine llamacpp` with a build that needs an instruction set this CPU lacks: one line,
    exit 2, before llama.cpp computes anything (a SIGILL otherwise)."""
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "cache"))
    lib = library.load()[1]
    needed = library.build_features(lib)
    if not needed:
        pytest.skip("this build needs no instruction set beyond x86-64's")
    monkeypatch.setattr(library, "cpu_features", lambda lib: needed[:-1])
    _, path = tiny_ggufs["llama"]
    done = run_captured(["generate", "--engine", "llamacpp", "--model", path, "--prompt", "hello", "--split", "3",
                         "--tail", "8", "--max-new-tokens", "2"], capfd, monkeypatch)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.strip() == (
        f"error: the installed llama-cpp-python was built for a CPU with {needed[-1]}, which this CPU lacks: run "
        "`make install` (it builds llama.cpp for the CPU it runs on)")
