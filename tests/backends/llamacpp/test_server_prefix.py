"""The prefix reuse rule (libllama's llama_ridgefill_reusable, as llama-server's slots use it) on the driver alone
(driver.LlamaCpp.prefill with `reuse`):
after a prompt and a few decode steps, a prompt that shares a prefix with the cache ends with the cache and the logits
a fresh prefill of it gives, whatever the two plans (tails, keep-first), the chunks and the outliers (a low outlier
factor promotes rows per chunk); and a rule that kept the whole shared prefix would not (the test has teeth)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import tiny_gguf

MISSING = tiny_gguf.missing_build()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no patched llama.cpp build: {MISSING}")

H, LAYERS, SPLIT = 64, 6, 3


def maps(seed: int = 0):
    from ridgefill.backends.llamacpp.driver import Maps

    rng = np.random.default_rng(seed)
    m = LAYERS - SPLIT - 1
    w = np.eye(H, dtype=np.float32)[None].repeat(m, 0) + 0.2 * rng.standard_normal((m, H, H), dtype=np.float32) / 8
    return Maps(SPLIT, w=w, b=0.2 * rng.standard_normal((m, H), dtype=np.float32))


def plan(n: int, tail: int, keep_first: int) -> list[bool]:
    return [p < keep_first or p >= n - tail for p in range(n)]


def cases(count: int, seed: int = 5):
    rng = random.Random(seed)
    for _ in range(count):
        a = [rng.randrange(3, 120) for _ in range(rng.randint(60, 140))]
        keep = rng.randint(20, len(a) - 1)
        b = a[:keep] + [rng.randrange(3, 120) for _ in range(rng.randint(1, 60))]
        yield (a, b, rng.randint(1, 40), rng.randint(1, 40), rng.randint(0, 2), rng.randint(0, 2),
               rng.choice([0.0, 1.15, 1.3]), rng.choice([16, 48, 2048]), rng.randint(0, 3))


def served_then_fresh(lc, a, b, tail_a, tail_b, keep_a, keep_b, factor, chunk, steps):
    """(the reused prefill's result, its cache, the fresh prefill's result, its cache)."""
    first = lc.prefill(a, plan(len(a), tail_a, keep_a), [len(a) - 1], factor, chunk)
    cached = list(a)
    logits = first.logits[-1].numpy()
    for _ in range(steps):  # decode steps: rows that ran in full, outside any plan
        token = int(np.argmax(logits))
        logits = lc.step(token)
        cached.append(token)
    common = next((i for i, (x, y) in enumerate(zip(cached, b)) if x != y), min(len(cached), len(b)))
    reused = lc.prefill(b, plan(len(b), tail_b, keep_b), [len(b) - 1], factor, chunk, reuse=common)
    reused_kv = lc.kv_rows()
    fresh = lc.prefill(b, plan(len(b), tail_b, keep_b), [len(b) - 1], factor, chunk)
    return reused, reused_kv, fresh, lc.kv_rows(), common


def gap(kv_a, kv_b) -> float:
    (pos_a, ks_a, vs_a), (pos_b, ks_b, vs_b) = kv_a, kv_b
    order_a, order_b = np.argsort(pos_a), np.argsort(pos_b)
    assert (pos_a[order_a] == pos_b[order_b]).all()
    return max(float(np.abs(x[order_a] - y[order_b]).max()) for x, y in zip(ks_a + vs_a, ks_b + vs_b))


@pytest.fixture(scope="module")
def lc(tiny_ggufs):
    from ridgefill.backends.llamacpp.driver import LlamaCpp

    _, path = tiny_ggufs["llama"]
    with LlamaCpp(path, n_ctx=256, threads=2, n_batch=256) as lc:
        lc.set_maps(maps())
        yield lc


def test_a_shared_prefix_ends_as_a_fresh_prefill_of_the_new_prompt(lc):
    reused_rows = promoted = 0
    for case in cases(40):
        reused, reused_kv, fresh, fresh_kv, common = served_then_fresh(lc, *case)
        assert reused.reused <= min(common, len(case[1]) - 1)
        assert gap(reused_kv, fresh_kv) < 2e-3, case
        # a reused and a fresh prefill run some rows in batches of other shapes (rows kept, outlier rows run again in
        # full beside others or alone), and llama.cpp's results then part in the last bits: at most 5e-4 in the K/V
        # and 2.2e-4 in the logits over these cases (2026-12-06); a wrong rule parts by over 0.05 (the next test)
        assert np.allclose(reused.logits.numpy(), fresh.logits.numpy(), atol=5e-4), case
        assert reused.promoted == [p for p in fresh.promoted if p >= reused.reused], case
        reused_rows += reused.reused
        promoted += len(fresh.promoted)
    assert reused_rows > 500 and promoted > 10, (reused_rows, promoted)  # the cases reuse, and outliers occur


def test_keeping_the_whole_shared_prefix_would_change_the_cache(lc, monkeypatch):
    """The same cases (without outliers) with the rule replaced by 'keep every shared row': some cache differs from a
    fresh prefill's."""
    monkeypatch.setattr(lc, "lib", KeepAll(lc.lib))
    plain = [(*case[:6], 0.0, *case[7:]) for case in cases(40)]
    gaps = [gap(r_kv, f_kv) for r, r_kv, f, f_kv, _ in (served_then_fresh(lc, *case) for case in plain)]
    assert max(gaps) > 0.05, max(gaps)


def test_a_stopped_prefill_raises_and_the_cache_serves_on_after_clear(lc):
    """A server's client that goes away mid-prefill: `stop` is asked before each llama_decode; after Stopped and
    clear(), a prefill gives what it gave before."""
    from ridgefill.backends.llamacpp.driver import Stopped

    a = list(range(3, 103))
    before = lc.prefill(a, plan(len(a), 8, 1), [len(a) - 1], 0.0, 16).logits
    calls = []
    lc.stop = lambda: calls.append(1) or len(calls) > 2
    try:
        with pytest.raises(Stopped):
            lc.prefill(a, plan(len(a), 8, 1), [len(a) - 1], 0.0, 16)
    finally:
        lc.stop = None
    lc.clear()
    assert len(calls) == 3
    assert np.array_equal(lc.prefill(a, plan(len(a), 8, 1), [len(a) - 1], 0.0, 16).logits.numpy(), before.numpy())


class KeepAll:
    """The patched library with llama.cpp's reuse rule replaced by 'keep every shared row'."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def llama_ridgefill_reusable(self, ctx, seq, plan, n, reuse):
        self._lib.llama_ridgefill_reusable(ctx, seq, plan, n, reuse)
        return reuse
