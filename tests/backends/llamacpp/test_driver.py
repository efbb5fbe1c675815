"""The fill inside llama.cpp (driver.py + ridgefill.patch) against llama.cpp's own full runs and ridgefill's own
runner: exactness when nothing is filled, the filled cache equal to the fill, the families, and the driver's
refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_gguf
from ridgefill.backends.llamacpp.driver import LlamaCpp, Maps
from ridgefill.backends.llamacpp.maps import maps_of
from ridgefill.torchfill import Runner, IdentityFiller, MapFiller, MeanFiller, adapter_for
from ridgefill.torchfill.fill_plan import FillPlan

MISSING = tiny_gguf.missing_build()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}")

FAMILIES = ["llama", "qwen2", "qwen3"]
N, SPLIT, TAIL = 40, 3, 8  # tiny models: 6 layers


def ids(n=N, seed=1, vocab=120):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def full_rows(n, tail, keep_first=1):
    return [p < keep_first or p >= n - tail for p in range(n)]


def open_tiny(path, **kw):
    return LlamaCpp(path, n_ctx=128, threads=1, n_batch=kw.pop("n_batch", 64), n_ubatch=kw.pop("n_ubatch", 16), **kw)


def llama_k(k: np.ndarray, family: str, heads: int, n: int) -> torch.Tensor:
    """llama.cpp's K rows [n, Hkv·D] as torchfill holds them [Hkv, n, D] (Llama's rows unpermuted)."""
    if family == "llama":
        k = tiny_gguf.unpermute_rows(k, heads)
    return torch.from_numpy(np.ascontiguousarray(k)).view(n, heads, -1).transpose(0, 1)


def cache_gap(lc, cache, family, heads, layers):
    """Largest |llama.cpp − torchfill| over K and V of each layer: [layers]."""
    _, ks, vs = lc.kv_rows()
    n = ks[0].shape[0]
    return [max((llama_k(ks[l], family, heads, n) - cache.layers[l].keys[0]).abs().max().item(),
                (llama_k(vs[l], "v", heads, n) - cache.layers[l].values[0]).abs().max().item())
            for l in range(layers)]


def bounds(exact_gaps, floor=1e-6):
    """Per layer, the bound of a filled cache's gap to torchfill: twice that layer's gap on exact rows (the F16
    cache and llama.cpp's matmul), with a floor for layers that agree to the last bit."""
    return [2 * g + floor for g in exact_gaps]


def within(gaps, limit) -> bool:
    return all(g <= b for g, b in zip(gaps, limit))


def random_maps(split, layers, hidden, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    m = layers - split - 1
    w = torch.eye(hidden).expand(m, hidden, hidden) + scale * torch.randn(m, hidden, hidden, generator=g)
    return w.contiguous(), scale * torch.randn(m, hidden, generator=g)


# --- exactness ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_fill_off_is_bit_identical_after_filled_runs(tiny_ggufs, family):
    """A context that filled prompts before (maps set, filled graphs built) gives, with the fill off or a tail as
    long as the prompt, the same logits to the last bit as a context that never entered fill mode: the graph-reuse
    check tells a filled ubatch's graph from a full one's."""
    _, path = tiny_ggufs[family]
    prompt = ids()
    rows = list(range(N - TAIL, N))
    with open_tiny(path) as stock:
        want = stock.prefill(prompt, outputs=rows).logits
        want_tokens = stock.greedy(want[-1], 6)
    with open_tiny(path) as lc:  # ubatches of 16 rows
        lc.set_maps(Maps(SPLIT))
        filled = lc.prefill(prompt, full=full_rows(N, TAIL), outputs=rows)
        assert filled.filled == N - TAIL - 1 and not torch.equal(filled.logits, want)
        for full in (None, full_rows(N, N)):  # fill off; a tail of the whole prompt
            # the last graph built is a filled ubatch of 16 rows, none of them output, as the next full one is
            assert lc.prefill(prompt[:17], full=[True] + [False] * 16).filled == 16
            got = lc.prefill(prompt, full=full, outputs=rows)
            assert got.filled == 0 and torch.equal(got.logits, want)
        assert lc.greedy(got.logits[-1], 6) == want_tokens


def test_same_tokens_as_stock_llama_cpp_python(tiny_ggufs):
    """The patched build's exact path gives the tokens of llama-cpp-python's own high-level Llama (greedy) on the
    embedded GGUF."""
    from llama_cpp import Llama

    path = tiny_gguf.embedded_gguf()
    prompt = ids(48, seed=3, vocab=40000)
    with LlamaCpp(path, n_ctx=128, threads=2) as lc:
        ours = lc.greedy(lc.prefill(prompt, outputs=[len(prompt) - 1]).logits[-1], 6)
    llm = Llama(str(path), n_ctx=128, n_threads=2, n_gpu_layers=0, flash_attn=True, verbose=False)
    try:
        theirs = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            theirs.append(tok)
            if len(theirs) == 6:
                break
    finally:
        llm.close()
    assert ours == theirs


# --- the filled cache is the fill ------------------------------------------------------------------------------
def fillers(split, layers, hidden):
    w, b = random_maps(split, layers, hidden)
    return {"identity": IdentityFiller(split, layers), "maps": MapFiller(split, layers, w, b)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["identity", "maps", "low_rank", "mean", "key_scale"])
def test_filled_cache_is_the_fill(tiny_ggufs, family, kind):
    """The K/V llama.cpp writes for filled rows equal torchfill's filled K/V (the same maps, positions and
    weights) within the gap llama.cpp already has on exact rows (its F16 cache, its matmul); a wrong map does not."""
    model, path = tiny_ggufs[family]
    cfg = model.config
    layers, hidden, heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads
    runner = Runner(adapter_for(model))
    prompt = ids()
    with open_tiny(path) as lc, torch.no_grad():
        exact = runner.prefill(torch.tensor([prompt]))
        lc.prefill(prompt)
        bound = bounds(cache_gap(lc, exact.cache, family, heads, layers))

        w, b = random_maps(SPLIT, layers, hidden)
        if kind == "identity":
            filler = IdentityFiller(SPLIT, layers)
        elif kind == "maps":
            filler = MapFiller(SPLIT, layers, w, b)
        elif kind == "mean":  # the mean control: every filled row's late input is a constant
            filler = MeanFiller(SPLIT, layers, b + 1.0)
        elif kind == "key_scale":  # maps with a key-scale correction per late layer and KV head
            g = torch.Generator().manual_seed(6)
            filler = MapFiller(SPLIT, layers, w, b, key_scale=0.5 + torch.rand(layers - SPLIT, heads, generator=g))
        else:
            g = torch.Generator().manual_seed(5)
            m = layers - SPLIT - 1
            low = (0.1 * torch.randn(m, hidden, 4, generator=g), 0.1 * torch.randn(m, 4, hidden, generator=g))
            filler = MapFiller(SPLIT, layers, None, b, low)
        plan = FillPlan(filler, tail=TAIL, keep_first=1)
        want = runner.prefill(torch.tensor([prompt]), fill=plan)
        assert want.n_filled == N - TAIL - 1
        lc.set_maps(maps_of(filler))
        got = lc.prefill(prompt, full=full_rows(N, TAIL))
        assert got.filled == want.n_filled
        gaps = cache_gap(lc, want.cache, family, heads, layers)
        assert within(gaps, bound), (gaps, bound)

        if kind in ("maps", "low_rank", "key_scale"):  # a wrong map: another bias
            lc.set_maps(maps_of(MapFiller(SPLIT, layers, None if kind == "low_rank" else w, b + 0.5,
                                          low if kind == "low_rank" else None, filler.key_scale)))
            lc.prefill(prompt, full=full_rows(N, TAIL))
            wrong = cache_gap(lc, want.cache, family, heads, layers)
            assert all(g > 10 * c for g, c in zip(wrong[SPLIT + 1:], bound[SPLIT + 1:]))
            assert within(wrong[:SPLIT + 1], bound[:SPLIT + 1])


@pytest.mark.parametrize("family", FAMILIES)
def test_filled_cache_without_flash_attention(tiny_ggufs, family):
    """Flash attention off: llama.cpp stores V transposed, and the filled rows' V goes there too (per layer, within
    the exact rows' gap of the same context)."""
    model, path = tiny_ggufs[family]
    cfg = model.config
    layers, hidden, heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads
    runner = Runner(adapter_for(model))
    prompt = ids()
    filler = MapFiller(SPLIT, layers, *random_maps(SPLIT, layers, hidden))
    with open_tiny(path, flash_attn=False) as lc, torch.no_grad():
        lc.prefill(prompt)
        bound = bounds(cache_gap(lc, runner.prefill(torch.tensor([prompt])).cache, family, heads, layers))
        want = runner.prefill(torch.tensor([prompt]), fill=FillPlan(filler, tail=TAIL, keep_first=1))
        lc.set_maps(maps_of(filler))
        assert lc.prefill(prompt, full=full_rows(N, TAIL)).filled == want.n_filled
        gaps = cache_gap(lc, want.cache, family, heads, layers)
        assert within(gaps, bound), (gaps, bound)


def test_filled_cache_with_llama3_rope_scaling(tmp_path):
    """A Llama-3 GGUF carries its rope scaling as `rope_freqs` (frequency divisors): the filled rows' keys are
    rotated with them, as torchfill's llama3 rope does (exact rows first, to show the file is right)."""
    model, path = tiny_gguf.build("llama", tmp_path / "tiny-llama3.gguf", rope=tiny_gguf.LLAMA3_ROPE)
    cfg = model.config
    layers, hidden, heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads
    runner = Runner(adapter_for(model))
    prompt = ids(100)  # past original_max_position_embeddings (64), where the scaling matters
    filler = MapFiller(SPLIT, layers, *random_maps(SPLIT, layers, hidden))
    with open_tiny(path) as lc, torch.no_grad():
        lc.prefill(prompt)
        exact_gaps = cache_gap(lc, runner.prefill(torch.tensor([prompt])).cache, "llama", heads, layers)
        assert max(exact_gaps) < 1e-2, exact_gaps
        want = runner.prefill(torch.tensor([prompt]), fill=FillPlan(filler, tail=TAIL, keep_first=1))
        lc.set_maps(maps_of(filler))
        assert lc.prefill(prompt, full=full_rows(100, TAIL)).filled == want.n_filled == 100 - TAIL - 1
        gaps = cache_gap(lc, want.cache, "llama", heads, layers)
        assert within(gaps, bounds(exact_gaps)), (gaps, exact_gaps)


def test_new_maps_between_filled_prefills(tiny_ggufs):
    """Maps of the same shapes set between two filled prefills with no full ubatch between them (no keep-first
    row): the second prefill's graph is built for the new maps, not reused from the first, and its cache is the
    cache a fresh context makes with them, to the last bit."""
    model, path = tiny_ggufs["qwen2"]
    cfg = model.config
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    prompt = ids(32)
    first = maps_of(MapFiller(SPLIT, layers, *random_maps(SPLIT, layers, hidden, seed=1)))
    second = maps_of(MapFiller(SPLIT, layers, *random_maps(SPLIT, layers, hidden, seed=2)))
    with open_tiny(path) as fresh:
        fresh.set_maps(second)
        assert fresh.prefill(prompt, full=[False] * 32).filled == 32
        _, want_k, want_v = fresh.kv_rows()
    with open_tiny(path) as lc:
        lc.set_maps(first)
        assert lc.prefill(prompt, full=[False] * 32).filled == 32
        _, first_k, _ = lc.kv_rows()
        lc.set_maps(second)
        assert lc.prefill(prompt, full=[False] * 32).filled == 32
        _, got_k, got_v = lc.kv_rows()
    assert not np.array_equal(first_k[-1], want_k[-1])  # the two maps fill differently
    for layer in range(layers):
        assert np.array_equal(got_k[layer], want_k[layer]) and np.array_equal(got_v[layer], want_v[layer]), layer


@pytest.mark.parametrize("family", FAMILIES)
def test_filled_logits_follow_the_fill(tiny_ggufs, family):
    """The tail's logits after a filled prefill (the tail attends to the filled rows' cache in every late layer)
    are torchfill's within the exact rows' gap; also with ubatches smaller than a run and the runs split
    over several llama_decode calls."""
    model, path = tiny_ggufs[family]
    runner = Runner(adapter_for(model))
    prompt = ids()
    rows = list(range(N - TAIL, N))
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    w, b = random_maps(SPLIT, layers, hidden)
    filler = MapFiller(SPLIT, layers, w, b)
    with torch.no_grad():
        exact = runner.prefill(torch.tensor([prompt]), logits_at=rows).logits[0]
        want = runner.prefill(torch.tensor([prompt]), fill=FillPlan(filler, tail=TAIL, keep_first=1),
                              logits_at=rows).logits[0]
    for n_batch, n_ubatch in ((64, 16), (7, 3)):
        with open_tiny(path, n_batch=n_batch, n_ubatch=n_ubatch) as lc:
            gap = (lc.prefill(prompt, outputs=rows).logits - exact).abs().max().item()
            lc.set_maps(maps_of(filler))
            got = lc.prefill(prompt, full=full_rows(N, TAIL), outputs=rows)
            assert (got.logits - want).abs().max().item() <= 2 * gap + 1e-5
            assert (got.logits - exact).abs().max().item() > 2 * gap  # the fill changed them


def test_outliers_run_in_full(tiny_ggufs):
    """A filled row whose split-state norm exceeds factor × its chunk's median runs in full, as in torchfill:
    the same rows are promoted and the cache is torchfill's."""
    model, path = tiny_ggufs["llama"]
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    runner = Runner(adapter_for(model), chunk=16)
    prompt = ids()
    filler = IdentityFiller(SPLIT, layers)
    with open_tiny(path) as lc, torch.no_grad():
        lc.set_maps(maps_of(filler))
        lc.prefill(prompt, full=full_rows(N, TAIL), chunk=16)
        # a factor just below the largest ratio to the median of the first chunk's filled rows: one outlier there
        first = torch.tensor(lc.rows_ran(1, 16)[1])
        factor = float((first.max() / first.median()) * 0.999)
        plan = FillPlan(filler, tail=TAIL, keep_first=1, outlier_factor=factor)
        want = runner.prefill(torch.tensor([prompt]), fill=plan)
        got = lc.prefill(prompt, full=full_rows(N, TAIL), outlier_factor=factor, chunk=16)
        assert got.outliers == want.n_outliers >= 1 and got.filled == want.n_filled
        gaps = cache_gap(lc, want.cache, "llama", heads, layers)
        lc.prefill(prompt)
        bound = bounds(cache_gap(lc, runner.prefill(torch.tensor([prompt])).cache, "llama", heads, layers))
        assert within(gaps, bound), (gaps, bound)


def test_embedded_filled_cache_within_the_quantized_gap():
    """On the embedded Q4_1 GGUF against torchfill on its fp32 conversion: the gap llama.cpp's quantized
    matmul makes on exact rows (measured here, every layer) bounds the gap of its filled rows to torchfill's
    filled rows (identity fill, split 15 of 30); wrong maps (zero) exceed it."""
    from ridgefill.runtime.models import load_model

    model = load_model("smollm2-135m").model
    cfg = model.config
    layers, heads, n, split, tail = cfg.num_hidden_layers, cfg.num_key_value_heads, 64, 15, 16
    prompt = ids(n, seed=4, vocab=40000)
    runner = Runner(adapter_for(model))
    full = full_rows(n, tail)
    filler = IdentityFiller(split, layers)
    with LlamaCpp(tiny_gguf.embedded_gguf(), n_ctx=256, threads=2) as lc, torch.no_grad():
        lc.prefill(prompt)
        exact_gap = max(cache_gap(lc, runner.prefill(torch.tensor([prompt])).cache, "llama", heads, layers))
        want = runner.prefill(torch.tensor([prompt]), fill=FillPlan(filler, tail=tail, keep_first=1)).cache
        lc.set_maps(maps_of(filler))
        assert lc.prefill(prompt, full=full).filled == n - tail - 1
        assert max(cache_gap(lc, want, "llama", heads, layers)) <= 1.5 * exact_gap
        m, h = layers - split - 1, cfg.hidden_size
        lc.set_maps(Maps(split, w=np.zeros((m, h, h), np.float32), b=np.zeros((m, h), np.float32)))  # wrong maps
        lc.prefill(prompt, full=full)
        assert max(cache_gap(lc, want, "llama", heads, layers)[split + 1:]) > 1.5 * exact_gap
