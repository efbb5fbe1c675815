"""The useful split and the frontier points, on hand-made sweeps with known answers."""

from pathlib import Path

import pytest

from ridgefill.pipeline.frontier import Point, frontier, useful_split
from ridgefill.report.results import Result


def ruler(split: int, tail: int, scores: dict, seed: int = 0, region: str = "filled") -> Result:
    doc = {"command": "ruler", "maps": {"split": split}, "seed": seed,
           "config": {"split": None, "tail": tail, "region": region},
           "variants": list(scores), "results": {v: {"score": s} for v, s in scores.items()}}
    return Result(Path(f"ruler-s{split}-t{tail}-seed{seed}.json"), doc)


def loss(split: int, tail: int, distant: dict) -> Result:
    doc = {"command": "loss", "maps": {"split": split}, "seed": 0, "config": {"split": None, "tail": tail},
           "variants": list(distant),
           "results": {v: {"score": d, "distant_nll": d, "tail_nll": d + 1} for v, d in distant.items()}}
    return Result(Path(f"loss-s{split}-t{tail}.json"), doc)


SWEEP = [  # exact scores 90 everywhere; identity drops 30/10/2 points, ridge 6/3/1 (tail 256)
    ruler(10, 256, {"exact": 90.0, "identity": 60.0, "ridge": 84.0}),
    ruler(15, 256, {"exact": 90.0, "identity": 80.0, "ridge": 87.0}),
    ruler(20, 256, {"exact": 90.0, "identity": 88.0, "ridge": 89.0}),
    ruler(10, 1024, {"exact": 90.0, "identity": 70.0, "ridge": 86.0}),
    ruler(10, 256, {"exact": 100.0, "identity": 0.0, "ridge": 0.0}, region="tail"),  # not filled-region: ignored
]


def useful(f, variant, tail):
    return next(p for v, t, p in f.useful if (v, t) == (variant, tail))


def test_useful_split_is_the_smallest_within_tolerance():
    f = frontier(SWEEP, [], [], tolerance=5.0)
    assert useful(f, "identity", 256).split == 20
    assert useful(f, "ridge", 256).split == 15
    assert useful(f, "ridge", 1024).split == 10
    assert useful(f, "identity", 1024) is None
    assert useful(frontier(SWEEP, [], [], tolerance=10.0), "identity", 256).split == 15
    p = useful(f, "ridge", 256)
    assert (p.retrieval, p.retrieval_exact, p.retrieval_drop) == (87.0, 90.0, 3.0)


def test_seeds_are_averaged_before_the_tolerance_test():
    second_seed = ruler(10, 256, {"exact": 90.0, "identity": 60.0, "ridge": 88.0}, seed=1)
    assert useful(frontier(SWEEP + [second_seed], [], [], 5.0), "ridge", 256).split == 10  # mean 86: drop 4


def test_loss_joins_the_points_of_its_split_and_tail():
    f = frontier(SWEEP, [loss(15, 256, {"exact": 2.0, "identity": 2.5, "ridge": 2.1})], [], 5.0)
    p = next(p for p in f.points if (p.variant, p.split, p.tail) == ("ridge", 15, 256))
    assert (p.distant_nll, p.distant_nll_exact, p.retrieval) == (2.1, 2.0, 87.0)
    assert f.splits == [10, 15, 20]


@pytest.mark.parametrize("drops,expected", [([6, 3, 1], 15), ([9, 8, 7], None), ([0, 9, 0], 10)])
def test_useful_split_on_points(drops, expected):
    points = [Point("ridge", s, 256, retrieval=90.0 - d, retrieval_exact=90.0) for s, d in zip((10, 15, 20), drops)]
    found = useful_split(points, 5.0)
    assert (found.split if found else None) == expected


def test_speedups_come_from_the_longest_prompt_bench_ttft_timed():
    def entry(n, identity, ridge):
        return {"length": n, "fill": {"identity": {"speedup": identity, "limit_speedup": identity + 1},
                                      "ridge": {"speedup": ridge, "limit_speedup": ridge + 1}}}

    doc = {"command": "bench-ttft", "split": 15, "maps": {"split": 15}, "seed": 0, "config": {"tail": 256},
           "results": [entry(8192, 1.8, 1.7), entry(1024, 1.1, 1.0)]}
    f = frontier(SWEEP, [], [Result(Path("bench.json"), doc)], 5.0)
    p = {v: next(p for p in f.points if (p.variant, p.split, p.tail) == (v, 15, 256)) for v in ("identity", "ridge")}
    assert (p["ridge"].length, p["ridge"].measured_speedup, p["ridge"].flop_speedup) == (8192, 1.7, 2.7)
    assert (p["identity"].measured_speedup, p["identity"].flop_speedup, p["identity"].retrieval) == (1.8, 2.8, 80.0)


