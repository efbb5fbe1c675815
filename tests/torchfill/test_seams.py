"""The runner's seams: what a Filler owns (late inputs, bytes, rank, map FLOPs), the projection's backend and
timer given at construction, what a Runner says about its model, and the one greedy decoder."""

import pytest
import torch

from tiny_models import random_ids, tiny_model
from ridgefill.torchfill import (Runner, FillPlan, IdentityFiller, MapFiller, OracleFiller, Stopwatch, adapter_for,
                                 late_inputs_by_layer)
from ridgefill.torchfill.projection import FillProjection

TOL = 1e-5
H, L, S = 4, 4, 1  # tiny fillers: hidden 4, 4 layers, split 1 -> 2 maps (layers 2, 3)


def tiny_fillers() -> dict:
    g = torch.Generator().manual_seed(0)
    maps = L - S - 1
    bias = torch.randn(maps, H, generator=g)
    hidden = [torch.randn(2, 7, H, generator=g) for _ in range(L + 1)]  # an exact run's layer inputs
    return {
        "identity": IdentityFiller(S, L),
        "full": MapFiller(S, L, torch.randn(maps, H, H, generator=g), bias),
        "rank-1": MapFiller(S, L, None, bias, (torch.randn(maps, H, 1, generator=g),
                                              torch.randn(maps, 1, H, generator=g))),
        "oracle": OracleFiller(S, hidden),
    }


# --- fillers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["identity", "full", "rank-1", "oracle"])
def test_late_inputs_are_x_then_the_predictions(name):
    filler = tiny_fillers()[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, H, generator=g)
    positions = torch.tensor([1, 4, 6])
    y = filler.late_inputs(x, positions)  # [L-S, B*n, H]
    assert y.shape == (L - S, 2 * 3, H)
    assert torch.equal(y[0], x.reshape(6, H))
    predicted = filler.predict(x, positions)  # [B, n, L-S-1, H]
    assert (y[1:] - predicted.permute(2, 0, 1, 3).reshape(L - S - 1, 6, H)).abs().max() <= TOL


@pytest.mark.parametrize("name", ["identity", "full", "rank-1", "oracle"])
def test_late_inputs_by_layer_are_late_inputs_with_or_without_prepared_gemms(name):
    """The serving runner's order (x, then each map as it is asked for) gives late_inputs' rows, whether or not the
    full-rank maps run through prepared per-layer GEMMs (use_gemm; low-rank maps keep their products)."""
    filler = tiny_fillers()[name]
    x, positions = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(2)), torch.tensor([1, 4, 6])
    want = filler.late_inputs(x, positions)  # [L-S, B*n, H]
    if isinstance(filler, MapFiller):
        filler.use_gemm(lambda w, b: (lambda f: torch.nn.functional.linear(f, w, b)))
    got = list(late_inputs_by_layer(filler, x, positions))
    assert len(got) == L - S and all(g.shape == (6, H) for g in got)
    assert torch.equal(got[0], x.reshape(6, H))
    assert max((g - w).abs().max() for g, w in zip(got, want)) <= TOL
    if isinstance(filler, MapFiller):  # the prepared path agrees in late_inputs too
        assert (filler.late_inputs(x, positions) - want).abs().max() <= TOL


def test_prepared_maps_run_one_layer_at_a_time():
    """With prepared GEMMs, map j runs only when layer S+1+j's input is asked for: a filled step never holds every
    late layer's input at once."""
    filler, calls = tiny_fillers()["full"], []

    def make(w, b):
        def gemm(f):
            calls.append(len(calls))
            return torch.nn.functional.linear(f, w, b)
        return gemm

    filler.use_gemm(make)
    stream = late_inputs_by_layer(filler, torch.randn(1, 5, H), torch.arange(5))
    next(stream)  # x itself: no map has run
    assert calls == []
    next(stream)
    assert calls == [0]
    next(stream)
    assert calls == [0, 1]
    assert next(stream, None) is None


def test_identity_late_inputs_are_a_view_of_x():
    x = torch.randn(2, 3, H)
    y = IdentityFiller(S, L).late_inputs(x, torch.arange(3))
    assert y.stride(0) == 0 and y.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("name", ["identity", "full", "rank-1", "oracle"])
def test_a_filler_at_the_last_layer_has_only_x(name):
    """Split L-1: no map, the one late layer gets x."""
    make = {"identity": lambda: IdentityFiller(L - 1, L),
            "full": lambda: MapFiller(L - 1, L, torch.zeros(0, H, H), torch.zeros(0, H)),
            "rank-1": lambda: MapFiller(L - 1, L, None, torch.zeros(0, H), (torch.zeros(0, H, 1),
                                                                           torch.zeros(0, 1, H))),
            "oracle": lambda: OracleFiller(L - 1, [torch.randn(1, 5, H) for _ in range(L + 1)])}
    filler = make[name]()
    x = torch.randn(1, 2, H)
    y = filler.late_inputs(x, torch.tensor([0, 3]))
    assert y.shape == (1, 2, H) and torch.equal(y[0], x[0])
    assert filler.flops_per_row() == 0


def test_rank_bytes_and_map_flops():
    f = tiny_fillers()
    assert [f[n].rank for n in ("identity", "full", "rank-1", "oracle")] == [None, None, 1, None]
    # per filled row and map: full rank x·W = 2·H·H = 32; rank 1: x·U then z·V = 4·H·1 = 16; two maps
    assert [f[n].flops_per_row() for n in ("identity", "full", "rank-1", "oracle")] == [0, 64, 32, 0]
    # float32: full [H, 2H] weights + [2, H] biases; rank 1 [H, 2] U + [2, 1, H] V + biases; oracle [2, 7, 2, H]
    assert f["identity"].nbytes == 0
    assert f["full"].nbytes == 4 * (H * 2 * H + 2 * H)
    assert f["rank-1"].nbytes == 4 * (H * 2 + 2 * H + 2 * H)
    assert f["oracle"].nbytes == 4 * (2 * 7 * 2 * H)
    assert f["full"].to(torch.device("cpu"), torch.float64).nbytes == 8 * (H * 2 * H + 2 * H)


