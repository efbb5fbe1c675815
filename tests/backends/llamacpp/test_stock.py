"""Exactness against stock llama.cpp: the patched build with the fill off, and with a tail as long as the prompt,
gives the logits of stock llama-cpp-python 0.3.36 built with the same flags and no patch (a separate wheel,
`python src/ridgefill/backends/llamacpp/build.py --stock`, run in a process of its own), to the last bit, and the
same greedy tokens. Skipped where that stock wheel is not in the build cache (it takes a CMake build: about 3
minutes on 2 idle cores)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

import tiny_gguf
from ridgefill.backends.llamacpp import build
from ridgefill.backends.llamacpp.driver import LlamaCpp, Maps

MISSING = tiny_gguf.missing_build()
STOCK = build.cached_wheel(patched=False)
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}"),
    pytest.mark.skipif(STOCK is None, reason="no stock llama-cpp-python build in the cache: "
                                             "python src/ridgefill/backends/llamacpp/build.py --stock"),
]

N_CTX, N_BATCH, N_UBATCH, THREADS, NEW = 128, 64, 16, 2, 6

# Stock llama-cpp-python's low-level API, set up as driver.LlamaCpp sets up its context (F16 K/V, flash attention
# on, one sequence), every prompt row's logits, then greedy steps: argv = model, out.npz, token ids...
STOCK_RUN = f"""
import sys
import numpy as np
import llama_cpp.llama_cpp as ll
assert not hasattr(ll._lib, "llama_ridgefill_patch_id"), ll.__file__  # the stock build, not the patched one
path, out, prompt = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3:]]
quiet = ll.llama_log_callback(lambda level, text, data: None)  # kept: llama.cpp calls it later
ll.llama_log_set(quiet, None)
ll.llama_backend_init()
mp = ll.llama_model_default_params()
mp.n_gpu_layers = 0
model = ll.llama_model_load_from_file(path.encode(), mp)
cp = ll.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = {N_CTX}, {N_BATCH}, {N_UBATCH}, 1
cp.n_threads = cp.n_threads_batch = {THREADS}
cp.type_k = cp.type_v = 1  # GGML_TYPE_F16
cp.flash_attn_type = 1
cp.no_perf = True
ctx = ll.llama_init_from_model(model, cp)
vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
batch = ll.llama_batch_init({N_BATCH}, 0, 1)

def decode(tokens, start):
    rows = []
    for lo in range(0, len(tokens), {N_BATCH}):
        part = tokens[lo:lo + {N_BATCH}]
        for i, tok in enumerate(part):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, start + lo + i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(part)
        assert ll.llama_decode(ctx, batch) == 0
        rows += [np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy() for i in range(len(part))]
    return rows

logits = np.stack(decode(prompt, 0))
tokens, last = [], logits[-1]
for _ in range({NEW}):
    tokens.append(int(np.argmax(last)))
    last = decode([tokens[-1]], len(prompt) + len(tokens) - 1)[0]
np.savez(out, logits=logits, tokens=np.array(tokens))
"""


@pytest.fixture(scope="module")
def stock_site(tmp_path_factory):
    """The stock wheel unpacked: a folder that, first on PYTHONPATH, imports the stock llama_cpp."""
    site = tmp_path_factory.mktemp("stock-llama-cpp")
    with zipfile.ZipFile(STOCK) as whl:
        whl.extractall(site)
    for lib in site.rglob("*.so*"):
        lib.chmod(0o755)
    return site


def stock_run(site, path, prompt, tmp_path):
    out = tmp_path / "stock.npz"
    r = subprocess.run([sys.executable, "-c", STOCK_RUN, str(path), str(out), *map(str, prompt)],
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out) as got:
        return torch.from_numpy(got["logits"]), got["tokens"].tolist()


def ids(n, vocab, seed):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("model", ["embedded", "llama", "qwen2", "qwen3"])
def test_fill_off_and_a_whole_prompt_tail_are_stock_llama_cpp_to_the_last_bit(tiny_ggufs, stock_site, model,
                                                                               tmp_path):
    """Every prompt row's logits and 6 greedy tokens: stock llama-cpp-python (built without the patch, the same
    flags) against the patched build with no maps set, and with maps set and every row run in full."""
    path = tiny_gguf.embedded_gguf() if model == "embedded" else tiny_ggufs[model][1]
    prompt = ids(90, 40000 if model == "embedded" else 120, seed=7)  # two n_batch rounds, six ubatches
    want, want_tokens = stock_run(stock_site, path, prompt, tmp_path)
    with LlamaCpp(path, n_ctx=N_CTX, threads=THREADS, n_batch=N_BATCH, n_ubatch=N_UBATCH) as lc:
        rows = list(range(len(prompt)))
        off = lc.prefill(prompt, outputs=rows)
        assert off.filled == 0 and torch.equal(off.logits, want)
        assert lc.greedy(off.logits[-1], NEW) == want_tokens
        lc.set_maps(Maps(lc.n_layers // 2))  # identity maps at the middle split, never used: every row full
        whole = lc.prefill(prompt, full=[True] * len(prompt), outputs=rows)
        assert whole.filled == 0 and torch.equal(whole.logits, want)