# --- the FLOP-limit speedup without bench-ttft ------------------------------------------------------------
SMOLLM2 = dict(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)


def flop_model(length: int, **extra):
    from ridgefill.torchfill import ModelShape
    from ridgefill.pipeline.frontier import FlopModel

    return FlopModel(ModelShape(**{**SMOLLM2, **extra.pop("shape", {})}), length, **extra)


@pytest.mark.parametrize("length,identity,ridge,rank64", [(1024, 1.52, 1.46, 1.50), (4096, 1.78, 1.71, 1.77),
                                                          (8192, 1.86, 1.80, 1.85)])
def test_flop_limit_speedup_is_counted_from_the_shapes_without_a_bench(length, identity, ridge, rank64):
    """The known answers: docs/performance.md's table for SmolLM2-135M at split 15, tail 256, keep-first 1."""
    f = frontier(SWEEP, [], [], 5.0, flop_model(length))
    p = {v: next(p for p in f.points if (p.variant, p.split, p.tail) == (v, 15, 256)) for v in ("identity", "ridge")}
    assert (round(p["identity"].flop_speedup, 2), round(p["ridge"].flop_speedup, 2)) == (identity, ridge)
    assert p["ridge"].length == length and p["ridge"].measured_speedup is None
    low_rank = frontier(SWEEP, [], [], 5.0, flop_model(length, ranks={15: 64}))
    assert round(next(p.flop_speedup for p in low_rank.points if (p.variant, p.split) == ("ridge", 15)), 2) == rank64


def test_a_bench_result_keeps_its_own_speedups_and_hybrid_models_get_no_count():
    doc = {"command": "bench-ttft", "split": 15, "maps": {"split": 15}, "seed": 0, "config": {"tail": 256},
           "results": [{"length": 8192, "fill": {"ridge": {"speedup": 1.7, "limit_speedup": 2.7}}}]}
    f = frontier(SWEEP, [], [Result(Path("bench.json"), doc)], 5.0, flop_model(1024))
    timed = next(p for p in f.points if (p.variant, p.split, p.tail) == ("ridge", 15, 256))
    counted = next(p for p in f.points if (p.variant, p.split, p.tail) == ("ridge", 20, 256))
    assert (timed.flop_speedup, timed.length) == (2.7, 8192) and counted.length == 1024 and counted.flop_speedup > 1
    hybrid = flop_model(1024, shape={"layer_kinds": ("linear", "linear", "attention") * 10})
    assert all(p.flop_speedup is None and p.length is None for p in frontier(SWEEP, [], [], 5.0, hybrid).points)


def test_lookback_maps_cost_their_window_in_the_flop_count():
    """A fit with lookback K reads (K+1)·H inputs per map: the frontier's FLOP count charges it, and equals the
    filler's own count."""
    import torch

    from ridgefill.torchfill import MapFiller, ModelShape
    from ridgefill.pipeline.frontier import map_flops

    shape = ModelShape(**SMOLLM2)
    maps = shape.layers - 15 - 1
    filler = MapFiller(15, shape.layers, torch.zeros(maps, 2 * shape.hidden, shape.hidden),
                       torch.zeros(maps, shape.hidden))
    assert map_flops(shape, "ridge", 15, None, 1) == filler.flops_per_row() == 2 * map_flops(shape, "ridge", 15)
    plain = flop_model(4096).speedup("ridge", 15, 256)
    assert flop_model(4096, lookbacks={15: 1}).speedup("ridge", 15, 256) < plain


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_the_shape_read_from_a_result_document_is_the_engines(family, tmp_path):
    """flop_model's shape, read from a result document's `model` (what the adapter describes) and the model's
    config.json (evals/flops.described_shape), is the engine's own: dense, or hybrid (Gated DeltaNet layers, MoE
    MLPs); without the config.json there is no shape, so no count."""
    from tiny_models import tiny_model

    from ridgefill.torchfill import ModelShape, adapter_for
    from ridgefill.pipeline.frontier import flop_model

    model = tiny_model(family) if family == "llama" else tiny_model(family)
    adapter = adapter_for(model)
    doc = {"command": "ruler", "model": {"id": str(tmp_path), **adapter.describe()}, "config": {"context": 256}}
    results = [Result(tmp_path / "ruler.json", doc)]
    assert flop_model(None, results) is None
    model.config.to_json_file(tmp_path / "config.json", use_diff=False)
    found = flop_model(None, results)
    assert found is not None and found.shape == ModelShape.of(adapter) and found.length == 256