# --- the projection's backend and timer -------------------------------------------------------------
def test_the_timer_adds_up_only_when_given(dense_model):
    adapter = adapter_for(dense_model)
    plain, timer = Runner(adapter), Stopwatch()
    timed = Runner(adapter, timer=timer)
    assert plain.projection.timer is None and timed.projection.timer is timer
    timed.prefill(random_ids(20))  # exact: no filled rows, nothing timed
    assert timer.elapsed_s == 0.0
    plan = FillPlan(IdentityFiller(3, plain.n_layers), tail=4)
    a, b = plain.prefill(random_ids(20), fill=plan), timed.prefill(random_ids(20), fill=plan)
    first = timer.elapsed_s
    assert first > 0 and torch.equal(a.logits, b.logits)
    timed.prefill(random_ids(20), fill=plan)
    assert timer.elapsed_s > first  # accumulates


def test_with_timer_shares_the_stacked_weights(dense_model):
    eng = Runner(adapter_for(dense_model), chunk=8, projection="torch")
    plan = FillPlan(IdentityFiller(2, eng.n_layers), tail=3)
    before = eng.prefill(random_ids(20), fill=plan)
    timer = Stopwatch()
    other = eng.with_timer(timer)
    assert other.projection.stack(2) is eng.projection.stack(2)
    assert other.chunk == 8 and other.projection.backend == "torch" and eng.projection.timer is None
    after = other.prefill(random_ids(20), fill=plan)
    assert timer.elapsed_s > 0 and torch.equal(before.logits, after.logits)


def test_stopwatch_adds_its_spans():
    watch = Stopwatch("cpu")
    with watch.span():
        sum(range(1000))
    first = watch.elapsed_s
    with watch.span():
        sum(range(1000))
    assert 0 < first < watch.elapsed_s


def test_backend_and_what_the_engine_says_about_its_model(dense_model):
    eng = Runner(adapter_for(dense_model))
    assert eng.projection_backend(2) == "torch"  # auto on the CPU
    assert Runner(eng.adapter, projection="layers").projection_backend(2) == "layers"
    assert eng.fused_kv_bytes(2) == eng.projection.stack(2).nbytes > 0
    assert eng.layer_kinds == ["attention"] * 6 and eng.context_length == 512
    assert eng.device == torch.device("cpu") and eng.dtype == torch.float32
    shape = eng.shape
    assert (shape.layers, shape.hidden, shape.vocab, shape.kv_heads, shape.intermediate) == (6, 64, 128, 2, 128)
    assert shape.head_dim == eng.adapter.head_dim and shape.dense
    with pytest.raises(ValueError, match="backend"):
        FillProjection(eng.adapter, "fast")


def test_a_hybrid_engine_has_no_fused_path():
    eng = Runner(adapter_for(tiny_model("qwen3_5")))
    assert eng.layer_kinds == ["linear", "linear", "attention", "linear", "linear", "attention"]
    assert not eng.shape.dense and eng.shape.layer_kinds == tuple(eng.layer_kinds)
    assert eng.projection_backend(1) == "layers" and eng.fused_kv_bytes(1) == 0


# --- the greedy decoder ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return Runner(adapter_for(tiny_model("llama")))


def free_run(runner, ids, n):
    """n greedy tokens of each row, with no end-of-sequence token."""
    return runner.generate(ids, n).tokens


def decode(runner, ids, n, eos=None, stop=None):
    pre = runner.prefill(ids, capacity=ids.shape[1] + n)
    return runner.decode_greedy(pre.cache, pre.logits[:, -1].argmax(-1), n, eos, stop)


def test_decode_greedy_runs_to_max_new_tokens(llama):
    ids = random_ids(10)
    (ref,) = free_run(llama, ids, 12)
    assert len(ref) == 12
    assert decode(llama, ids, 12) == [ref]
    assert decode(llama, ids, 5) == [ref[:5]]
    assert decode(llama, ids, 1) == [ref[:1]]  # the first token counts


def test_decode_greedy_stops_at_eos_and_keeps_it(llama):
    ids = random_ids(10)
    (ref,) = free_run(llama, ids, 12)
    eos = ref[3]
    cut = ref[: ref.index(eos) + 1]
    assert decode(llama, ids, 12, eos) == [cut]
    assert decode(llama, ids, 12, [127, eos]) == [cut]  # any of several
    assert llama.generate(ids, 12, eos_token_id=eos).tokens == [cut]


def test_decode_greedy_stops_when_stop_says_so(llama):
    ids = random_ids(10)
    (ref,) = free_run(llama, ids, 12)
    seen = []

    def stop(tokens):
        seen.append(list(tokens))
        return len(tokens) == 4

    assert decode(llama, ids, 12, stop=stop) == [ref[:4]]
    assert seen == [ref[:k] for k in range(1, 5)]  # asked after each token


def test_decode_greedy_ends_rows_on_their_own(llama):
    ids = random_ids(10, batch=2, seed=5)
    refs = free_run(llama, ids, 10)
    eos = refs[0][2]
    assert eos not in refs[1][:6]  # (seeded: row 1 never produces row 0's end token)
    rows = decode(llama, ids, 6, eos)
    assert rows[0] == refs[0][: refs[0].index(eos) + 1] and rows[1] == refs[1][:6]
